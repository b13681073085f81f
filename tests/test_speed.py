"""The step-time prediction: ops' FLOPs and bytes, the roofline, the CPU's calibration, and
the trial's comparison of predicted with measured step time."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.checkpoint import checkpoint

from harness.cuda.cards import card_from_mapping, find_card
from harness.cuda.speed import MATMUL_EFFICIENCY, card_roofline, link_bandwidth
from harness.meters.op_costs import (
    FLOPS,
    FREE,
    MEMORY,
    NO_RULE,
    OpCall,
    OpCostCounter,
    StepCosts,
    rule_of,
)
from harness.meters.roofline import Roofline, step_time
from harness.spec import parse_spec, trial_configs
from harness.trial import calibrate
from harness.trial.estimate import estimate_peak
from harness.trial.run import run_trial
from tests.test_estimate import GPT8, spec

aten = torch.ops.aten


def mlp_step(model: torch.nn.Module, x: torch.Tensor, recompute: bool) -> None:
    hidden = checkpoint(model[0], x, use_reentrant=False) if recompute else model[0](x)
    model[1](hidden).sum().backward()


@pytest.mark.parametrize("fake", [False, True])
def test_a_linear_step_counts_its_matmul_flops_and_recomputation_apart(fake):
    batch, width = 16, 64
    with FakeTensorMode() if fake else contextlib.nullcontext():
        model = torch.nn.Sequential(
            torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh()),
            torch.nn.Linear(width, width),
        )
        x = torch.randn(batch, width)
        counted = {}
        for recompute in (False, True):
            with OpCostCounter() as counter:
                mlp_step(model, x, recompute)
            counted[recompute] = counter.costs
    plain, checkpointed = counted[False], counted[True]
    matmul = 2 * batch * width * width
    # Two layers: forward 1 matmul each, backward 2 (input and weight gradients) but the first
    # layer's input needs no gradient: 2 + 3 matmuls.
    assert plain.flops == 5 * matmul
    assert plain.model_flops == plain.flops
    # The checkpointed layer's forward runs again in the backward: one more matmul, not the
    # model's.
    assert checkpointed.flops == 6 * matmul
    assert checkpointed.model_flops == plain.flops
    recomputed = [call for call in checkpointed.calls if call.recompute]
    assert {call.name for call in recomputed} >= {"addmm", "tanh"}
    assert all(call.rule != FREE for call in plain.calls)
    assert plain.bytes > 3 * batch * width * 4  # at least the input, hidden and output once


def test_every_op_gets_a_rule_and_views_cost_nothing():
    assert rule_of(aten.mm.default) == FLOPS
    assert rule_of(aten._scaled_dot_product_flash_attention_for_cpu.default) == FLOPS
    assert rule_of(aten.add.Tensor) == MEMORY  # tagged pointwise
    assert rule_of(aten.sum.dim_IntList) == MEMORY  # tagged reduction
    assert rule_of(aten._foreach_mul_.Scalar) == MEMORY
    assert rule_of(aten.native_layer_norm.default) == MEMORY
    assert rule_of(aten.view.default) == FREE and rule_of(aten.empty.memory_format) == FREE
    assert rule_of(aten.linalg_qr.default) == NO_RULE


def test_cpu_attention_has_a_flop_formula():
    q = torch.randn(2, 4, 32, 16, requires_grad=True)
    with OpCostCounter() as counter:
        torch.nn.functional.scaled_dot_product_attention(q, q, q).sum().backward()
    attention = [c for c in counter.costs.calls if "attention" in c.name]
    assert attention and all(c.rule == FLOPS and c.flops > 0 for c in attention)
    forward = 2 * (2 * 2 * 4 * 32 * 32 * 16)  # scores and output: two batched matmuls
    assert attention[0].flops == forward


def roofline(**changes) -> Roofline:
    figures = dict(
        name="test",
        peak_flops={"fp32": 1e12, "bf16": 4e12},
        matmul_efficiency=0.5,
        matmul_half_flops={"fp32": 1e6},
        bandwidth=1e11,
        host_overhead_s=1e-5,
        launch_gap_s=1e-6,
        overlapped=True,
    )
    return Roofline(**{**figures, **changes})


def test_the_roofline_prices_each_op_by_its_larger_cost():
    matmul = OpCall("mm", FLOPS, "float32", flops=1e9, bytes=1e6, recompute=False)
    starved = OpCall("mm", FLOPS, "float32", flops=1e3, bytes=1e8, recompute=False)
    copy = OpCall("copy_", MEMORY, "bfloat16", flops=0.0, bytes=2e8, recompute=True)
    costs = StepCosts([matmul, starved, copy], steps=1)
    line = roofline()
    timed = step_time(costs, line)
    compute = (1e9 + 1e6) / (1e12 * 0.5)  # the half-rate curve: FLOPs + half, at the rate
    memory = 1e8 / 1e11 + 2e8 / 1e11  # the starved matmul is priced on its bytes
    assert timed.device_s == pytest.approx(compute + memory + 3 * 1e-6)
    assert timed.host_s == pytest.approx(3e-5)
    assert timed.seconds == pytest.approx(max(timed.device_s, timed.host_s))
    assert timed.compute_bound_s == pytest.approx(compute)
    assert timed.model_flops == 1e9 + 1e3 and timed.flops == 1e9 + 1e3
    assert timed.mfu(line, "fp32") == pytest.approx((1e9 + 1e3) / timed.seconds / 1e12)
    # On a CPU the host is the device: the two add up.
    serial = step_time(costs, roofline(overlapped=False, launch_gap_s=0.0))
    assert serial.seconds == pytest.approx(compute + memory + 3e-5)
    # Two steps counted: per-step figures.
    assert step_time(StepCosts([matmul, matmul], steps=2), line).flops == 1e9


def test_a_card_roofline_takes_the_measured_matmul_efficiency_and_its_link():
    h100 = card_roofline(find_card("h100-80gb"))
    assert (
        h100.matmul_efficiency == MATMUL_EFFICIENCY["h100-80gb"] == pytest.approx(0.803, abs=1e-3)
    )
    assert h100.peak("bfloat16") == 989.4e12 and h100.peak("bf16") == 989.4e12
    assert h100.bandwidth == pytest.approx(3.35e12 * 0.85)
    assert link_bandwidth(find_card("h100-80gb")) == 450e9  # NVLink's 900 GB/s, one way
    assert link_bandwidth(find_card("rtx-4090")) == 32e9  # PCIe Gen4 x16
    assert card_roofline(find_card("rtx-4090")).matmul_efficiency == 0.80  # assumed


def test_a_user_card_without_peaks_or_bandwidth_gets_no_roofline():
    bare = card_from_mapping(
        "mine", {"memory": "8GiB", "compute_capability": "8.6", "sms": 10}, "c"
    )
    assert card_roofline(bare) is None  # nothing to price ops on: no step time, no crash
    one_dtype = {"memory": "8GiB", "compute_capability": "8.6", "sms": 10}
    one_dtype |= {"peak_tflops": {"bf16": 100}, "bandwidth_tbs": 1.0}
    line = card_roofline(card_from_mapping("mine", one_dtype, "c"))
    assert line is not None and line.peak("float32") == 100e12  # the one peak it gives


def test_the_saturating_fit_recovers_rate_and_half_size():
    rate, half = 2e10, 5e5
    work = [1e4, 1e5, 1e6, 1e7, 1e8]
    seconds = [(w + half) / rate for w in work]
    fitted_rate, fitted_half = calibrate.fit_saturating(work, seconds)
    assert fitted_rate == pytest.approx(rate, rel=1e-6)
    assert fitted_half == pytest.approx(half, rel=1e-6)


def test_the_cpu_is_calibrated_once_and_read_back(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    first = calibrate.cpu_roofline(1)
    files = list((tmp_path / "harness" / "calibration").glob("cpu-*.json"))
    assert len(files) == 1
    assert first.peak_flops["fp32"] > 1e8 and first.bandwidth > 1e8
    assert 1e-7 < first.host_overhead_s < 1e-2 and not first.overlapped
    for key in ("fp32", "fp32_backward", "bf16_d16", "bf16_backward_d64", "fp16_backward_d128"):
        assert 0 < first.attention_efficiency[key] <= 1, key  # attention per head dim too
    # A second call reads the file: what is written there is what it returns.
    data = json.loads(files[0].read_text())
    data["bandwidth"] = 123.0
    files[0].write_text(json.dumps(data))
    assert calibrate.cpu_roofline(1).bandwidth == 123.0
    files[0].write_text("{damaged")  # measured again, not a crash
    assert calibrate.cpu_roofline(1).bandwidth > 1e8


def test_an_estimate_predicts_step_time_throughput_and_mfu():
    config = trial_configs(parse_spec(spec("none", "gpt", GPT8, batch_size=8)))[0]
    speed = estimate_peak(config, torch.device("cpu")).speed
    assert speed is not None and speed.device == "cpu"
    assert speed.step_time_ms > 0 and 0 < speed.mfu < 1
    tokens = 8 * GPT8["seq_len"]
    assert speed.throughput == pytest.approx(tokens / (speed.step_time_ms / 1000))
    assert speed.throughput_unit == "tokens/s"
    # Forward and backward of every block's matmuls: at least 6 FLOPs per parameter per token.
    assert speed.model_flops > 6 * 8 * GPT8["d_model"] ** 2 * GPT8["n_layer"] * tokens
    checkpointed = trial_configs(parse_spec(spec("checkpoint", "gpt", GPT8, batch_size=8)))[0]
    again = estimate_peak(checkpointed, torch.device("cpu")).speed
    assert again is not None
    assert again.model_flops == pytest.approx(speed.model_flops)
    assert again.step_flops > speed.step_flops and again.step_time_ms > speed.step_time_ms


def test_a_cuda_target_is_priced_on_its_card():
    data = spec("none", "gpt", GPT8, batch_size=8, dtype="bf16")
    data["device"], data["card"] = "cuda", "a100-80gb"
    config = trial_configs(parse_spec(data))[0]
    prediction = estimate_peak(config, torch.device("cpu"), as_cuda=True)
    assert prediction.speed is not None and prediction.speed.device == "a100-80gb"
    # A tiny model on a large card: bound by the host's dispatches, far below the peak.
    assert prediction.speed.mfu < 0.01
    assert prediction.to_dict()["predicted_step_time_ms"] == prediction.speed.step_time_ms


def test_a_trial_records_how_right_its_predicted_step_time_was():
    result = run_trial(trial_configs(parse_spec(spec("none", "gpt", GPT8, batch_size=8)))[0])
    metrics = result.metrics
    ratio = metrics["predicted_step_time_ms"] / metrics["step_time_ms_p50"]
    assert metrics["step_time_ratio"] == pytest.approx(ratio)
    assert metrics["mfu"] == pytest.approx(metrics["predicted_mfu"] * ratio)
    assert 0 < metrics["mfu"] < 1
    assert result.info["speed_device"] == "cpu"


def test_fused_attention_is_priced_at_its_own_share_each_direction():
    """The CPU's flash attention reaches a small share of the matmul rate, its backward less
    than its forward: each direction takes its calibrated share and cost per call."""
    from harness.meters.roofline import op_seconds

    line = roofline(
        attention_efficiency={"fp32": 0.5, "fp32_backward": 0.25},
        attention_half_flops={"fp32": 0.0, "fp32_backward": 2e6},
    )
    name = "_scaled_dot_product_flash_attention_for_cpu"
    forward = OpCall(name, FLOPS, "float32", flops=1e9, bytes=1.0, recompute=False)
    backward = OpCall(f"{name}_backward", FLOPS, "float32", flops=1e9, bytes=1.0, recompute=False)
    assert op_seconds(forward, line)[0] == pytest.approx(1e9 / (1e12 * 0.5 * 0.5))
    assert op_seconds(backward, line)[0] == pytest.approx((1e9 + 2e6) / (1e12 * 0.5 * 0.25))
    # Not measured (a card): the matmul's rate and half.
    assert op_seconds(forward, roofline())[0] == pytest.approx((1e9 + 1e6) / (1e12 * 0.5))


def test_fused_attention_takes_the_share_calibrated_at_its_nearest_head_dim():
    """The CPU's flash backward runs several times slower per FLOP at head dim 16 than at 64:
    a call takes the share calibrated at the head dim nearest its own (in ratio), and the
    dtype's over all head dims where none was calibrated."""
    from harness.meters.roofline import op_seconds

    line = roofline(
        attention_efficiency={"fp32_backward": 0.5, "fp32_backward_d16": 0.1,
                              "fp32_backward_d64": 0.4},
        attention_half_flops={"fp32_backward": 0.0, "fp32_backward_d16": 0.0,
                              "fp32_backward_d64": 0.0},
    )  # fmt: skip
    name = "_scaled_dot_product_flash_attention_for_cpu_backward"

    def seconds(head_dim: int) -> float:
        call = OpCall(name, FLOPS, "float32", 1e9, 1.0, recompute=False, head_dim=head_dim)
        return op_seconds(call, line)[0]

    assert seconds(16) == pytest.approx(1e9 / (1e12 * 0.5 * 0.1))
    assert seconds(24) == pytest.approx(seconds(16))  # 24/16 is nearer than 64/24
    assert seconds(40) == pytest.approx(1e9 / (1e12 * 0.5 * 0.4))
    assert seconds(0) == pytest.approx(1e9 / (1e12 * 0.5 * 0.5))


def test_mfu_is_over_the_peak_of_the_dtype_the_flops_ran_in():
    """A bf16 model under the fp32 axis (a LoRA base, bf16_params) runs its matmuls at the
    bf16 peak: MFU is over that peak, not fp32's, so it stays below 1."""
    matmul = OpCall("mm", FLOPS, "bfloat16", flops=1e12, bytes=1e6, recompute=False)
    small = OpCall("mm", FLOPS, "float32", flops=1e9, bytes=1e6, recompute=False)
    line = roofline(matmul_half_flops={"fp32": 0.0, "bf16": 0.0})
    timed = step_time(StepCosts([matmul, small]), line)
    assert timed.flops_dtype == "bfloat16"
    assert timed.mfu(line, "fp32") == pytest.approx((1e12 + 1e9) / timed.seconds / 4e12)
    assert timed.mfu(line, "fp32") < 1


@pytest.mark.parametrize(
    "op", [aten._scaled_dot_product_efficient_attention, aten._scaled_dot_product_flash_attention]
)
def test_grouped_query_attention_is_counted_as_its_heads_broadcast(op):
    """A GQA call (2 key/value heads for 8 query heads, ``enable_gqa``) costs what the same call
    with key/value broadcast to 8 heads costs, forward and backward; torch 2.11's own formula
    refused these shapes (the first card run's Llama trials crashed on it)."""
    from harness.meters.op_costs import _FORMULAS

    with FakeTensorMode():
        query = torch.empty(2, 8, 128, 64)
        grouped = torch.empty(2, 2, 128, 64)
        broadcast = torch.empty(2, 8, 128, 64)
    out = torch.empty(2, 8, 128, 64, device="meta")
    forward, backward = _FORMULAS[op], _FORMULAS[getattr(aten, op.__name__ + "_backward")]
    expected = forward(query, broadcast, broadcast, out_val=(out,))
    assert forward(query, grouped, grouped, out_val=(out,)) == expected > 0
    grad = (out, out, out)
    assert backward(out, query, grouped, grouped, out_val=grad) == backward(
        out, query, broadcast, broadcast, out_val=grad
    )
