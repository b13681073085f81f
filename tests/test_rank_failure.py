"""A rank of a multi-rank trial that runs out of memory alone (issue 17).

Its peers are then waiting in a collective the failed rank never joins (forever on NCCL, until
gloo's timeout here). The trial must still end at once as that rank's ``oom``, naming it: not
a ``crash`` and not a ``timeout``, so it is not retried either. Real 2-rank gloo trials under
torchrun, launched as the sweep launches them.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path

import psutil
import pytest

from harness.spec import Spec, parse_spec, trial_configs
from harness.sweep.run import run_with_retries
from tests.conftest import BASE_SPEC, copy_fixture, wait_until

pytestmark = pytest.mark.slow

TIMEOUT_S = 120  # the trial's timeout; an agreed failure must end it far sooner

# User model code (``rank_oom:build``): a real allocation failure on one rank only, at its
# ``at_call``-th training forward, so the other rank goes on into DDP's gradient allreduce.
MODEL = """
import os

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor


class FailsOnOneRank(nn.Module):
    def __init__(self, num_classes, rank, at_call, how):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, num_classes))
        self.rank, self.at_call, self.how, self.calls = rank, at_call, how, 0

    def forward(self, x):
        if not isinstance(x, FakeTensor):  # the in-trial prediction runs a copy on fake tensors
            self.calls += 1
            if self.calls == self.at_call and os.environ["RANK"] == str(self.rank):
                if self.how == "cuda":
                    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
                torch.empty(2**50, dtype=torch.uint8)  # the CPU allocator's real refusal
        return self.net(x)


def build(data, rank=1, at_call=3, how="cuda"):
    return FailsOnOneRank(data.num_classes, rank, at_call, how)
"""


def two_rank_spec(folder: Path, family: str, **knobs: object) -> Spec:
    """A ``ddp:2`` spec in ``folder`` (where its user code lies) for one model."""
    data = copy.deepcopy(BASE_SPEC)
    data["model"] = {"family": family, "sizes": {"f": knobs}}
    data["grid"].update(batch_size=[16], strategy=["ddp:2"])
    data["limits"] = {"retries": 1, "trial_timeout": TIMEOUT_S}  # a crash would run twice
    return parse_spec(data, str(folder / "spec.yaml"))


def rank_oom_spec(folder: Path, **knobs: object) -> Spec:
    (folder / "rank_oom.py").write_text(MODEL)
    return two_rank_spec(folder, "rank_oom:build", **knobs)


def trial_processes(marker: str) -> list[psutil.Process]:
    """The trial's torchrun and rank processes still alive (their command lines name it)."""
    found = []
    for process in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(process.info["cmdline"] or [])
        if "harness.trial" in cmdline and marker in cmdline:
            found.append(process)
    return found


def assert_no_rank_left(marker: str) -> None:
    wait_until(lambda: not trial_processes(marker), 60, "no rank outlives its trial")


def test_a_rank_that_runs_out_of_memory_alone_ends_the_trial_as_its_oom(tmp_path):
    """Rank 1 fails inside the memory window while rank 0 waits in the gradient allreduce."""
    spec = rank_oom_spec(tmp_path, rank=1, at_call=3, how="cuda")
    config = trial_configs(spec)[0]
    started = time.monotonic()
    result = run_with_retries(spec, config, tmp_path / "trial")
    elapsed = time.monotonic() - started
    assert result.status == "oom", result.failure_reason
    assert result.failure_reason == "rank 1: CUDA out of memory. Tried to allocate 2.00 GiB"
    assert result.attempts == 1  # oom is not retried; a crash or timeout would have been
    assert elapsed < TIMEOUT_S / 2, elapsed
    # What was measured before the failure is kept: the steps every rank finished.
    assert result.loss_history and len(result.loss_history) == 2
    assert result.metrics["num_params"] > 0 and result.metrics["peak_rss_bytes"] > 0
    assert_no_rank_left(str(tmp_path))


def test_rank_0_running_out_of_memory_alone_is_its_oom(tmp_path):
    """The writer itself fails (a real CPU allocation failure) while rank 1 waits."""
    spec = rank_oom_spec(tmp_path, rank=0, at_call=2, how="cpu")
    config = trial_configs(spec)[0]
    result = run_with_retries(spec, config, tmp_path / "trial")
    assert result.status == "oom", result.failure_reason
    assert result.failure_reason.startswith("rank 0: ")
    assert "can't allocate memory" in result.failure_reason
    assert result.attempts == 1
    assert result.wall_time_s is not None and result.wall_time_s < TIMEOUT_S / 2
    assert len(result.loss_history) == 1
    assert_no_rank_left(str(tmp_path))


def test_ranks_that_fail_together_report_the_failure_as_one(tmp_path):
    """A loss that is NaN on every rank ends every rank at the same step: the reason is theirs
    (no rank to name), and no rank was left waiting."""
    copy_fixture("faulty_models.py", tmp_path)
    spec = two_rank_spec(tmp_path, "faulty_models:build", mode="nan")
    result = run_with_retries(spec, trial_configs(spec)[0], tmp_path / "trial")
    assert result.status == "diverged", result.failure_reason
    assert result.failure_reason == "training loss became nan at step 1"
    assert result.attempts == 1
    assert_no_rank_left(str(tmp_path))
