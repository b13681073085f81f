"""The tracker adapter (``harness.compat.memtracker``): the fast engine, built on ``MemTracker``'s
private parts, and ``MemTracker`` as shipped, the fallback, give the same numbers on the same
training step, to the byte (peak, breakdown, timeline, the fit search's moments; real CPU
steps and fake-tensor predictions); the start-up check names what a torch lacks."""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch

from harness.compat import memtracker as tracker
from harness.compat import memtracker_public as tracker_public
from harness.compat.memtracker import (
    CUDA_ROUNDING,
    ENV,
    FAST,
    MEM,
    PUBLIC,
    TrackerUnavailable,
    attr,
    choose,
    live,
    missing,
    module,
    package,
)
from harness.meters.accounting import PeakTracker
from harness.meters.memory import MemoryWindow
from harness.spec import parse_spec, trial_configs
from harness.trial.distributed import Ranks
from harness.trial.estimate import Predictor, estimate_peak
from harness.trial.setup import build_setup
from harness.workloads import load_dataset
from harness.workloads.tensors import take
from tests.conftest import BASE_SPEC, REPO, SHORT_TEXT

CPU = torch.device("cpu")
KINDS = ("fast", "public")
# A small MLP, and a small transformer whose blocks are checkpointed (so the timeline has a
# recomputation phase, the one phase the fallback tells apart through hooks of its own).
CASES = {
    "mlp": ("mlp", {"width": 256, "depth": 2}, "none"),
    "gpt-checkpoint": ("gpt", {"n_layer": 2, "d_model": 32, "n_head": 2, "seq_len": 32}, "checkpoint"),
}  # fmt: skip


def case_config(name, batch_size=8):
    family, knobs, strategy = CASES[name]
    data = copy.deepcopy(BASE_SPEC)
    data["model"] = {"family": family, "sizes": {"m": knobs}}
    data["data"] = dict(SHORT_TEXT) if family == "gpt" else {"dataset": "digits"}
    data["grid"].update(batch_size=[batch_size], strategy=[strategy])
    return trial_configs(parse_spec(data))[0]


def measured_window(config, **options):
    """A warm-up step, then a memory window of two real CPU steps (``options``: timeline,
    totals), as the trial loop runs it: its reading, timeline and totals."""
    data = load_dataset(config.dataset, config.dataset_options, config.seed)
    torch.manual_seed(0)
    setup = build_setup(config, CPU, Ranks(), data.info, data)
    size = config.batch_size
    batches = [setup.to_device(take(data.train, slice(i * size, (i + 1) * size))) for i in range(3)]
    setup.train_step(batches[0])
    staged = [t for batch in batches[1:] for t in batch.values()]
    window = MemoryWindow(setup.device, setup.model, setup.optimizer, staged, **options)
    with window:
        for batch in batches[1:]:
            setup.train_step(batch, on_micro_batch=window.micro_batch_done)
    totals = window.totals_tracker.totals if window.totals_tracker is not None else None
    return window.reading, window.timeline(2, setup.micro_batches), totals


def both_ways(monkeypatch, measure):
    """``measure()`` with the fast engine, then with the fallback forced as a user forces it."""
    results = {}
    for kind in KINDS:
        monkeypatch.setenv(ENV, kind)
        assert tracker.choice().kind == kind  # what every tracker made now will run on
        results[kind] = measure()
    return results["fast"], results["public"]


@pytest.mark.parametrize("name", list(CASES))
def test_a_measured_step_gives_the_same_peak_breakdown_and_timeline_both_ways(monkeypatch, name):
    config = case_config(name)
    fast, public = both_ways(monkeypatch, lambda: measured_window(config, timeline=True))
    assert fast[0] == public[0]  # peak_allocated_bytes and the five categories, to the byte
    assert fast[0].peak_allocated_bytes > 0
    assert fast[1] == public[1]  # every sample: op index, phase, micro-batch, bytes by category
    phases = {fast[1]["phases"][p] for p in fast[1]["samples"]["phase"]}
    expected = {"forward", "backward", "optimizer"}
    assert phases == expected | ({"recompute"} if "checkpoint" in name else set())
    assert fast[1]["peak_total"] == fast[0].peak_allocated_bytes


@pytest.mark.parametrize("name", list(CASES))
def test_the_running_totals_are_the_same_both_ways(monkeypatch, name):
    """``TotalsTracker``'s moments (the live total after each allocating op, fit's model)."""
    config = case_config(name)
    fast, public = both_ways(monkeypatch, lambda: measured_window(config, totals=True))
    assert fast[0] == public[0]
    assert fast[2] == public[2]
    assert max(fast[2]) == fast[0].peak_allocated_bytes


@pytest.mark.parametrize("name", list(CASES))
def test_a_prediction_on_fake_tensors_is_the_same_both_ways(monkeypatch, name):
    """The estimator runs the same trackers on fake tensors: its prediction, a CUDA target's
    (storages rounded to 512-byte blocks, the caching allocator replayed) and fit's moments."""
    config = case_config(name)

    def predict():
        with Predictor(config, CPU, steps_run=1, totals=True) as predictor:
            moments = predictor.predict(config.batch_size).totals
        return estimate_peak(config, CPU), estimate_peak(config, CPU, as_cuda=True), moments

    fast, public = both_ways(monkeypatch, predict)
    assert fast[0].peak_bytes is not None and fast[1].on_card is not None
    assert fast == public


def test_the_fallback_refuses_frozen_parameters_in_one_line():
    """``MemTracker`` as shipped hooks every parameter, and a frozen one (a LoRA base) refuses
    a hook mid-step; the fallback says so when the model is registered. The fast one tracks it."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    model[0].weight.requires_grad_(False)
    with pytest.raises(tracker_public.FrozenParameters, match=r"cannot track a model with frozen"):
        PeakTracker("public").track_external(model)
    fast = PeakTracker("fast")
    fast.track_external(model)
    with fast:
        model(torch.randn(2, 4)).sum().backward()
    trainable = sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)
    assert fast.get_tracker_snapshot("current")[CPU]["Gradient"] == trainable


# ---- The start-up check ---------------------------------------------------------------------

WRONG = (
    package("torch.nn.functional"),  # a module, not a package
    module("torch.no_such_module"),
    attr(MEM, "MemTracker._no_such_method"),
    attr(MEM, "MemTracker._update_snap", "u_type", "winfo", "no_such_keyword="),
    attr(MEM, "MemTracker._track", "reftype", "t", "one_too_many"),
    live("MemTracker()", "_no_such_attribute"),
    live("snapshot", "NoSuchReference"),
)


def test_this_torch_has_every_piece_and_gets_the_fast_tracker():
    assert missing(FAST) == missing(PUBLIC) == missing(CUDA_ROUNDING) == []
    assert choose("auto").kind == "fast"


def test_the_check_names_each_missing_piece():
    assert missing(WRONG) == list(WRONG)
    assert [str(piece) for piece in WRONG] == [
        "torch.nn.functional (a package loadable without its __init__)",
        "module torch.no_such_module",
        "torch.distributed._tools.mem_tracker.MemTracker._no_such_method",
        "torch.distributed._tools.mem_tracker.MemTracker._update_snap(u_type, winfo, "
        "no_such_keyword=)",
        "torch.distributed._tools.mem_tracker.MemTracker._track(reftype, t, one_too_many)",
        "MemTracker()._no_such_attribute",
        "the key 'NoSuchReference' in a MemTracker snapshot",
    ]
    # Present pieces of each kind, for contrast: the check is no blanket refusal.
    present = (package("torch.distributed"), attr(MEM, "MemTracker._track", "reftype", "t"))
    assert missing(present) == []


def test_a_missing_piece_falls_back_to_memtracker_as_shipped_and_says_which():
    chosen = choose("auto", fast=(*FAST, attr(MEM, "MemTracker._no_such_method")))
    assert chosen.kind == "public" and chosen.engines is tracker_public
    assert chosen.why == (
        f"torch {torch.__version__} lacks "
        "torch.distributed._tools.mem_tracker.MemTracker._no_such_method, which the fast tracker "
        "relies on (tested: torch 2.8.0, 2.14.1, 2.15.0)"
    )


def test_without_a_usable_memtracker_one_line_names_the_version_and_what_is_missing():
    with pytest.raises(TrackerUnavailable) as error:
        choose("auto", fast=WRONG, public=WRONG[1:3])
    assert str(error.value) == (
        f"tensor accounting needs PyTorch's MemTracker, and torch {torch.__version__} lacks "
        "module torch.no_such_module, "
        "torch.distributed._tools.mem_tracker.MemTracker._no_such_method (tested: torch 2.8.0, 2.14.1, 2.15.0)"
    )
    with pytest.raises(TrackerUnavailable, match=r"^kind=fast, but torch .* lacks what the fast"):
        choose("fast", fast=WRONG)
    with pytest.raises(TrackerUnavailable, match=r"^kind=quick: expected one of auto, fast"):
        choose("quick")


def test_forcing_the_fallback_says_so_once_and_imports_memtracker_the_normal_way():
    """In a fresh process as a trial starts: ``HARNESS_TRACKER=public`` gets one line on stderr
    however many trackers are made, and torch's tools package imported with its ``__init__``;
    by default, nothing said, and the ``__init__`` (the inductor with it) skipped."""
    code = (
        "import sys, torch\n"
        "from harness.meters.accounting import PeakTracker, storage_bytes\n"
        "PeakTracker(); PeakTracker(); storage_bytes([torch.zeros(2)])\n"
        "print(hasattr(sys.modules['torch.distributed._tools'], 'MemTracker'))\n"
    )

    def run(**env):
        environ = {k: v for k, v in os.environ.items() if k != ENV}
        return subprocess.run(
            [sys.executable, "-c", code],
            cwd=REPO,
            env={**environ, "PYTHONPATH": str(REPO), **env},
            capture_output=True,
            text=True,
            timeout=300,
            check=True,
        )

    forced = run(**{ENV: "public"})
    assert forced.stderr.splitlines() == [
        "harness: tensor accounting uses PyTorch's MemTracker as shipped, the slower tracker "
        "(same numbers): asked for (HARNESS_TRACKER=public)"
    ]
    assert forced.stdout.strip() == "True"
    default = run()
    assert default.stderr == "" and default.stdout.strip() == "False"
