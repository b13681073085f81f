"""Optimizer, memory-management and compile strategies, each against the ``none`` baseline of
the same trial on CPU, where tensor accounting is exact (design notes §4).

The mlp is width 256, depth 2 on digits (85,002 parameters); the baseline optimizer is Adam.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import sys
import time

import pytest
import torch

from harness.spec import SpecError, parse_spec, trial_configs
from harness.strategies.base import TrialContext
from harness.strategies.compile import Compile
from harness.strategies.memory_management import (
    ChannelsLast,
    ExpandableSegments,
    OffloadActivations,
)
from harness.strategies.optimizers import Adafactor, Adam8bit, AdamW, Sgd, SgdMomentum
from harness.strategies.settings import OptimizerSettings
from harness.trial.optim import build_optimizer
from harness.trial.run import run_trial
from tests.conftest import BASE_SPEC


def spec(strategy: str = "none", *, family: str = "mlp", batch_size: int = 8) -> dict:
    data = copy.deepcopy(BASE_SPEC)
    sizes = {"m": {"width": 256, "depth": 2}} if family == "mlp" else {"s": {"width": 16}}
    data["model"] = {"family": family, "sizes": sizes}
    data["grid"].update(batch_size=[batch_size], strategy=[strategy])
    data["train"]["optimizer"] = {"name": "adam", "lr": 1e-3, "foreach": False}
    data["train"]["budget"] = {"steps": 8}
    return data


@functools.cache
def metrics(strategy: str = "none", family: str = "mlp", batch_size: int = 8) -> dict:
    """One trial's metrics; cached because several tests share the same baseline."""
    result = run_trial(
        trial_configs(parse_spec(spec(strategy, family=family, batch_size=batch_size)))[0]
    )
    assert result.status == "ok", result.failure_reason
    return result.metrics


# ---- optimizers ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("strategy", "state_bytes_per_param"),
    [("sgd", 0), ("sgd_momentum", 4), ("adamw", 8)],
)
def test_optimizer_state_per_parameter(strategy, state_bytes_per_param):
    got = metrics(strategy)
    n = got["num_params"]
    assert got["mem_param_bytes"] == 4 * n
    # Only the per-tensor fp32 `step` scalars of AdamW (6 x 4 B) are above the oracle.
    assert got["mem_optim_bytes"] == pytest.approx(state_bytes_per_param * n, rel=1e-3)


def test_adafactor_keeps_far_less_state_than_adam():
    # Factored second moment: a row and a column vector per weight matrix, a full vector only
    # for biases; no first moment. Measured: 6,504 B against Adam's 680,040 B.
    adam, adafactor = metrics("none"), metrics("adafactor")
    assert 0 < adafactor["mem_optim_bytes"] < 0.25 * adam["mem_optim_bytes"]
    assert adafactor["peak_allocated_bytes"] < adam["peak_allocated_bytes"]


def test_optimizer_strategies_keep_lr_weight_decay_and_foreach():
    kept = {"lr": 0.5, "weight_decay": 0.1, "foreach": True}
    trial_settings = OptimizerSettings(name="sgd", momentum=0.5, **kept)
    ctx = TrialContext(torch.device("cpu"), "fp32", "mlp", None, 8)
    swapped = {
        Sgd(): OptimizerSettings("sgd", momentum=0.0, **kept),
        SgdMomentum(): OptimizerSettings("sgd", momentum=0.9, **kept),
        AdamW(): OptimizerSettings("adamw", **kept),
        Adafactor(): OptimizerSettings("adafactor", **kept),
        Adam8bit(): OptimizerSettings("adam8bit", **kept),
    }
    for strategy, expected in swapped.items():
        if strategy.name in ("adamw", "adafactor", "adam8bit"):  # another family: its own lr
            expected = OptimizerSettings(expected.name, lr=strategy.default_lr, **{
                k: v for k, v in kept.items() if k != "lr"})  # fmt: skip
        assert strategy.optimizer(trial_settings, ctx) == expected


def test_an_optimizer_swap_to_another_family_takes_that_familys_learning_rate():
    """Adam's 1e-3 leaves SGD nearly still: a swap across families trains at the strategy's
    default; within one (Adam to AdamW) at the spec's; an argument always wins."""
    ctx = TrialContext(torch.device("cpu"), "fp32", "mlp", None, 8)
    adam = OptimizerSettings(name="adam", lr=3e-3)
    assert Sgd().optimizer(adam, ctx).lr == 0.1
    assert SgdMomentum().optimizer(adam, ctx).lr == 0.05
    assert Adafactor().optimizer(adam, ctx).lr == 0.01
    assert AdamW().optimizer(adam, ctx).lr == 3e-3
    assert Adam8bit().optimizer(adam, ctx).lr == 3e-3
    assert Sgd("0.2").optimizer(adam, ctx).lr == 0.2
    sgd = OptimizerSettings(name="sgd", lr=0.02, momentum=0.9)
    assert SgdMomentum().optimizer(sgd, ctx).lr == 0.02
    assert AdamW().optimizer(sgd, ctx).lr == 1e-3


def test_an_optimizer_strategy_takes_its_own_learning_rate():
    # sgd_momentum:0.05 trains at 0.05 whatever train.optimizer.lr says; the trial reports
    # what trained (the recorded lr and momentum params), and the spec checks the argument.
    trial_settings = OptimizerSettings(name="adam", lr=1e-3, weight_decay=0.1)
    ctx = TrialContext(torch.device("cpu"), "fp32", "mlp", None, 8)
    swapped = SgdMomentum("0.05").optimizer(trial_settings, ctx)
    assert (swapped.name, swapped.lr, swapped.momentum, swapped.weight_decay) == (
        "sgd",
        0.05,
        0.9,
        0.1,
    )
    config = trial_configs(parse_spec(spec("sgd_momentum:5e-2")))[0]
    result = run_trial(config)
    assert result.status == "ok", result.failure_reason
    assert (result.info["lr"], result.info["momentum"]) == (0.05, 0.9)
    assert config.strategy_text == "sgd_momentum:5e-2"
    with pytest.raises(SpecError, match="learning rate must be positive"):
        parse_spec(spec("adafactor:-1"))
    with pytest.raises(SpecError, match="learning rate must be a number"):
        parse_spec(spec("adamw:fast"))


def test_adafactor_builds_with_explicit_foreach():
    params = [torch.nn.Parameter(torch.ones(4, 4))]
    optimizer = build_optimizer(OptimizerSettings("adafactor", lr=0.01, foreach=True), params)
    assert isinstance(optimizer, torch.optim.Adafactor)
    assert optimizer.defaults["foreach"] is True


def test_adam8bit_without_torchao_says_how_to_get_it(monkeypatch):
    # A GPU box may lack torchao: the trial fails (recorded as a crash by the worker) with a
    # message that names the package and the install command. None in sys.modules blocks import.
    monkeypatch.setitem(sys.modules, "torchao", None)
    monkeypatch.setitem(sys.modules, "torchao.optim", None)
    with pytest.raises(RuntimeError, match=r"adam8bit needs torchao \(pip install torchao\)"):
        run_trial(trial_configs(parse_spec(spec("adam8bit")))[0])


def test_adam8bit_state_is_a_fraction_of_adams():
    # 8-bit codes + one fp32 scale per 256-value block (+ a 1 KiB code map) per moment for the
    # two weight matrices with >= 4096 values; torchao keeps smaller tensors' moments in fp32.
    # Measured: 195,176 B (2.30 B/param) against Adam's 680,040 B. torchao compiles its step;
    # run eagerly, the step keeps the same state (and here the same peak, 887,624 B) without
    # inductor's 30-60 s of compiling on a CPU. The sweep in test_sweep_strategies.py compiles.
    adam = metrics("none")
    with torch.compiler.set_stance("force_eager"):
        adam8bit = metrics("adam8bit")
    assert 0 < adam8bit["mem_optim_bytes"] < 0.4 * adam["mem_optim_bytes"]


# ---- memory management --------------------------------------------------------------------------


def test_keep_grads_holds_all_gradients_at_the_peak():
    # Batch 256: the peak falls at the start of backward, with every forward activation still
    # alive. The baseline (set_to_none) then holds only the output layer's gradients (10 x 256
    # weights + 10 biases = 10,280 B); keep_grads has held all 4 B/param since before forward,
    # so its peak is higher by exactly the difference. (At batch 8 or 64 the peak is in Adam's
    # step, when both hold all gradients, and the two peaks are equal.)
    none, keep = metrics("none", batch_size=256), metrics("keep_grads", batch_size=256)
    n = none["num_params"]
    assert none["mem_grad_bytes"] < 0.05 * 4 * n
    assert keep["mem_grad_bytes"] == 4 * n
    extra = keep["mem_grad_bytes"] - none["mem_grad_bytes"]
    assert keep["peak_allocated_bytes"] == none["peak_allocated_bytes"] + extra


def test_channels_last_keeps_the_bytes_on_cpu():
    # NHWC changes the layout, not the size: the payoff is faster convolutions on GPUs with
    # tensor cores, which a CPU run cannot show.
    none, nhwc = metrics("none", "cnn", 64), metrics("channels_last", "cnn", 64)
    assert nhwc["peak_allocated_bytes"] == pytest.approx(none["peak_allocated_bytes"], rel=0.05)


def test_channels_last_converts_conv_weights_and_image_batches_only():
    strategy = ChannelsLast()
    ctx = TrialContext(torch.device("cpu"), "fp32", "cnn", None, 2)
    model = strategy.prepare_model(torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3)), ctx)
    assert model[0].weight.is_contiguous(memory_format=torch.channels_last)
    images = strategy.prepare_batch(torch.ones(2, 3, 8, 8))
    assert images.is_contiguous(memory_format=torch.channels_last)
    assert not images.is_contiguous()
    tokens = torch.ones(2, 3, 8, 8, dtype=torch.long)
    assert strategy.prepare_batch(tokens) is tokens
    flat = torch.ones(2, 64)
    assert strategy.prepare_batch(flat) is flat


@pytest.mark.parametrize("strategy", ["offload_activations", "expandable_segments"])
def test_cuda_only_strategies_are_refused_on_cpu(strategy):
    with pytest.raises(SpecError, match=rf"{strategy}.*cuda"):
        parse_spec(spec(strategy))


def test_offload_activations_trains_as_without_it_and_keeps_a_stand_in_cards_copies_off_it():
    """Real tensors go through torch's save_on_cpu (the same gradients); a fake CPU tensor
    standing in for a CUDA one (a CPU predicting for a card) leaves its copy on the meta
    device, where it is not counted as the card's memory (the H200 run found it counted)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    def grads(offload: bool) -> torch.Tensor:
        torch.manual_seed(0)
        layer = torch.nn.Linear(8, 8)
        x = torch.randn(4, 8)
        with OffloadActivations().step_context() if offload else contextlib.nullcontext():
            layer(torch.relu(layer(x))).sum().backward()
        return layer.weight.grad

    torch.testing.assert_close(grads(True), grads(False))
    context = OffloadActivations().step_context()
    with FakeTensorMode():
        standing_in, (device, copy) = context.pack_hook(torch.empty(4, 8))
        assert standing_in and device.type == "cpu" and copy.device.type == "meta"
        back = context.unpack_hook((standing_in, (device, copy)))
        assert back.device.type == "cpu" and back.shape == (4, 8)


def test_expandable_segments_merges_with_the_users_allocator_settings(monkeypatch):
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    assert ExpandableSegments().environment() == {
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"
    }
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128,expandable_segments:False")
    assert ExpandableSegments().environment() == {
        "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128,expandable_segments:True"
    }
    # The device-neutral variable (PyTorch >= 2.9), when set, gets the option too.
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "garbage_collection_threshold:0.6")
    assert ExpandableSegments().environment()["PYTORCH_ALLOC_CONF"] == (
        "garbage_collection_threshold:0.6,expandable_segments:True"
    )


# ---- compile ------------------------------------------------------------------------------------


def test_compile_times_only_the_first_step():
    strategy = Compile()
    ctx = TrialContext(torch.device("cpu"), "fp32", "mlp", None, 8)
    with strategy.step_context():
        time.sleep(0.01)
    first = strategy.compile_time_s
    assert first is not None and first >= 0.01
    with strategy.step_context():
        time.sleep(0.02)
    assert strategy.after_training(torch.nn.Linear(1, 1), ctx) == {"compile_time_s": first}


@pytest.mark.slow  # ~22 s on a cold inductor cache (2 CPU cores), ~5 s on a warm one
def test_compile_runs_and_records_its_compile_time():
    none, compiled = metrics("none", batch_size=64), metrics("compile", batch_size=64)
    assert compiled["compile_time_s"] > 0
    assert compiled["accuracy"] == pytest.approx(none["accuracy"], abs=0.02)
    # Documents a limit, not a goal: Dynamo will not run compiled code while a Python dispatch
    # mode is active, and the memory window's tensor accounting (MemTracker) is one. So the
    # window runs the model eagerly and reports the eager peak; the timed steps are compiled.
    assert compiled["peak_allocated_bytes"] == none["peak_allocated_bytes"]
