"""The largest batch (or sequence length) whose predicted peak fits a memory budget.

``python -m harness.trial.fit IN.json OUT.json`` answers, for each configuration and each
budget, without a GPU and without allocating anything: it runs the estimator
(``harness.trial.estimate``: the trial's own step on fake tensors) at a few values of the axis.

Why it takes so few predictions: a step's live memory at any moment is a sum of tensor sizes,
and for a fixed model each size is constant in the batch (parameters, gradients, optimizer
state) or grows linearly with it (inputs, activations); in the sequence length, linearly or
with its square (attention scores). The step's ops, and so its moments, are the same at every
size. So every probe records the live total after every op (``TotalsTracker``), and two probes
(three for ``seq_len``) give each moment's line (parabola) exactly; the peak at any value is
the largest of them, which is why one curve answers every budget, even where the peak moves
from one moment to another (the optimizer step's temporaries at small batches, backward at
large ones). Two predictions confirm each answer: it fits, its successor does not. When the
probes' steps differ (a kernel that changes path with size) the line through the probes'
peaks stands in; when a confirmation fails (CUDA's 512-byte rounding is not linear) the local
slope there aims the next guess, and bisection between the closest values known to fit and
not to fit comes last. Every prediction is cached, so budgets share what earlier ones learned;
each answer says how many predictions it used.

Allowed values respect the strategies: ``ddp:N``, ``fsdp:N`` and ``accumulate:K`` split the
batch, so only multiples of their product are tried.
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from harness.contract import DEFAULT_FIT_MAX
from harness.cuda.device_memory import DeviceMemory
from harness.trial.config import TrialConfig
from harness.trial.depth import DeepPredictor, deep_predictor
from harness.trial.estimate import (
    Predictor,
    bubble_factor,
    predictor_maker,
    replay_for_budget,
    worst_stage,
)
from harness.trial.prediction import PEAK, Prediction
from harness.trial.recompute import auto_strategy, choose
from harness.trial.tool import serve

AXES = ("batch_size", "seq_len")


def at_value(config: TrialConfig, axis: str, value: int) -> TrialConfig:
    """``config`` with the axis set to ``value`` (a sequence length is a model knob)."""
    if axis == "batch_size":
        return replace(config, batch_size=value)
    knobs = {**config.model_knobs, "seq_len": value}
    options = {key: v for key, v in config.data_options.items() if key != "seq_len"}
    return replace(config, model_knobs=knobs, data_options=options)


def axis_step(config: TrialConfig, axis: str) -> int:
    return config.strategy.batch_step if axis == "batch_size" else 1


class Curve:
    """Predictions of one configuration along the axis, cached, counted.

    A prediction is judged against a budget on ``Prediction.judged_bytes``: the allocated peak
    (CPU), or for a CUDA target the device figure (the caching allocator's reservation +
    context + NCCL), what a card runs out on; ``key`` is that figure's name in an answer row."""

    key = PEAK

    def __init__(self, predict: Callable[[int], Prediction], step: int) -> None:
        self.predict_at = predict
        self.step = step
        self.cache: dict[int, Prediction] = {}
        self.totals: dict[int, list[int]] = {}  # the live total after every op, per value
        self.reads: set[int] = set()  # the values one answer consulted (its cost alone)
        self.bounded: dict[tuple[int, int], DeviceMemory | None] = {}  # fits_by_retrying's

    def __call__(self, value: int) -> Prediction:
        self.reads.add(value)
        if value not in self.cache:
            prediction = self.predict_at(value)
            if prediction.totals is not None:
                self.totals[value] = prediction.totals
            self.cache[value] = prediction
        return self.cache[value]

    def peak(self, value: int) -> float | None:
        return self(value).judged_bytes

    def fits(self, value: int, budget: float) -> bool:
        peak = self.peak(value)
        return peak is not None and (peak <= budget or self.fits_by_retrying(value, budget))

    def known_fits(self, value: int, budget: float) -> bool | None:
        """Whether a cached value fits (None: not predictable), not counted as a read:
        scanning the cache for a bracket costs this answer nothing (else every answer after
        the first would count all earlier budgets' predictions as its own)."""
        peak = self.cache[value].judged_bytes
        if peak is None:
            return None
        return peak <= budget or self.fits_by_retrying(value, budget)

    def fits_by_retrying(self, value: int, budget: float) -> bool:
        """A CUDA prediction over ``budget`` unbounded may still fit a card of that size: the
        allocator frees its cache and retries before it gives up. Its allocation order
        replayed with the cap says (``harness.cuda.device_memory``; remembered per budget)."""
        return self.within(value, budget) is not None

    def within(self, value: int, budget: float) -> DeviceMemory | None:
        """The device figures of ``value`` replayed under a cap of ``budget``; None when they
        do not fit even so (or the prediction cannot be replayed: a CPU target)."""
        replayable = self.cache[value].replay
        if replayable is None:
            return None
        key = (value, int(budget))
        if key not in self.bounded:
            self.bounded[key] = replay_for_budget(replayable, int(budget))
        return self.bounded[key]

    def overhead(self, values: list[int]) -> float:
        """How far the judged figure lies above the tensors' peak (the allocator's cached
        segments, its workspaces and what lives outside it), the most at any of ``values``:
        what the moments' model (of tensor bytes) must leave free of the budget."""
        if self.key == PEAK:
            return 0.0
        return max(
            judged - tracked
            for judged, tracked in (
                (self.cache[v].judged_bytes, self.cache[v].tensor_peak_bytes)
                for v in values
                if v in self.cache
            )
            if judged is not None and tracked is not None
        )


# Where the curve is probed, in allowed steps: two for lines (batch), three for parabolas
# (seq_len); far enough apart that CUDA's 512-byte rounding moves a slope little. The smallest
# value is predicted only when no probe fits (does anything fit at all?).
PROBES = {False: (16, 32), True: (16, 32, 64)}


def probe_values(step: int, maximum: int, quadratic: bool) -> list[int]:
    """The allowed values probed first (one, ``step``, when ``--max`` leaves no room)."""
    top = max(step, maximum // step * step)
    return sorted({min(top, n * step) for n in PROBES[quadratic]})


class Moments:
    """Every moment of a step (its live total after each op) as a polynomial of the axis,
    through the totals recorded at two or three values; the peak at a value is their largest.
    ``None`` from ``of`` when the probes did not run the same ops (their traces differ in
    length) or recorded none."""

    def __init__(self, xs: list[int], totals: list[list[int]]) -> None:
        self.xs = xs
        # Plain Python: the search runs inside the prediction's fake-tensor mode, where a
        # tensor made here would be fake too.
        self.moments = list(zip(*totals, strict=True))  # per moment, its total at each x

    @classmethod
    def of(cls, curve: Curve, xs: list[int]) -> Moments | None:
        totals = [curve.totals[x] for x in xs if x in curve.totals]
        if len(xs) < 2 or len(totals) != len(xs) or len({len(t) for t in totals}) != 1:
            return None
        return cls(xs, totals)

    def peak(self, value: float) -> float:
        """Lagrange's interpolation at ``value`` of every moment at once; the largest."""
        weights = [
            math.prod((value - xj) / (xi - xj) for j, xj in enumerate(self.xs) if j != i)
            for i, xi in enumerate(self.xs)
        ]
        return max(sum(w * y for w, y in zip(weights, ys, strict=True)) for ys in self.moments)

    def largest_fitting(self, budget: float, step: int, top: int) -> int:
        """The largest allowed value whose modelled peak fits (``step`` if none does), by
        bisection over the allowed values: the peak never shrinks as the axis grows."""
        if self.peak(top) <= budget:
            return top
        if self.peak(step) > budget:
            return step
        lo, hi = 1, top // step  # in steps: lo fits, hi does not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.peak(mid * step) <= budget:
                lo = mid
            else:
                hi = mid
        return lo * step


def line_guess(curve: Curve, budget: float, a: int, b: int) -> float:
    """Where the line through the predictions at ``a`` and ``b`` crosses ``budget``."""
    pa, pb = curve.peak(a), curve.peak(b)
    assert pa is not None and pb is not None
    slope = (pb - pa) / (b - a)
    return (budget - pa) / slope + a if slope > 0 else math.inf


def quadratic_guess(curve: Curve, budget: float, xs: list[int]) -> float:
    """Where the parabola through three predictions crosses ``budget`` (sequence length:
    attention's scores grow with its square)."""
    (x1, x2, x3), (y1, y2, y3) = xs, [curve.peak(x) or 0.0 for x in xs]
    c = ((y3 - y1) / (x3 - x1) - (y2 - y1) / (x2 - x1)) / (x3 - x2)
    b = (y2 - y1) / (x2 - x1) - c * (x1 + x2)
    a = y1 - b * x1 - c * x1 * x1
    if c <= 0:
        return (budget - a) / b if b > 0 else math.inf
    return (-b + math.sqrt(max(b * b - 4 * c * (a - budget), 0.0))) / (2 * c)


def first_guess(curve: Curve, budget: float, top: int, probes: list[int]) -> int:
    """The allowed value the probes say is the last to fit: by every moment's curve
    (``Moments``) when the probes ran the same ops, else by the curve through their peaks (a
    line; a parabola through three)."""
    moments = Moments.of(curve, probes)
    if moments is not None:
        return moments.largest_fitting(budget - curve.overhead(probes), curve.step, top)
    if len(probes) >= 3:
        root = quadratic_guess(curve, budget, probes[:3])
    elif len(probes) == 2:
        root = line_guess(curve, budget, probes[0], probes[1])
    else:
        root = math.inf  # one probe: the axis' range is one or two steps
    return clamp(curve, root, curve.step, top)


def clamp(curve: Curve, root: float, low: int, high: int) -> int:
    """``root`` rounded down to an allowed value within ``[low, high]``."""
    step = curve.step
    guess = int(root // step) * step if math.isfinite(root) else high
    return max(low, min(guess, high))


def newton_guess(curve: Curve, budget: float, value: int, top: int) -> int:
    """From a failed guess: the curve's local slope there (its prediction and its successor's)
    says where the budget is crossed, within what is known to fit and not to fit."""
    step = curve.step
    known = sorted(v for v in curve.cache if curve.known_fits(v, budget) is not None)
    lo = max(v for v in known if curve.known_fits(v, budget))
    over = [v for v in known if v > lo and not curve.known_fits(v, budget)]
    hi = min(over) if over else top + step
    if value + step > top:
        return clamp(curve, (lo + hi) / 2, lo, hi - step)
    root = line_guess(curve, budget, value, value + step)
    guess = clamp(curve, root, lo, hi - step)
    if guess in curve.cache and guess + step in curve.cache:  # no news: halve the bracket
        guess = clamp(curve, (lo + hi) / 2, lo, hi - step)
    return guess


def confirmed(curve: Curve, value: int, budget: float, top: int) -> bool:
    """The value fits and the next allowed one does not (or there is none). Both are always
    predicted: a failed guess's local slope aims the next one."""
    fits = curve.fits(value, budget)
    following = value + curve.step <= top and curve.fits(value + curve.step, budget)
    return fits and not following


def largest_fitting(
    curve: Curve, budget: float, maximum: int, quadratic: bool = False
) -> dict[str, Any]:
    """The largest allowed value whose predicted peak fits ``budget``, and how it was found:
    ``model`` (the probes' curve, confirmed), ``newton`` (aimed by a failed guess's local
    slope, confirmed), ``bisection`` (neither held), ``none`` (not even the smallest value
    fits)."""
    step = curve.step
    if maximum < step:  # no allowed value within --max (e.g. --max 2 under accumulate:4)
        return {"value": 0, "method": "none"}
    top = maximum // step * step
    probes = probe_values(step, maximum, quadratic)
    for probe in probes:
        curve(probe)
    guess = first_guess(curve, budget, top, probes)
    # Does anything fit? When no probe does, a guess above the smallest value that fits says
    # so by itself (one prediction fewer); otherwise the smallest value decides.
    if (
        not any(curve.fits(probe, budget) for probe in probes)
        and (guess == step or not curve.fits(guess, budget))
        and not curve.fits(step, budget)
    ):
        return {"value": 0, "method": "none"}
    for attempt in range(4):
        if confirmed(curve, guess, budget, top):
            return {"value": guess, "method": "model" if attempt == 0 else "newton"}
        guess = newton_guess(curve, budget, guess, top)
    return {"value": bisect(curve, budget, top), "method": "bisection"}


def bisect(curve: Curve, budget: float, top: int) -> int:
    """Between the largest value known to fit and the smallest known not to (from the cache)."""
    step = curve.step
    known = sorted(curve.cache)
    fitting = [v for v in known if v <= top and curve.known_fits(v, budget)]
    over = [v for v in known if v > max(fitting) and not curve.known_fits(v, budget)]
    lo = max(fitting)
    hi = min(over) if over else None
    if hi is None:
        if curve.fits(top, budget):
            return top
        hi = top
    while hi - lo > step:
        mid = (lo + hi) // 2 // step * step
        mid = min(max(mid, lo + step), hi - step)
        if curve.fits(mid, budget):
            lo = mid
        else:
            hi = mid
    return lo


def fit_config(
    config: TrialConfig,
    axis: str,
    budgets: list[int],
    maximum: int,
    device: torch.device,
    as_cuda: bool = False,
) -> list[dict[str, Any]]:
    """One row per budget: the answer, the predicted peak and breakdown at it and at the next
    allowed value, the margin left, how many predictions it took."""
    step = axis_step(config, axis)
    auto = config.strategy.chooses_for_budget
    with contextlib.ExitStack() as stack:
        if len(config.strategy.layout.roles()) > 1:
            # A pipeline: every stage at every value, each on a fake group of its own (one
            # is up at a time), the worst stage read.
            curve = Curve(lambda v: predict_fresh(at_value(config, axis, v), device, as_cuda), step)
            least = None
        elif axis == "batch_size":  # one model, built once, predicted at every batch size
            # checkpoint:auto / sac:auto: the curve is every block recomputed (the most that
            # fits); at each answer, the least recomputation (another plan: warmed up afresh).
            first = at_value(config, axis, step)
            # a deep model from two shallow ones (harness.trial.depth)
            make = predictor_maker(
                device, as_cuda, first.strategy.build(), steps_run=1, totals=True, rewarm=auto
            )
            deep, _ = deep_predictor(first, device, as_cuda, make)
            predictor = stack.enter_context(deep or make(first, False))
            curve = Curve(predictor.predict, step)
            least = least_recomputation(predictor) if auto else None
        else:  # the sequence length shapes the model: each value builds its own
            curve = Curve(lambda v: predict_fresh(at_value(config, axis, v), device, as_cuda), step)
            least = None
        return answers(curve, budgets, maximum, quadratic=axis == "seq_len", least=least)


def least_recomputation(predictor: Predictor | DeepPredictor) -> Callable[[int, int], Prediction]:
    """``checkpoint:auto`` / ``sac:auto`` at an answer: the least recomputation that fits the
    budget at that batch (``harness.trial.recompute``), the predictor then back on every block
    recomputed, the plan the curve is made of.

    Why the batch first: the largest batch that fits at all is found with every block
    recomputed, then the least recomputation at that batch. A larger batch keeps a GPU busier
    (fewer optimizer steps per sample, larger matmuls) for what full recomputation costs at
    most, one more forward per step (about a third); the reverse order would fix the
    recomputation first and give up batch for it."""
    strategy = auto_strategy(predictor.strategies)

    def at(batch: int, budget: int) -> Prediction:
        chosen = choose(predictor, batch, budget)
        if strategy is not None and strategy.modes is not None:
            strategy.set_modes(None)
            predictor.replanned()
        return chosen

    return at


def predict_fresh(config: TrialConfig, device: torch.device, as_cuda: bool) -> Prediction:
    """One prediction of a model built for it (a sequence length shapes the model); a
    pipeline's worst stage."""
    predictions = []
    for rank in config.strategy.layout.roles():
        with Predictor(config, device, as_cuda, steps_run=1, totals=True, rank=rank) as predictor:
            predictions.append(predictor.predict(config.batch_size))
    return (
        predictions[0] if len(predictions) == 1 else worst_stage(predictions, bubble_factor(config))
    )


def answers(
    curve: Curve,
    budgets: list[int],
    maximum: int,
    quadratic: bool,
    least: Callable[[int, int], Prediction] | None = None,
) -> list[dict[str, Any]]:
    """``fit_config``'s rows, from its curve."""
    first = curve(probe_values(curve.step, maximum, quadratic)[0])
    if not first.ok:  # perhaps too large a value to run: the smallest
        first = curve(curve.step)
    if not first.ok:  # unpredictable or refused: the same at any value
        reads = len(curve.reads)
        why = first.to_dict()
        return [{"budget_bytes": b, "value": None, **why, "predictions": reads} for b in budgets]
    if first.on_card is not None:  # a CUDA target: judged on what the card holds
        curve.key = "predicted_device_bytes"
    rows = []
    for budget in budgets:
        curve.reads = set()
        answer = largest_fitting(curve, budget, maximum, quadratic)
        value = answer["value"]
        row: dict[str, Any] = {"budget_bytes": budget, "value": value, "method": answer["method"]}
        if value:
            at = curve(value)
            fields = at.to_dict()
            row.update({k: v for k, v in fields.items() if k.startswith("predicted_")})
            row.update({k: fields[k] for k in ("card", "note") if k in fields})
            on_curve = True  # the answer's figures are the curve's prediction at the value
            if least is not None:  # auto: the least recomputation at this batch is the answer's
                chosen = least(value, budget)
                if chosen.ok:
                    at, fields, on_curve = chosen, chosen.to_dict(), False
                    row.update({k: v for k, v in fields.items() if k.startswith("predicted_")})
                    row["recomputation"] = chosen.recomputation
            if (at.judged_bytes or 0) > budget:  # fits only by freeing the cache and retrying
                if on_curve:
                    bounded = curve.within(value, budget)
                else:  # auto's chosen plan: its own replay under the cap
                    bounded = replay_for_budget(at.replay, budget) if at.replay else None
                if bounded is not None:
                    row.update(bounded.metrics())
                    row["predicted_peak_bytes"] = float(bounded.allocated)
            row["margin_bytes"] = budget - row[curve.key]
        # Predictions this answer consulted (shared ones computed once): its cost alone.
        row["predictions"] = len(curve.reads)
        nxt = value + curve.step
        if nxt <= maximum:
            row["next_value"] = nxt
            row["next_predicted_peak_bytes"] = curve(nxt).peak_bytes
            if curve.key != PEAK:
                row[f"next_{curve.key}"] = curve.peak(nxt)
        rows.append(row)
    return rows


def fit_answer(
    config: TrialConfig, index: int, request: dict[str, Any], device: torch.device, as_cuda: bool
) -> dict[str, Any]:
    """One config's answer: ``{"rows": fit_config's rows}``."""
    maxima = request.get("max") or [DEFAULT_FIT_MAX[request["axis"]]] * len(request["configs"])
    budgets = [int(b) for b in request["budgets"]]
    return {
        "rows": fit_config(config, request["axis"], budgets, int(maxima[index]), device, as_cuda)
    }


def main(argv: list[str]) -> int:
    """IN: ``{"device", "axis", "budgets": [bytes], "max": [one per config], "configs":
    [TrialConfig dicts], "claims"}`` (``harness.trial.tool``); OUT: per config its rows
    (``fit_config``) and seconds."""
    return serve(argv, fit_answer, "fitted", "seconds")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
