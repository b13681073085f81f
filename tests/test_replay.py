"""``harness replay``: recorded CUDA memory snapshots read safely, rebuilt at the trace's first
event and replayed through the allocator model (harness.cuda.snapshot, harness.cli.replay).

The snapshots here are synthetic but in the real on-disk format (a dict of plain data pickled
with plain ``pickle.dump``, torch 2.5+ fields or torch 2.0's), written by driving the harness
allocator model itself as "the card", with the recording switched on mid-run."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from harness.cli import main
from harness.cuda.allocator import (
    DEFAULT_CONFIG,
    SEGMENT_ALLOC,
    SEGMENT_FREE,
    SEGMENT_MAP,
    SEGMENT_UNMAP,
    AllocatorConfig,
    CachingAllocator,
    MiB,
)
from harness.cuda.snapshot import (
    SnapshotError,
    load_snapshot,
    override_settings,
    parse_snapshot,
    read_snapshot,
    rebuild_start,
    replay,
    replay_report,
)
from tests.conftest import expect_exit

REPO = Path(__file__).resolve().parent.parent
Op = tuple[Any, ...]  # ("malloc", key, size, stream) | ("free", key) | ("empty_cache",)


# -- a card that records: the allocator model driven as torch drives the real one ------------


def _settings(config: AllocatorConfig) -> dict[str, Any]:
    """``allocator_settings`` as torch 2.5 writes it (effective values, 8 keys)."""
    return {
        "PYTORCH_CUDA_ALLOC_CONF": config.text(),
        "max_split_size": -1 if config.max_split_size is None else config.max_split_size,
        "garbage_collection_threshold": config.garbage_collection_threshold,
        "expandable_segments": config.expandable_segments,
        "pinned_num_register_threads": 1,
        "release_lock_on_cudamalloc": False,
        "pinned_use_cuda_host_register": False,
        "roundup_power2_divisions": {
            str(1 << i): d for i, d in enumerate(config.roundup_power2_divisions)
        },
    }


def record(
    ops: list[Op], config: AllocatorConfig = DEFAULT_CONFIG, start_at: int = 0, old: bool = False
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Run ``ops`` on a CachingAllocator and write what ``_dump_snapshot`` would: the trace of
    ops from ``start_at`` on, the segments at the end. ``old``: torch 2.0's format (blocks
    without addresses, no settings, no is_expandable). Also returns what the card knew: its
    state when recording began and its peak reserved while recording."""
    card = CachingAllocator(config)
    trace: list[dict[str, Any]] = []
    addresses: dict[Any, int] = {}
    requested: dict[int, int] = {}
    truth: dict[str, Any] = {}
    peak = 0

    def entry(action: str, addr: int, size: int, stream: int = 0) -> None:
        if recording:
            item = {"action": action, "addr": addr, "size": size, "stream": stream}
            if not old:
                item.update(frames=[], time_us=len(trace), compile_context="N/A")
            trace.append(item)

    for i, op in enumerate(ops):
        recording = i >= start_at
        if i == start_at:
            truth["segments"] = card.segments()
            peak = card.reserved_bytes
        if op[0] == "malloc":
            _, key, size, stream = op
            address = card.malloc(size, stream)
            for d in card.last_decisions:
                entry(d.kind, d.address, d.size, d.stream)
            entry("alloc", address, size, stream)
            addresses[key] = address
            requested[address] = size
        elif op[0] == "free":
            address = addresses.pop(op[1])
            size = requested.pop(address)
            entry("free_requested", address, size)
            card.free(address)
            entry("free_completed", address, size)
        else:
            card.empty_cache()
            for d in card.last_decisions:
                entry(d.kind, d.address, d.size, d.stream)
        if recording:
            peak = max(peak, card.reserved_bytes)
    truth["peak_reserved"] = peak
    truth["card"] = card
    segments = []
    for seg in card.segments():
        blocks = []
        for b in seg.blocks:
            block = {
                "size": b.size,
                "requested_size": requested.get(b.address, b.size) if b.allocated else 0,
                "state": "active_allocated" if b.allocated else "inactive",
            }
            if old:
                block["history"] = []
            else:
                block.update(address=b.address, frames=[])
            blocks.append(block)
        segment = {
            "device": 0,
            "address": seg.address,
            "total_size": seg.size,
            "allocated_size": sum(b.size for b in seg.blocks if b.allocated),
            "active_size": sum(b.size for b in seg.blocks if b.allocated),
            "requested_size": sum(requested.get(b.address, 0) for b in seg.blocks),
            "stream": seg.stream,
            "segment_type": "small" if seg.is_small else "large",
            "blocks": blocks,
        }
        if not old:
            segment.update(
                is_expandable=config.expandable_segments, segment_pool_id=(0, 0), frames=[]
            )
        segments.append(segment)
    snapshot: dict[str, Any] = {"segments": segments, "device_traces": [trace]}
    if not old:
        snapshot["allocator_settings"] = _settings(config)
        snapshot["external_annotations"] = []
    return snapshot, truth


def training_steps(steps: int = 3, layers: int = 6, empty_cache: bool = True) -> list[Op]:
    """Weights, then steps of activations freed in reverse with a few temporaries and small
    tensors between them, on two streams, with an empty_cache() between steps."""
    ops: list[Op] = []
    for layer in range(layers):
        ops.append(("malloc", ("w", layer), (layer + 3) * MiB + 1000, 0))
        ops.append(("malloc", ("b", layer), 4096 + layer, 0))
    # A 20 MiB segment whose 0.5 MiB remainder the block keeps (never split off in the large
    # pool), freed during the first step: the rebuilt block must be the whole segment.
    ops.append(("malloc", "kept", 19 * MiB + 512 * 1024, 0))
    for step in range(steps):
        for layer in range(layers):
            if (step, layer) == (0, 3):
                ops.append(("free", "kept"))
            size = (8 + 3 * layer + step) * MiB + 123
            ops.append(("malloc", ("a", step, layer), size, 0))
            ops.append(("malloc", ("t", step, layer), 700 * 1024 + layer, layer % 2))
            ops.append(("free", ("t", step, layer)))
            ops.append(("malloc", ("s", step, layer), 2 * MiB + 512, 1))
        for layer in reversed(range(layers)):
            ops.append(("free", ("a", step, layer)))
            ops.append(("free", ("s", step, layer)))
        if empty_cache and step == 1:
            ops.append(("empty_cache",))
    return ops


def fragmenting(rounds: int = 6) -> list[Op]:
    """Blocks that grow each round, every other one kept: the holes left never fit the next
    round's requests, so fixed segments pile up (what expandable segments exist for)."""
    ops: list[Op] = []
    for r in range(rounds):
        for i in range(10):
            ops.append(("malloc", (r, i), (r + 2) * 3 * MiB + 512, 0))
        for i in range(0, 10, 2):
            ops.append(("free", (r, i)))
    return ops


def write(path: Path, snapshot: dict[str, Any]) -> Path:
    with path.open("wb") as f:
        pickle.dump(snapshot, f)  # as torch.cuda.memory._dump_snapshot does
    return path


def state_of(segments: Any) -> tuple[set[tuple[int, int, bool]], set[tuple[int, int]]]:
    """(segments, allocated blocks) of either the card's segments() or a StartState."""
    segs, blocks = set(), set()
    for seg in segments:
        small = seg.is_small if hasattr(seg, "is_small") else seg.small
        segs.add((seg.address, seg.size, small))
        for b in seg.blocks:
            if getattr(b, "allocated", True):
                blocks.add((b.address, b.size))
    return segs, blocks


# -- the state at the first event ---------------------------------------------------------------


@pytest.mark.parametrize("old", [False, True], ids=["torch2.5", "torch2.0"])
def test_rebuilt_state_is_the_cards_state_when_recording_began(old):
    """Walking the trace back from the final state gives exactly the segments and allocated
    blocks the card held at the first event, in both formats (2.0: block addresses from the
    offsets), and says the recording started mid-run."""
    ops = training_steps()
    snapshot, truth = record(ops, start_at=14, old=old)
    recording = parse_snapshot(read_snapshot(pickle.dumps(snapshot), "s.pickle"), "s.pickle")
    start = rebuild_start(recording)
    assert state_of(start.segments) == state_of(truth["segments"])
    assert start.mid_run and not start.problems
    assert recording.settings_recorded is not old


def test_a_whole_run_starts_empty():
    snapshot, _ = record(training_steps(), start_at=0)
    start = rebuild_start(parse_snapshot(snapshot, "s"))
    assert not start.segments and not start.mid_run


# -- replay under the recorded settings --------------------------------------------------------


@pytest.mark.parametrize(
    "conf",
    ["", "expandable_segments:True", "max_split_size_mb:40", "roundup_power2_divisions:4"],
)
def test_a_recording_by_the_same_rules_replays_decision_for_decision(conf):
    """The model replaying its own recording: every segment decision matches (segment_alloc or
    segment_map of the same size, or the cache on both sides), the empty_cache() mid-trace is
    replayed, and the recorded and predicted peaks reserved are the card's."""
    config = AllocatorConfig.parse(conf)
    snapshot, truth = record(training_steps(), config, start_at=14)
    recording = parse_snapshot(snapshot, "s")
    report = replay_report(recording)
    assert report["segment_decisions_total"] > 0
    assert report["segment_decisions_matched"] == report["segment_decisions_total"]
    assert report["alloc_decisions_matched"] == report["alloc_decisions_total"] > 0
    assert report["releases"] == 1  # the empty_cache() call
    assert report["recorded_peak_reserved_bytes"] == truth["peak_reserved"]
    assert report["predicted_peak_reserved_bytes"] == truth["peak_reserved"]
    assert report["inconsistencies"] == {}
    assert report["settings"] == (conf or "defaults")


def test_new_segments_go_where_the_cards_cudamalloc_put_them():
    """Best fit breaks ties between equal free blocks by address, so where cudaMalloc put a
    segment matters: here the card's second segment came at a LOWER address, its 12 MiB
    request took that segment's hole, and a later 16 MiB request needed a new segment. A model
    placing segments in increasing order fills the other hole and serves it from the cache."""
    a, b, c = 0x7F00_0200_0000, 0x7F00_0000_0000, 0x7F00_0400_0000

    def ev(action: str, addr: int, size: int) -> dict[str, Any]:
        return {"action": action, "addr": addr, "size": size, "stream": 0}

    def free(addr: int, size: int) -> list[dict[str, Any]]:
        return [ev("free_requested", addr, size), ev("free_completed", addr, size)]

    trace = [
        ev("segment_alloc", a, 20 * MiB),
        ev("alloc", a, 6 * MiB),
        ev("alloc", a + 6 * MiB, 14 * MiB),
        ev("segment_alloc", b, 20 * MiB),
        ev("alloc", b, 6 * MiB),
        ev("alloc", b + 6 * MiB, 14 * MiB),
        *free(a, 6 * MiB),
        *free(b, 6 * MiB),
        ev("alloc", b, 6 * MiB),
        *free(b + 6 * MiB, 14 * MiB),
        ev("segment_alloc", c, 16 * MiB),
        ev("alloc", c, 16 * MiB),
    ]

    def seg(addr: int, size: int, blocks: list[tuple[int, int, bool]]) -> dict[str, Any]:
        return {
            "device": 0,
            "address": addr,
            "total_size": size,
            "stream": 0,
            "segment_type": "large",
            "is_expandable": False,
            "blocks": [
                {
                    "address": x,
                    "size": s,
                    "requested_size": s,
                    "state": "active_allocated" if on else "inactive",
                }
                for x, s, on in blocks
            ],
        }

    snapshot = {
        "segments": [
            seg(b, 20 * MiB, [(b, 6 * MiB, True), (b + 6 * MiB, 14 * MiB, False)]),
            seg(a, 20 * MiB, [(a, 6 * MiB, False), (a + 6 * MiB, 14 * MiB, True)]),
            seg(c, 16 * MiB, [(c, 16 * MiB, True)]),
        ],
        "device_traces": [trace],
    }
    recording = parse_snapshot(snapshot, "s")
    start = rebuild_start(recording)
    placed = replay(recording, start, recording.settings, compare=True)
    assert (placed.segment_decisions_matched, placed.segment_decisions_total) == (3, 3)
    unplaced = replay(recording, start, recording.settings, compare=True, place_segments=False)
    assert unplaced.segment_decisions_matched == 2
    assert unplaced.mismatches[0].recorded == f"{SEGMENT_ALLOC} {16 * MiB}"


def test_expandable_segments_never_reserve_more_on_a_fragmenting_trace():
    """What-if: the same requests under expandable_segments:True (the recorded fixed segments
    cannot be adopted: the live blocks are allocated again first) reserve less than the card
    did with the defaults; max_split_size keeps the start state (adopted)."""
    ops = fragmenting()
    snapshot, truth = record(ops, start_at=20)
    recording = parse_snapshot(snapshot, "s")
    report = replay_report(recording, ["expandable_segments:True", "max_split_size_mb:40"])
    recorded, expandable, split = report["what_if"]
    assert recorded["peak_reserved_bytes"] == truth["peak_reserved"]
    assert expandable["start"] == "re-allocated" and split["start"] == "adopted"
    assert expandable["peak_reserved_bytes"] < 0.95 * report["recorded_peak_reserved_bytes"]
    assert expandable["fragmentation_bytes"] < recorded["fragmentation_bytes"]


def test_a_card_caps_the_replay_so_ooms_show():
    snapshot, truth = record(fragmenting(), start_at=20)
    report = replay_report(parse_snapshot(snapshot, "s"), capacity=truth["peak_reserved"] // 2)
    row = report["what_if"][0]
    assert row["ooms"] > 0 and row["alloc_retries"] > 0
    assert row["peak_reserved_bytes"] <= truth["peak_reserved"] // 2


def test_settings_given_replace_only_their_keys():
    recorded = AllocatorConfig.parse("max_split_size_mb:128,roundup_power2_divisions:4")
    merged = override_settings(recorded, "expandable_segments:True")
    assert merged == AllocatorConfig.parse(
        "max_split_size_mb:128,roundup_power2_divisions:4,expandable_segments:True"
    )
    assert override_settings(recorded, "roundup_power2_divisions:[1:2,>:8]").max_split_size == (
        128 * MiB
    )
    with pytest.raises(ValueError, match="max_split_siz"):
        override_settings(recorded, "max_split_siz:3")


# -- what a trace may get wrong, and the formats seen -------------------------------------------


def test_inconsistent_traces_are_counted_not_fatal():
    """A free of a block never seen, an alloc of a block the end state lacks, a segment_free of
    a segment overlapping another: counted and reported, the replay still runs."""
    snapshot, _ = record(training_steps(), start_at=14)
    trace = snapshot["device_traces"][0]
    segment = snapshot["segments"][0]
    trace.insert(3, {"action": "free_completed", "addr": 0x1000, "size": 512, "stream": 0})
    trace.append({"action": "alloc", "addr": 0x2000, "size": 512, "stream": 0})
    trace.append(
        {"action": "segment_free", "addr": segment["address"], "size": 2 * MiB, "stream": 0}
    )
    trace.append({"action": "mystery", "addr": 0, "size": 0, "stream": 0})
    # A free, just after a segment_alloc, of a block in it that no alloc in between made.
    born = next(i for i, e in enumerate(trace) if e["action"] == SEGMENT_ALLOC)
    stray = {"action": "free_completed", "addr": trace[born]["addr"] + 512, "size": 8}
    trace.insert(born + 1, {**stray, "stream": 0})
    report = replay_report(parse_snapshot(snapshot, "s"))
    problems = report["inconsistencies"]
    assert problems["allocs the end state and later frees do not explain"] == 1
    assert problems["blocks alive outside every segment"] == 1  # the stray free's block
    assert problems["segment_free of a segment that overlaps another"] == 1
    assert problems["entries of an unknown action 'mystery' (ignored)"] == 1
    assert problems["blocks alive in a segment before it was allocated"] == 1


def test_device_with_the_longest_trace_by_default_and_segments_per_device():
    one, _ = record(training_steps(steps=1), start_at=5)
    two, _ = record(training_steps(steps=3), start_at=5)
    for segment in two["segments"]:
        segment["device"] = 1
    snapshot = {
        "segments": one["segments"] + two["segments"],
        "device_traces": [one["device_traces"][0], two["device_traces"][0], []],
    }
    chosen = parse_snapshot(snapshot, "s")
    assert chosen.device == 1 and len(chosen.segments) == len(two["segments"])
    assert parse_snapshot(snapshot, "s", device=0).segments == parse_snapshot(one, "s").segments
    with pytest.raises(SnapshotError, match="--device 3: the snapshot has devices 0-2"):
        parse_snapshot(snapshot, "s", device=3)


def test_expandable_recordings_rebuild_mapped_ranges():
    """An expandable recording's trace maps and unmaps pages (empty_cache unmaps the free
    ones); the mapped ranges at the first event are rebuilt and a replay matches every map."""
    config = AllocatorConfig(expandable_segments=True)
    snapshot, truth = record(training_steps(), config, start_at=14)
    actions = {e["action"] for e in snapshot["device_traces"][0]}
    assert {SEGMENT_MAP, SEGMENT_UNMAP} <= actions
    recording = parse_snapshot(snapshot, "s")
    start = rebuild_start(recording)
    assert state_of(start.segments) == state_of(truth["segments"])
    report = replay_report(recording, ["expandable_segments:False"])
    assert report["segment_decisions_matched"] == report["segment_decisions_total"] > 0
    assert report["what_if"][1]["start"] == "re-allocated"


def test_a_map_across_a_later_unmap_rebuilds_one_range():
    """Pages mapped in one event and later unmapped in part: walking back, the unmapped range
    rejoins the mapped one before it, so the earlier map lies inside one range."""
    ops: list[Op] = [
        ("malloc", "w", 3 * MiB, 0),
        ("malloc", "big", 50 * MiB, 0),  # maps [20, 60) MiB after the first page's free tail
        ("free", "big"),
        ("malloc", "keep", 18 * MiB, 0),  # [3, 21) MiB: holds the page [20, 40) MiB
        ("empty_cache",),  # unmaps [40, 60) MiB only
    ]
    snapshot, truth = record(ops, AllocatorConfig(expandable_segments=True), start_at=1)
    actions = [(e["action"], e["size"] // MiB) for e in snapshot["device_traces"][0]]
    assert (SEGMENT_MAP, 40) in actions and (SEGMENT_UNMAP, 20) in actions
    start = rebuild_start(parse_snapshot(snapshot, "s"))
    assert not start.problems
    assert state_of(start.segments) == state_of(truth["segments"])


# -- safe loading --------------------------------------------------------------------------------


def test_a_pickle_that_names_a_class_is_refused_and_runs_nothing(tmp_path):
    """A crafted REDUCE (GLOBAL builtins.open + a tuple of arguments) creates a file when plain
    pickle loads it; the snapshot reader refuses it at the GLOBAL and nothing runs."""
    marker = tmp_path / "ran"
    crafted = f"cbuiltins\nopen\n(S'{marker}'\nS'w'\ntR.".encode()
    path = tmp_path / "evil.pickle"
    path.write_bytes(crafted)
    with pytest.raises(SnapshotError) as raised:
        load_snapshot(path)
    message = str(raised.value)
    assert message == (
        f"{path}: not a memory snapshot: the pickle names a class (builtins.open); snapshots "
        "hold only plain data"
    )
    assert not marker.exists()
    pickle.loads(crafted).close()  # the same bytes under plain pickle: the side effect happens
    assert marker.exists()


def test_truncated_and_wrong_structures_are_one_line_errors(tmp_path):
    snapshot, _ = record(training_steps(steps=1), start_at=5)
    data = pickle.dumps(snapshot)
    cases = {
        data[: len(data) // 2]: "the pickle ends early (truncated)",
        b"": "the file is empty",
        pickle.dumps([1, 2]): "the pickle holds a list, not the dict _dump_snapshot writes",
        pickle.dumps({"device_traces": []}): "no 'segments' key",
        pickle.dumps({"segments": [{"address": 0}]}): "segments[0] has no 'total_size'",
        pickle.dumps({"segments": [], "device_traces": [[{"addr": 1}]]}): (
            "device_traces[0][0] has no 'action'"
        ),
    }
    for raw, why in cases.items():
        with pytest.raises(SnapshotError) as raised:
            parse_snapshot(read_snapshot(raw, "snap.pickle"), "snap.pickle")
        assert str(raised.value) == f"snap.pickle: not a memory snapshot: {why}"


# -- the command ---------------------------------------------------------------------------------


def test_cli_bad_input_exits_2_with_one_line(tmp_path):
    """Run as a user runs it: exit code 2, one line on stderr, no traceback."""
    path = tmp_path / "snap.pickle"
    data = pickle.dumps(record(training_steps(steps=1), start_at=5)[0])
    path.write_bytes(data[:-40])
    done = subprocess.run(
        [sys.executable, "-m", "harness", "replay", str(path)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    expect_exit(done, 2)
    assert done.stderr.strip().splitlines() == [
        f"Error: {path}: not a memory snapshot: the pickle ends early (truncated)"
    ]
    runner = CliRunner()
    good = write(tmp_path / "good.pickle", record(training_steps(steps=1), start_at=5)[0])
    for args, why in (
        (["--allocator-conf", "expandable:True"], "--allocator-conf 'expandable:True':"),
        (["--card", "h1000"], "--card: unknown card 'h1000'"),
        (["--device", "1"], "--device 1: the snapshot has only device 0"),
        (["--allocator-conf", "per_process_memory_fraction:0.5"], "give the card"),
    ):
        result = runner.invoke(main, ["replay", str(good), *args])
        assert result.exit_code == 2, result.output
        assert len(result.stderr.strip().splitlines()) == 1 and why in result.stderr


def test_cli_json_and_table(tmp_path):
    snapshot, truth = record(fragmenting(), start_at=20)
    path = write(tmp_path / "snap.pickle", snapshot)
    runner = CliRunner()
    result = runner.invoke(
        main,
        ["replay", str(path), "--format", "json", "--allocator-conf", "expandable_segments:True"],
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    for key in (
        "recorded_peak_reserved_bytes",
        "predicted_peak_reserved_bytes",
        "segment_decisions_matched",
        "segment_decisions_total",
    ):
        assert isinstance(report[key], int)
    assert report["recorded_peak_reserved_bytes"] == truth["peak_reserved"]
    rows = report["what_if"]
    assert [r["given"] for r in rows] == [None, "expandable_segments:True"]
    for row in rows:
        assert {
            "settings",
            "peak_reserved_bytes",
            "peak_allocated_bytes",
            "fragmentation_bytes",
            "alloc_retries",
            "ooms",
        } <= set(row)
    # as a wide terminal shows it, whatever width the test process inherits
    table = runner.invoke(
        main, ["replay", str(path), "--card", "h100-80gb"], env={"COLUMNS": "200"}
    )
    assert table.exit_code == 0, table.output
    for words in (
        "trace: starts mid-run",
        "settings: recorded: defaults",
        "capacity: h100-80gb",
        "segment decisions matched: ",
        "inconsistencies: none",
        "the card (recorded)",
        "model: the recorded settings",
    ):
        assert words in table.stdout, words
    csv = runner.invoke(main, ["replay", str(path), "--format", "csv"])
    assert csv.stdout.splitlines()[0].startswith("snapshot,device,row,settings")
    assert len(csv.stdout.splitlines()) == 3  # the card, the model under the recorded settings


def test_releases_before_a_new_segment_are_told_apart():
    """A release run directly followed by a new segment and its alloc is what malloc's retry
    after a failed cudaMalloc looks like: counted as a likely retry; one followed by anything
    else is the user's empty_cache(). Both are replayed as empty_cache()."""
    ops = training_steps()
    cut = ops.index(("empty_cache",)) + 1
    for extra, retries in (([], 1), ([("free", ("b", 0))], 0)):
        snapshot, truth = record(ops[:cut] + extra + ops[cut:], start_at=14)
        trace = snapshot["device_traces"][0]
        after = [e["action"] for e in trace if e["action"] != SEGMENT_FREE]
        report = replay_report(parse_snapshot(snapshot, "s"))
        assert report["releases"] == 1 and report["likely_alloc_retries"] == retries, after
        assert report["predicted_peak_reserved_bytes"] == truth["peak_reserved"]


def test_a_long_replay_says_how_far_it_is(tmp_path, monkeypatch):
    """Progress lines go to stderr once the replays have run past PROGRESS_AFTER_S."""
    import harness.cli.replay as command

    monkeypatch.setattr(command, "PROGRESS_AFTER_S", 0.0)
    monkeypatch.setattr(command, "PROGRESS_EVERY_S", 0.0)
    snapshot, _ = record(training_steps(), start_at=14)
    path = write(tmp_path / "snap.pickle", snapshot)
    result = CliRunner().invoke(main, ["replay", str(path), "--format", "json"])
    events = len(snapshot["device_traces"][0])
    assert f"replay: defaults: {events:,} of {events:,} events" in result.stderr
    json.loads(result.stdout)  # stdout stays the report alone
