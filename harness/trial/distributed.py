"""A multi-rank trial (``ddp:N``, ``fsdp:N``): torchrun starts N copies of the trial worker.

Each rank trains on its 1/N slice of every global batch and measures its own memory and speed;
the figures are then combined so the trial reports one result: peak memory is the worst rank's
(with that rank's breakdown), throughput is the sum over ranks, step times the slowest rank's.
Rank 0 writes the result, unless a rank failed once the group had started (below). With one
process every helper here is the identity.

A rank that fails alone (an OOM on one GPU, a user model's error) leaves the others waiting in
their next collective, forever on NCCL. So the ranks agree on a failure through the group's
store instead (``agree_on_failure``): the failing rank publishes it; the first to publish writes
the trial's result, naming itself unless every rank failed alike (a loss NaN everywhere), and
exits with an error so torchrun stops the ranks still waiting; a rank that fails later (gloo's
"connection closed" once its peer is gone) defers to it, waits until the result is written, and
writes nothing. No collective runs after a failure, so none can hang; the group's timeout
(``GROUP_TIMEOUT``) bounds a wait on a rank that hangs without failing.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from harness.strategies.layout import Layout
from harness.trial.result import Status, TrialResult

if TYPE_CHECKING:  # torch.distributed re-exports it without declaring it public
    from torch.distributed.distributed_c10d import Store

# How long a collective (or the store) may wait for a peer: long enough for any rank's set-up
# to lag its peers', short of gloo's 30 minutes: a rank that hangs silently becomes a crash.
GROUP_TIMEOUT = timedelta(minutes=5)
# How long the first failing rank waits for the others' reports: ranks that fail together (a
# loss that is NaN everywhere) report within milliseconds, ranks stuck in a collective never.
AGREE_S = 2.0
# How long a rank that deferred waits for the result to be written before it exits anyway.
WRITTEN_WAIT_S = AGREE_S + 30.0
POLL_S = 0.05
FAILURE_KEY = "failure"  # the first failing rank's number; "failure/<rank>" its report
WRITTEN_KEY = "failure/written"  # set once the first failing rank has written the result

_store: Store | None = None  # the group's store, once this process joined the group


@dataclass(frozen=True)
class RankFailure:
    """How one rank's part of a trial ended, as the other ranks read it from the store."""

    rank: int
    status: Status
    reason: str
    peak_rss_bytes: float

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "status": self.status.value})

    @classmethod
    def from_json(cls, text: bytes) -> RankFailure:
        data = json.loads(text)
        return cls(data["rank"], Status(data["status"]), data["reason"], data["peak_rss_bytes"])


@dataclass(frozen=True)
class Verdict:
    """What the ranks agreed a failed trial's status and reason are, and this rank's part."""

    status: Status
    reason: str
    peak_rss_bytes: float  # the worst of the ranks that reported
    writes: bool  # this rank failed first: it writes the result
    everyone: bool  # every rank reported: none is left waiting in a collective
    mine: RankFailure  # how this rank's own part ended (for its log, where it deferred)


class GroupFailure(Exception):
    """A multi-rank trial failed: its agreed result and this rank's part in ending it.

    Raised to the worker's entry point rather than returned: the process must end at once,
    without leaving the group or the interpreter's shutdown (either may wait on a collective a
    peer never joins).
    """

    def __init__(self, result: TrialResult, verdict: Verdict) -> None:
        super().__init__(result.failure_reason)
        self.result = result
        self.verdict = verdict


@dataclass(frozen=True)
class Ranks:
    rank: int = 0
    size: int = 1
    local_rank: int = 0
    # Started by torchrun: a process group even of one rank (``ddp:1``/``fsdp:1`` measure
    # the wrapper's own cost, and their strategies need the group).
    launched: bool = False
    # How the ranks are arranged (``[fsdp:2, tp:2]``: 2 x 2); empty: every rank a data-parallel
    # replica or shard (``ddp:N``, ``fsdp:N``).
    layout: Layout = field(default_factory=Layout)

    @classmethod
    def from_env(cls, layout: Layout | None = None) -> Ranks:
        """torchrun sets RANK / WORLD_SIZE / LOCAL_RANK; a plain process is rank 0 of 1."""
        return cls(
            int(os.environ.get("RANK", 0)),
            int(os.environ.get("WORLD_SIZE", 1)),
            int(os.environ.get("LOCAL_RANK", 0)),
            "WORLD_SIZE" in os.environ,
            layout or Layout(),
        )

    @property
    def batch_parts(self) -> int:
        """How many ways a global batch is split: one part per data-parallel rank (the tensor
        and pipeline ranks of one replica all take the same part)."""
        return self.layout.size("dp") if self.layout.sizes else self.size

    @property
    def batch_part(self) -> int:
        """Which part of the batch this rank takes."""
        return self.layout.coordinates(self.rank).get("dp", 0) if self.layout.sizes else self.rank

    @property
    def stage(self) -> int:
        """This rank's pipeline stage (0 without a pipeline)."""
        return self.layout.coordinates(self.rank).get("pp", 0)

    @property
    def distributed(self) -> bool:
        return self.size > 1 or self.launched

    @property
    def is_writer(self) -> bool:
        return self.rank == 0

    def local_device(self, device: torch.device) -> torch.device:
        """This rank's device (``cuda:LOCAL_RANK`` under torchrun), made the current CUDA
        device before anything touches CUDA: the in-trial prediction runs before the process
        group starts, and without this every rank would create a context on GPU 0."""
        if device.type != "cuda":
            return device
        if self.distributed:
            device = torch.device("cuda", self.local_rank)
        if device.index is not None:  # plain "cuda" is the current device already
            torch.cuda.set_device(device)
        return device

    def start(self, device: torch.device) -> torch.device:
        """Join the process group (gloo on CPU, nccl on CUDA); return this rank's device."""
        if not self.distributed:
            return device
        device = self.local_device(device)
        if not dist.is_initialized():
            join_group("nccl" if device.type == "cuda" else "gloo")
        return device

    def stop(self) -> None:
        global _store
        if not self.distributed:  # e.g. ``Ranks()``, a failed rank's result built alone
            return
        if dist.is_initialized():
            dist.destroy_process_group()
        _store = None

    @property
    def in_group(self) -> bool:
        """This rank has joined the group: a failure from here on must be agreed on."""
        return self.distributed and _store is not None

    def agree_on_failure(self, status: Status, reason: str, peak_rss_bytes: float) -> Verdict:
        """Publish this rank's failure and learn the trial's: the first rank to fail names it.

        Uses the store only, never a collective: the peers may be inside one. The first rank
        to fail waits up to ``AGREE_S`` for the others' reports; if all failed alike (every
        rank raised after the same collective) the reason is theirs, else it names the rank.
        """
        assert _store is not None, "agree_on_failure before the group started"
        mine = RankFailure(self.rank, status, reason, peak_rss_bytes)
        try:
            _store.set(f"{FAILURE_KEY}/{self.rank}", mine.to_json())
            first = int(_store.compare_set(FAILURE_KEY, "", str(self.rank)))
        except RuntimeError:  # the store is gone with torchrun (killed): rank 0 writes, as ever
            labelled = f"rank {self.rank}: {reason}"
            return Verdict(status, labelled, peak_rss_bytes, self.is_writer, False, mine)
        if first != self.rank:
            peer = RankFailure.from_json(_store.get(f"{FAILURE_KEY}/{first}"))
            reason = f"rank {first}: {peer.reason}"
            return Verdict(peer.status, reason, 0.0, writes=False, everyone=False, mine=mine)
        reports = self.failure_reports(AGREE_S)
        alike = len(reports) == self.size and len({(r.status, r.reason) for r in reports}) == 1
        return Verdict(
            status,
            reason if alike else f"rank {self.rank}: {reason}",
            max(r.peak_rss_bytes for r in reports),
            writes=True,
            everyone=len(reports) == self.size,
            mine=mine,
        )

    def failure_reports(self, wait_s: float) -> list[RankFailure]:
        """The failures published so far, after waiting up to ``wait_s`` for every rank's."""
        assert _store is not None
        keys = [f"{FAILURE_KEY}/{rank}" for rank in range(self.size)]
        deadline = time.monotonic() + wait_s
        while not _store.check(keys) and time.monotonic() < deadline:
            time.sleep(POLL_S)
        return [RankFailure.from_json(_store.get(key)) for key in keys if _store.check([key])]

    def announce_written(self) -> None:
        """Tell the ranks that deferred to this one's failure that its result is written."""
        assert _store is not None
        with contextlib.suppress(RuntimeError):  # a store gone with its host: no one waits
            _store.set(WRITTEN_KEY, "1")

    def await_written(self) -> bool:
        """Wait (up to ``WRITTEN_WAIT_S``) for the first failing rank's result to be written.

        A deferring rank must not exit while the writer still needs the store: where torchrun
        does not share its own store, rank 0 hosts it. False when the result never came.
        """
        assert _store is not None
        deadline = time.monotonic() + WRITTEN_WAIT_S
        try:
            while not _store.check([WRITTEN_KEY]):
                if time.monotonic() > deadline:
                    return False
                time.sleep(POLL_S)
        except RuntimeError:  # the store itself is gone: so is the writer's torchrun
            return False
        return True

    def shard(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a global batch."""
        if not self.distributed or self.batch_parts == 1:
            return tensor
        return tensor.chunk(self.batch_parts)[self.batch_part]

    def gather(self, value: Any) -> list[Any]:
        """Every rank's value; just this rank's before the group starts (a trial predicted
        infeasible ends before joining it, every rank alike)."""
        if not self.distributed or not dist.is_initialized():
            return [value]
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, value)
        return out

    def mean(self, value: float) -> float:
        """The same number on every rank (so every rank takes the same decisions)."""
        values = self.gather(value)
        return sum(values) / len(values)

    def worst_memory(self, readings: list[dict[str, float]]) -> dict[str, float]:
        """Of every rank's memory reading (``gather``), the rank's with the highest allocated
        peak (its breakdown), with the highest reserved and device-level peaks of any rank: the
        budget check compares reserved memory on CUDA, and the rank that reserves most may not
        allocate most."""
        worst = dict(max(readings, key=lambda m: m["peak_allocated_bytes"]))
        for key in ("peak_reserved_bytes", "peak_device_bytes"):
            values = [m[key] for m in readings if key in m]
            if values:
                worst[key] = max(values)
        return worst

    def memory_by_rank(self, readings: list[dict[str, float]]) -> list[dict[str, Any]]:
        """Every rank's reading with where it sits on the mesh (``rank``, ``pp``, ``tp``, ...):
        a pipeline's stages hold different memory by design, and each is worth seeing."""
        return [
            {"rank": rank, **self.layout.coordinates(rank), **reading}
            for rank, reading in enumerate(readings)
        ]

    def combined_speed(self, metrics: dict[str, float]) -> dict[str, float]:
        """Throughput adds up over ranks; every other figure is the worst rank's: a step is as
        slow as the slowest rank (``step_time_ms_*``), and the trial as unsteady as its least
        steady rank (``step_time_cv``)."""
        readings = self.gather(metrics)
        combined = {k: max(m[k] for m in readings) for k in metrics}
        combined["throughput"] = sum(m["throughput"] for m in readings)
        return combined

    def maximum(self, value: float) -> float:
        return max(self.gather(value))


def join_group(backend: str) -> None:
    """Join torchrun's process group, keeping its store for the failure agreement.

    The rendezvous is the one ``init_process_group`` would do itself (``env://``: torchrun's
    store), done here so the store is ours to use; the group's timeout bounds every collective.
    """
    # Their public homes (torch.distributed re-exports them without declaring them public);
    # imported here, where the build is known to have torch.distributed.
    from torch.distributed.distributed_c10d import PrefixStore
    from torch.distributed.rendezvous import rendezvous

    global _store
    store, rank, size = next(rendezvous("env://", timeout=GROUP_TIMEOUT))
    store.set_timeout(GROUP_TIMEOUT)
    dist.init_process_group(
        backend,
        store=PrefixStore("default_pg", store),
        rank=rank,
        world_size=size,
        timeout=GROUP_TIMEOUT,
    )
    _store = PrefixStore("harness", store)
