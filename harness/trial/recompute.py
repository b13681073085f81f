"""``checkpoint:auto`` and ``sac:auto``: the least recomputation whose predicted peak fits the
trial's memory budget, chosen before training with the estimator.

Users checkpoint by trial and error (run, run out of memory, checkpoint a few more layers, run
again). The estimator predicts the exact peak of any plan, so the trial tries plans on its fake
model instead, in this order:

1. Every block recomputed in full: the most memory recomputation can save. If even that does
   not fit, nothing does: the trial is ``infeasible`` with that peak, the smallest reachable.
2. No block recomputed in full (``checkpoint:auto``: nothing recomputed; ``sac:auto``: every
   block under ``sac``'s policy). If that fits, it is the plan.
3. Otherwise the fewest blocks recomputed in full that fit, by bisection on their number
   (the peak does not grow as more blocks are recomputed), taking blocks in the order of
   ``block_order``: most activation bytes saved per FLOP recomputed first, and among equal
   blocks (a transformer's) the earliest first, since an early block is recomputed late in
   backward, when the later blocks' activations are already freed.

So a plan costs 2 + log2(blocks) predictions on one built model (a 32-block Llama: 7). A deep
model's two uniform plans (steps 1 and 2) are carried from shallow copies
(``harness.trial.depth``), so the whole model is built only where step 3 runs.
The chosen plan stays on the strategy object, which the trial then applies to its real model;
the prediction the trial records is the chosen plan's.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

from harness.meters.op_costs import ATTENTION_FORMULAS
from harness.strategies.base import Strategy
from harness.strategies.checkpoint import KEEP, Checkpoint, describe
from harness.trial.prediction import Prediction
from harness.units import format_bytes

# Blocks whose bytes saved per FLOP differ by less than this factor count as equal (then the
# earliest goes first): a transformer's blocks differ only by the first block's input.
EQUAL_RATIO = 1.05


def auto_strategy(strategies: tuple[Strategy, ...]) -> Checkpoint | None:
    """The trial's ``checkpoint:auto`` / ``sac:auto`` strategy, if it has one."""
    return next((s for s in strategies if isinstance(s, Checkpoint) and s.auto), None)


def block_order(predictor: Any, batch_size: int) -> list[int]:
    """The blocks in the order they are recomputed in full: most saved bytes per recomputed
    FLOP first, equal blocks earliest first."""
    return in_order(block_keys(predictor, batch_size))


def in_order(keys: list[int]) -> list[int]:
    """Blocks ranked by ``block_keys``: the smallest key first, equal keys earliest first."""
    return sorted(range(len(keys)), key=lambda index: (keys[index], index))


def block_keys(predictor: Any, batch_size: int) -> list[int]:
    """Each block's rank key: minus its saved bytes per recomputed FLOP on a log scale of
    ``EQUAL_RATIO`` steps (one forward on the fake model, every block kept, measures both per
    block: the bytes autograd saves inside it, parameters left out, and its FLOPs); blocks
    that save alike share a key."""
    setup, strategy = predictor.setup, auto_strategy(predictor.strategies)
    assert setup is not None and strategy is not None and strategy.recomputation is not None
    blocks = strategy.recomputation.blocks
    saved = [0] * len(blocks)
    flops = [0] * len(blocks)
    seen: list[set[int]] = [set() for _ in blocks]
    current: list[int | None] = [None]
    # Grouped-query attention counted as the kernel computes it (torch 2.11's formula asserts).
    counter = FlopCounterMode(display=False, custom_mapping=ATTENTION_FORMULAS)
    starts = [0] * len(blocks)

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        index = current[0]
        if index is not None and not isinstance(tensor, torch.nn.Parameter):
            storage = tensor.untyped_storage()
            key = storage._cdata
            if key not in seen[index]:
                seen[index].add(key)
                saved[index] += storage.nbytes()
        return tensor

    def enter(index: int) -> Any:
        def hook(module: Any, args: Any, kwargs: Any = None) -> None:
            current[0] = index
            starts[index] = counter.get_total_flops()

        return hook

    def leave(index: int) -> Any:
        def hook(module: Any, args: Any, output: Any, kwargs: Any = None) -> None:
            current[0] = None
            flops[index] += counter.get_total_flops() - starts[index]

        return hook

    handles = [
        h
        for i, block in enumerate(blocks)
        for h in (block.register_forward_pre_hook(enter(i)), block.register_forward_hook(leave(i)))
    ]
    before = strategy.recomputation.modes
    strategy.recomputation.modes = (KEEP,) * len(blocks)
    try:
        batch = setup.to_device(predictor.info.example_batch(batch_size))
        saving = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        with counter, saving, setup.precision.autocast():
            loss, kept = setup.task.forward(setup.model, batch)
        del loss, kept, batch
    finally:
        strategy.recomputation.modes = before
        for handle in handles:
            handle.remove()

    def key(index: int) -> int:
        ratio = max(saved[index], 1) / max(flops[index], 1)
        return -round(math.log(ratio) / math.log(EQUAL_RATIO))

    return [key(index) for index in range(len(blocks))]


def fits_budget(prediction: Prediction | None, budget: float) -> bool:
    """Whether a prediction fits ``budget`` as the trial judges it; one replayed without a cap
    (``harness fit``'s, which judges every budget itself) may still fit by the allocator's
    freeing its cache and retrying, which its replay under the cap says."""
    if prediction is None or not prediction.ok or prediction.judged_bytes is None:
        return False
    if prediction.judged_bytes <= budget:
        return True
    return prediction.replay is not None and prediction.replay.capped(int(budget)) is not None


def smallest_fitting(
    peak_at: Callable[[int], float | None], fits: Callable[[int], bool], count: int, budget: float
) -> int:
    """The fewest blocks in full (0..``count``) that fit ``budget``, knowing ``count`` fits
    and 0 does not: the line through the two ends' peaks aims a guess (a transformer's blocks
    save alike, so the peak falls about linearly), its neighbour confirms it, bisection
    between what fits and what does not finishes. A linear model: two more predictions."""
    low, high = 0, count  # low does not fit, high does
    peak_low, peak_high = peak_at(low) or math.inf, peak_at(high) or 0.0
    if high - low > 1 and peak_low > peak_high:
        guess = low + math.ceil((peak_low - budget) / (peak_low - peak_high) * (high - low))
        guess = min(max(guess, low + 1), high - 1)
        if fits(guess):
            high = guess
            if guess - 1 > low and not fits(guess - 1):
                low = guess - 1
        else:
            low = guess
            if guess + 1 < high and fits(guess + 1):
                high = guess + 1
    while high - low > 1:
        middle = (low + high) // 2
        if fits(middle):
            high = middle
        else:
            low = middle
    return high


def choose(predictor: Any, batch_size: int, budget: float | None) -> Prediction:
    """The prediction of the least recomputation that fits ``budget`` (bytes, judged as the
    trial judges: a CUDA target's device figure, else the peak), its plan left on the
    strategy, the choice described in ``Prediction.recomputation``. Over budget with every
    block recomputed: that prediction (the trial is then ``infeasible``). ``predictor`` is
    the configuration's ``harness.trial.estimate.Predictor`` (``rewarm=True`` for a CUDA
    target: each plan is warmed up as a fresh process would) or a deep model's
    ``harness.trial.depth.DeepPredictor`` (the plans that treat every block alike carried
    from shallow copies, the others traced whole); it tells how many blocks the model has
    (``block_count``) and in which order they are recomputed (``block_order``)."""
    strategy = auto_strategy(predictor.strategies)
    assert strategy is not None
    if budget is None:
        return Prediction.refused(
            f"{strategy.name}:auto chooses for a memory budget: set device_memory or a card"
        )
    chosen = choose_on(predictor, lambda: {"": predictor.predict(batch_size)}, batch_size,
                       {"": budget})  # fmt: skip
    return chosen[""]


def choose_on(
    predictor: Any,
    predict: Callable[[], dict[str, Prediction]],
    batch_size: int,
    budgets: dict[str, float],
) -> dict[str, Prediction]:
    """``choose`` for several budgets at once, by name: ``predict`` runs the current plan's
    step once and answers for each name it can (``harness plan``: every card that shares the
    trace, each replayed under its own budget), so a plan tried for one card is every card's.
    A name ``predict`` leaves out of an answer is left out of the result."""
    strategy = auto_strategy(predictor.strategies)
    assert strategy is not None
    name = f"{strategy.name}:auto"
    tried: dict[int, dict[str, Prediction]] = {}
    count = 0

    def plan(full: int) -> tuple[str, ...]:
        if 0 < full < count and strategy.order is None:  # the ratios do not depend on the batch
            strategy.order = predictor.block_order(batch_size)  # asked only where it matters
        return strategy.plan(
            (strategy.order or [])[:full] if full < count else list(range(count)), count
        )

    def at(full: int) -> dict[str, Prediction]:
        if full not in tried:
            strategy.set_modes(plan(full))
            predictor.replanned()
            tried[full] = predict()
        return tried[full]

    if strategy.modes is not None:  # every block in full, first
        strategy.set_modes(None)
        predictor.replanned()
    most = predict()
    if strategy.recomputation is None or not any(p.ok for p in most.values()):
        return most
    count = predictor.block_count()
    tried[count] = most
    chosen: dict[str, tuple[int, str]] = {}
    for card, budget in budgets.items():
        if card not in most:
            continue

        def peak_at(full: int, card: str = card) -> float | None:
            prediction = at(full).get(card)
            return prediction.judged_bytes if prediction is not None and prediction.ok else None

        def fits(full: int, card: str = card, budget: float = budget) -> bool:
            return fits_budget(at(full).get(card), budget)

        if peak_at(count) is None:
            continue
        if not fits(count):
            chosen[card] = (count, "nothing fits, every block recomputed: the smallest peak")
        elif fits(0):
            chosen[card] = (0, "no block needs recomputing in full")
        else:
            full = smallest_fitting(peak_at, fits, count, budget)
            chosen[card] = (full, f"{full} of {count} blocks in full, the fewest that fit")
    out = dict(most)
    for card, (full, why) in chosen.items():
        prediction = tried[full][card]
        steps = ", ".join(
            f"{k} -> {format_bytes(answer[card].judged_bytes or 0)}"
            for k, answer in sorted(tried.items())
            if card in answer and answer[card].ok
        )
        runs = len(tried)
        text = (
            f"{name} for {format_bytes(budgets[card])}: {why} ({describe(plan(full))}); predicted "
            f"peak by blocks in full: {steps} ({runs} prediction{'s' if runs > 1 else ''})"
        )
        out[card] = replace(prediction, recomputation=text)
    if len(chosen) == 1:  # one budget: its plan is the one the trial applies
        ((full, _),) = chosen.values()
        strategy.set_modes(plan(full))
    return out
