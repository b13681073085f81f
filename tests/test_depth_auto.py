"""``checkpoint:auto`` on a deep model (``harness.trial.depth``): the chosen plan and its
figures equal the whole model's search. A file of its own: each case builds the model eight
times (``make test`` runs a file per process, and ``test_depth.py`` is long already)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from harness.trial.config import TrialConfig
from harness.trial.depth import SHALLOW, deep_predictor
from harness.trial.estimate import Predictor, predictor_maker
from harness.trial.recompute import auto_strategy, choose
from tests.test_depth import GPT, LLAMA, config_of

CPU = torch.device("cpu")


def auto_budget(config: TrialConfig) -> int:
    """A budget between the whole model's device figures with every block recomputed in full
    and with none: the least recomputation that fits it recomputes some blocks, not all."""
    with Predictor(config, CPU, as_cuda=True, rewarm=True) as predictor:
        strategy = auto_strategy(predictor.strategies)
        assert strategy is not None
        most = predictor.predict(config.batch_size)
        count = predictor.block_count()
        strategy.set_modes(strategy.plan([], count))
        predictor.replanned()
        least = predictor.predict(config.batch_size)
    assert most.on_card is not None and least.on_card is not None
    low, high = most.on_card.device_bytes, least.on_card.device_bytes
    assert high - low >= 8 * 2**20, (low, high)
    return int((low + high) / 2)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("family", "size", "strategy"),
    [("gpt", GPT, "checkpoint:auto"), ("hf", LLAMA, ["lora:8", "checkpoint:auto"])],
)
def test_auto_recomputation(family, size, strategy):
    """``checkpoint:auto`` on a deep model: the plans that treat every block alike (every block
    in full, none) carried from the shallow traces, the others traced whole, the blocks
    ranked on a shallow copy (LoRA's first block, whose input needs no gradient, ranks last);
    the plan chosen and every figure at it equal the whole model's search."""
    config = replace(config_of(family, size, strategy), batch_size=16)
    config = replace(config, device_memory_bytes=auto_budget(config))
    strategies = config.strategy.build()
    make = predictor_maker(CPU, True, strategies, rewarm=True)
    deep, why = deep_predictor(config, CPU, True, make, min_depth=SHALLOW + 2)
    assert deep is not None, why
    with deep:
        carried = choose(deep, config.batch_size, deep.budget())
        assert deep.whole is None, deep.why
        # built for the mixed plans, the whole model predicts every later plan: no shallow
        # model is built beside its open fake world (prepare refuses to)
        assert deep.mixed is not None and not deep.carries()
    with Predictor(config, CPU, as_cuda=True, rewarm=True) as predictor:
        traced = choose(predictor, config.batch_size, predictor.budget())
    assert "the fewest that fit" in traced.recomputation and "keep:" in traced.recomputation
    assert carried.recomputation == traced.recomputation
    assert "traced whole: a plan that recomputes some blocks" in carried.note
    carried_figures, traced_figures = carried.to_dict(), traced.to_dict()
    carried_figures.pop("note"), traced_figures.pop("note")
    assert carried_figures == traced_figures
