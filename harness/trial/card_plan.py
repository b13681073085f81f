"""Predict one configuration at several batch sizes on several cards, tracing as little as
possible: ``python -m harness.trial.card_plan IN OUT`` (``harness plan``'s trial-layer tool).

A grid planned on three cards is three estimates of every point, each a real training step on
fake tensors (an 8B model: 5-25 s to build, 4-30 s a window). Most of that work is the same
everywhere: the model is built once per configuration and each batch size is one more window
on it (``Predictor``), and a window traced for one card is every card's step whose kernels
choose alike (``Predictor.shares_trace``: the attention backends; the cuBLAS workspace is
resized in the replay), so its allocations are replayed under each card's memory, context and
budget and its ops priced on each card's roofline. A card whose step differs (another
attention backend) gets a trace of its own, on the same build (``Predictor.retarget``). Every
figure equals what ``harness estimate`` says for the point on that card (tests hold the two
equal).

IN: ``{"device": "cuda"|"cpu", "configs": [TrialConfig dicts], "groups": [{"batches": {card:
[batch sizes]}}], "cards": {name: Card dict}, "budgets": {name: bytes}}``, one group per config
(a CPU group's only card is ``cpu``); OUT: per config, ``{"rows": [estimate rows, each with its
card and batch size], "traces": [the cards each trace served]}``.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from typing import Any

import torch

from harness.contract import CPU_CARD
from harness.cuda.cards import Card
from harness.strategies.base import Strategy
from harness.trial.config import TrialConfig
from harness.trial.depth import DeepPredictor, deep_predictor
from harness.trial.estimate import (
    Predictor,
    closed_form,
    device_note,
    estimate_peak,
    predictor_maker,
)
from harness.trial.prediction import Prediction
from harness.trial.recompute import auto_strategy, choose, choose_on
from harness.units import format_bytes


def plan_group(
    config: TrialConfig, index: int, request: dict[str, Any], device: torch.device, as_cuda: bool
) -> dict[str, Any]:
    """Every (card, batch size) of group ``index``: one build, one warm-up and window per batch
    size and run of cards that share a trace (``Predictor.retarget`` between runs), smallest
    batch first. Unless the request says ``every``, a card whose prediction at one batch size
    exceeds its budget is not predicted at larger ones (memory grows with the batch): those
    rows say which batch already did not fit."""
    wanted = {name: set(sizes) for name, sizes in request["groups"][index]["batches"].items()}
    batches = sorted(set().union(*wanted.values()))
    cards = {name: Card.from_dict(data) for name, data in request.get("cards", {}).items()}
    budgets: dict[str, int | None] = request.get("budgets", {})
    every = bool(request.get("every"))
    found: dict[tuple[str, int], Prediction] = {}
    over: dict[str, str] = {}  # card -> why its larger batches were not predicted

    def predicted(name: str, batch: int, prediction: Prediction) -> None:
        found[name, batch] = prediction
        budget = budgets.get(name) or (cards[name].memory_bytes if name in cards else None)
        figure = judged(prediction)
        if not every and budget and figure is not None and figure > budget:
            over[name] = (
                f"not predicted: batch {batch} already needs {format_bytes(figure, short=True)}"
                f" of {format_bytes(budget, short=True)}"
            )

    if len(config.strategy.layout.roles()) > 1:  # a pipeline: every stage, each point afresh
        for name in wanted:
            for batch in sorted(wanted[name]):
                if name not in over:
                    on_cpu = name == CPU_CARD
                    point = point_of(config, name, batch, cards, budgets)
                    where = torch.device("cpu") if on_cpu else device
                    predicted(name, batch, estimate_peak(point, where, as_cuda and not on_cpu))
        return {"rows": rows_of(config, wanted, cards, budgets, found, over, as_cuda)}
    if CPU_CARD in wanted:
        cpu = torch.device("cpu")
        with Predictor(replace(config, batch_size=batches[0]), cpu, False) as predictor:
            for batch in sorted(wanted[CPU_CARD]):
                if CPU_CARD in over:
                    continue
                if auto_strategy(predictor.strategies) is not None:
                    budget = budgets.get(CPU_CARD) or config.device_memory_bytes
                    predicted(CPU_CARD, batch, choose(predictor, batch, budget))
                else:
                    predicted(CPU_CARD, batch, predictor.predict(batch))
    pending = [cards[name] for name in wanted if name != CPU_CARD]
    traces: list[list[str]] = []  # the cards each trace served, in the order traced
    strategies = config.strategy.build()
    predictor: Predictor | DeepPredictor | None = None
    try:
        while pending:
            first = pending[0]
            budget = budgets.get(first.name) or first.memory_bytes
            if predictor is None or not predictor.retarget(first, budget):
                if predictor is not None:
                    predictor.close()
                lead = replace(
                    config, card=first.to_dict(), batch_size=batches[0], device_memory_bytes=budget
                )
                predictor = lead_predictor(lead, device, as_cuda, strategies)
            missed: set[str] = set()  # cards whose step was not the lead's at some batch
            if isinstance(predictor, DeepPredictor):  # a costly build traces them all at once
                predictor.expect([b for c in pending for b in wanted[c.name]])
            for batch in batches:
                live = [c for c in pending if batch in wanted[c.name] and c.name not in over]
                live = [c for c in live if c.name not in missed]
                if not live:
                    continue
                answers = on_cards(predictor, batch, live, budgets)
                for card in live:
                    if card.name in answers:
                        predicted(card.name, batch, answers[card.name])
                    else:
                        missed.add(card.name)
            done = [card for card in pending if card.name not in missed]
            for card in missed:  # traced again, on their own step (the model is not built again)
                for batch in batches:
                    found.pop((card, batch), None)
                over.pop(card, None)
            pending = [card for card in pending if card.name in missed]
            traces.append([card.name for card in done])
    finally:
        if predictor is not None:
            predictor.close()
    return {
        "rows": rows_of(config, wanted, cards, budgets, found, over, as_cuda),
        "traces": traces,
        "progress_note": "; ".join(traced_note(names) for names in traces),
    }


def lead_predictor(
    lead: TrialConfig, device: torch.device, as_cuda: bool, strategies: tuple[Strategy, ...]
) -> Predictor | DeepPredictor:
    """What predicts ``lead`` at every batch size: a deep model from two shallow ones
    (``harness.trial.depth``), else the whole model, warmed up again at each batch."""
    make = predictor_maker(device, as_cuda, strategies, rewarm=True)
    deep, _ = deep_predictor(lead, device, as_cuda, make)
    return deep if deep is not None else make(lead, False)


def traced_note(names: list[str]) -> str:
    """``traced once for 2 cards: rtx-4090, a100-80gb``: which cards one trace served."""
    return f"traced once for {len(names)} card{'s' * (len(names) != 1)}: {', '.join(names)}"


def point_of(
    config: TrialConfig, name: str, batch: int, cards: dict[str, Card], budgets: dict[str, Any]
) -> TrialConfig:
    """The trial ``config`` would be at ``batch`` on card ``name`` (this host's CPU: no card)."""
    point = replace(config, batch_size=batch, card=None, device_memory_bytes=None)
    if name == CPU_CARD:
        return point
    budget = budgets.get(name) or cards[name].memory_bytes
    return replace(point, card=cards[name].to_dict(), device_memory_bytes=budget)


def rows_of(
    config: TrialConfig,
    wanted: dict[str, set[int]],
    cards: dict[str, Card],
    budgets: dict[str, Any],
    found: dict[tuple[str, int], Prediction],
    over: dict[str, str],
    as_cuda: bool,
) -> list[dict[str, Any]]:
    rows = []
    for name, sizes in wanted.items():
        for batch in sorted(sizes):
            point = point_of(config, name, batch, cards, budgets)
            if (name, batch) in found:
                rows.append(row(point, found[name, batch], name, as_cuda and name != CPU_CARD))
            else:
                rows.append({"trial_key": point.trial_key, "batch_size": batch, "card": name,
                             "skipped": over[name]})  # fmt: skip
    return rows


def on_cards(
    predictor: Predictor | DeepPredictor,
    batch: int,
    cards: list[Card],
    budgets: dict[str, int | None],
) -> dict[str, Prediction]:
    """``Predictor.predict_on``; for ``checkpoint:auto`` / ``sac:auto``, each card's least
    recomputation that fits its budget, every plan tried traced once for all the cards that
    share it (``harness.trial.recompute.choose_on``)."""
    if auto_strategy(predictor.strategies) is None:
        return predictor.predict_on(batch, cards, budgets)
    limits = {card.name: float(budgets.get(card.name) or card.memory_bytes) for card in cards}
    return choose_on(predictor, lambda: predictor.predict_on(batch, cards, budgets), batch, limits)


def judged(prediction: Prediction) -> float | None:
    """The figure a budget holds a prediction to: the device figure on a card (what it must
    hold), the allocated peak on a CPU; None without a prediction."""
    if not prediction.ok:
        return None
    if prediction.on_card is not None:
        return prediction.on_card.device_bytes
    return prediction.peak_bytes


def row(config: TrialConfig, prediction: Prediction, card: str, as_cuda: bool) -> dict[str, Any]:
    """One (card, batch size) as ``harness estimate`` writes a point."""
    note = "; ".join(filter(None, (device_note(config, as_cuda), prediction.note)))
    fields = {k: v for k, v in prediction.to_dict().items() if k != "note"}
    out = {
        "trial_key": config.trial_key,
        "batch_size": config.batch_size,
        **fields,
        "card": card,
        "note": note,
    }
    if prediction.ok:
        out.update(closed_form(config, prediction))
    return out


if __name__ == "__main__":
    from harness.trial.tool import serve

    sys.exit(serve(sys.argv[1:], plan_group, "planned", "plan_seconds"))
