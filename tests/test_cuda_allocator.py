"""The CUDA caching-allocator model (harness.cuda.allocator) held to the source's rules and to the
figures PyTorch's own tests pin (test/test_cuda.py, c10/test/core/AllocatorConfig_test.cpp)."""

from __future__ import annotations

import contextlib
import random
from dataclasses import replace

import pytest

from harness.cuda.allocator import (
    SEGMENT_ALLOC,
    SEGMENT_FREE,
    SEGMENT_MAP,
    SEGMENT_UNMAP,
    AllocatorConfig,
    CachingAllocator,
    Decision,
    MiB,
    OutOfMemory,
    benchmark,
    kLargeBuffer,
)

GiB = 1024 * MiB


def kinds(decisions) -> list[tuple[str, int]]:
    return [(d.kind, d.size) for d in decisions]


# -- settings --------------------------------------------------------------------------------


def test_parse_reads_every_modelled_key_and_text_round_trips():
    """AcceleratorAllocatorConfig::parseArgs: sizes in MiB become bytes; text() is canonical
    and reads back to an equal config ("" for the defaults)."""
    text = (
        "expandable_segments:True,max_split_size_mb:128,roundup_power2_divisions:4,"
        "garbage_collection_threshold:0.8"
    )
    config = AllocatorConfig.parse(text)
    assert config.expandable_segments is True
    assert config.max_split_size == 128 * MiB
    assert config.roundup_power2_divisions == (4,) * 16
    assert config.garbage_collection_threshold == 0.8
    assert AllocatorConfig.parse(config.text()) == config
    assert AllocatorConfig.parse("") == AllocatorConfig()
    assert AllocatorConfig().text() == ""
    rich = AllocatorConfig.parse(
        " large_segment_size_mb:32, max_non_split_rounding_mb:64,per_process_memory_fraction:0.5,"
        "roundup_power2_divisions:[64:8,128:2,256:4,512:2,1024:4,>:1],pinned_num_register_threads:8,"
    )
    assert rich.large_segment_size == 32 * MiB and rich.non_split_rounding_size == 64 * MiB
    assert rich.per_process_memory_fraction == 0.5
    assert rich.inert == (("pinned_num_register_threads", "8"),)
    assert AllocatorConfig.parse(rich.text()) == rich


def test_divisions_list_form_fills_intervals_as_the_source_does():
    """c10/test/core/AllocatorConfig_test.cpp: the first entry also fills the intervals below it,
    '>' fills those after the last, unnamed gaps stay 0; roundup_power2_divisions(size) reads
    the interval log2(size) - 20."""
    config = AllocatorConfig.parse("roundup_power2_divisions:[64:8,128:2,256:4,512:2,1024:4,>:1]")
    got = [config.divisions_for(mb * MiB) for mb in (32, 64, 128, 256, 512, 1024, 2048, 8192)]
    assert got == [8, 8, 2, 4, 2, 4, 1, 1]
    config = AllocatorConfig.parse("roundup_power2_divisions:[128:8,256:16,512:1,2048:8,>:2]")
    got = [config.divisions_for(mb * MiB) for mb in (64, 128, 256, 512, 1024, 2048, 4096)]
    assert got == [8, 8, 16, 1, 0, 8, 2]
    assert AllocatorConfig.parse(config.text()) == config
    assert AllocatorConfig.parse("roundup_power2_divisions:4").divisions_for(2048 * MiB) == 4


@pytest.mark.parametrize(
    ("text", "names"),
    [
        ("foo:1,bar:2", "foo"),
        ("garbage_collection_threshold:1.2", "garbage_collection_threshold"),
        ("max_split_size_mb:2", "max_split_size_mb"),
        ("release_lock_on_cudamalloc:none", "release_lock_on_cudamalloc"),
        ("pinned_num_register_threads:none", "pinned_num_register_threads"),
        ("pinned_num_register_threads:1024", "pinned_num_register_threads"),
        ("max_split_size_mb:20,large_segment_size_mb:25", "max_split_size_mb"),
        ("large_segment_size_mb:10", "large_segment_size_mb"),
        ("roundup_power2_divisions:3", "roundup_power2_divisions"),
        ("roundup_power2_divisions:[64:8", "roundup_power2_divisions"),
        ("roundup_power2_divisions:[96:8]", "roundup_power2_divisions"),
        ("expandable_segments:true", "expandable_segments"),
        ("per_process_memory_fraction:1.1", "per_process_memory_fraction"),
        ("max_split_size_mb", "max_split_size_mb"),
        ("max_split_size_mb:", "max_split_size_mb"),
        ("backend:cudaMallocAsync", "backend"),
    ],
)
def test_bad_settings_raise_one_line_naming_the_key(text, names):
    """test_cuda.py::test_allocator_settings (foo:1, threshold 1.2, max_split_size_mb:2, bad
    bools, register threads), AllocatorConfig_test.cpp (max_split_size_mb below
    large_segment_size_mb; malformed configs raise ValueError), the tokenizer's True/False."""
    with pytest.raises(ValueError) as caught:
        AllocatorConfig.parse(text)
    message = str(caught.value)
    assert names in message and "allowed" in message and "\n" not in message


def test_unknown_key_suggests_the_close_one():
    """CUDAAllocatorConfig::parseArgs rejects keys outside getKeys(); the line says which."""
    with pytest.raises(ValueError, match=r"unknown key 'max_split_size'.*max_split_size_mb"):
        AllocatorConfig.parse("max_split_size:128")


def test_from_snapshot_takes_the_effective_values():
    """torch/csrc/cuda/Module.cpp: _snapshot()["allocator_settings"] holds max_split_size in
    bytes (-1 for SIZE_MAX), the threshold, expandable_segments and a {"1": d, ..., "32768": d}
    divisions dict; the text adds what the dict lacks."""
    divisions = {str(1 << k): (8 if k < 7 else 2) for k in range(16)}
    settings = {
        "PYTORCH_CUDA_ALLOC_CONF": "large_segment_size_mb:32,max_split_size_mb:64",
        "max_split_size": 128 * MiB,
        "garbage_collection_threshold": 0.6,
        "expandable_segments": True,
        "pinned_num_register_threads": 1,
        "release_lock_on_cudamalloc": False,
        "pinned_use_cuda_host_register": False,
        "roundup_power2_divisions": divisions,
        "graph_capture_record_stream_reuse": False,
    }
    config = AllocatorConfig.from_snapshot(settings)
    assert config.max_split_size == 128 * MiB
    assert config.large_segment_size == 32 * MiB
    assert config.garbage_collection_threshold == 0.6
    assert config.expandable_segments is True
    assert config.divisions_for(64 * MiB) == 8 and config.divisions_for(128 * MiB) == 2
    unlimited = AllocatorConfig.from_snapshot({"PYTORCH_CUDA_ALLOC_CONF": "", "max_split_size": -1})
    assert unlimited == AllocatorConfig()


# -- rounding and segment sizes ----------------------------------------------------------------


def test_requests_round_to_512_bytes():
    """round_size: below kMinBlockSize a request takes 512 B, else the next multiple of 512."""
    alloc = CachingAllocator()
    alloc.malloc(1)
    assert alloc.allocated_bytes == 512
    alloc.malloc(513)
    assert alloc.allocated_bytes == 512 + 1024
    assert alloc.requested_bytes == 514


def test_roundup_power2_divisions_as_test_allocator_settings_pins():
    """test_cuda.py::test_allocator_settings: 21M floats (84 MiB) take 84 MiB plain, 96 MiB with
    roundup_power2_divisions:4, 88 MiB with [64:8,128:2,256:2,512:2,1024:1,>:1], and 100M floats
    (400 MiB) 512 MiB under that list; requested_bytes stays the asked size."""
    nbytes, nbytes_big = 84 * MiB, 400 * MiB
    cases = [
        ("", nbytes, 84 * MiB),
        ("roundup_power2_divisions:4", nbytes, 96 * MiB),
        ("roundup_power2_divisions:[64:8,128:2,256:2,512:2,1024:1,>:1]", nbytes, 88 * MiB),
        ("roundup_power2_divisions:[64:8,128:2,256:2,512:2,1024:1,>:1]", nbytes_big, 512 * MiB),
    ]
    for text, size, expected in cases:
        alloc = CachingAllocator(AllocatorConfig.parse(text))
        alloc.malloc(size)
        assert (alloc.allocated_bytes, alloc.requested_bytes) == (expected, size), text


def test_roundup_spares_small_sizes_and_powers_of_two():
    """round_size divides only when size > kMinBlockSize * divisions; roundup_power2_next_division
    keeps a power of 2 and steps by floor/divisions otherwise."""
    config = AllocatorConfig(roundup_power2_divisions=4)
    assert config.round_size(1100) == 1536  # <= 512 * 4: plain 512 B rounding, not 1280
    assert config.round_size(2049) == 2560  # > 512 * 4: 2048 + 2048 / 4
    assert config.round_size(64 * MiB) == 64 * MiB
    assert config.round_size(64 * MiB + 1) == 80 * MiB
    assert config.round_size(1200 * 1024) == 1280 * 1024


def test_segment_sizes_per_pool():
    """get_pool / get_allocation_size (design notes §9): 5 x 512 B share one 2 MiB small
    segment; 5 x (1 MiB + 512) share one 20 MiB (kLargeBuffer) segment; each 10 MiB + 512
    request gets its own 12 MiB segment (rounded to kRoundLarge), so 3 make 36 MiB."""
    for size, count, reserved, segments in (
        (512, 5, 2 * MiB, 1),
        (MiB + 512, 5, 20 * MiB, 1),
        (10 * MiB + 512, 3, 36 * MiB, 3),
    ):
        alloc = CachingAllocator()
        for _ in range(count):
            alloc.malloc(size)
        assert alloc.reserved_bytes == reserved, size
        assert len(alloc.segments()) == segments, size
    mixed = CachingAllocator()
    mixed.malloc(MiB)  # the small pool's largest request
    mixed.malloc(MiB + 1)  # the large pool's smallest
    assert [s.is_small for s in mixed.segments()] == [True, False]


def test_small_pool_packs_two_mebibytes_per_segment():
    """test_cuda.py::test_mempool_with_allocator: 1 MiB requests pack two to a 2 MiB buffer, the
    third needs a second one."""
    alloc = CachingAllocator()
    alloc.malloc(MiB)
    alloc.malloc(MiB)
    assert len(alloc.segments()) == 1
    alloc.malloc(MiB)
    assert len(alloc.segments()) == 2 and alloc.reserved_bytes == 4 * MiB


# -- best fit, split, merge ----------------------------------------------------------------------


def test_best_fit_takes_the_smallest_block_then_the_lowest_address():
    """get_free_block: lower_bound over (stream, size, address) picks the smallest cached block
    that fits; among equal sizes the lowest address."""
    alloc = CachingAllocator()
    a, b, c = (alloc.malloc(n * MiB) for n in (12, 16, 14))
    for address in (a, b, c):
        alloc.free(address)
    assert alloc.malloc(13 * MiB) == c
    alloc = CachingAllocator()
    low, high = alloc.malloc(12 * MiB), alloc.malloc(12 * MiB)
    alloc.free(high)
    alloc.free(low)
    assert alloc.malloc(11 * MiB) == low and alloc.last_decisions == ()


def test_blocks_are_reused_only_on_their_stream():
    """Blocks are ordered by stream first (BlockComparatorSize): another stream's cached block is
    never handed out, a new segment is made instead."""
    alloc = CachingAllocator()
    other = alloc.malloc(12 * MiB, stream=1)
    alloc.free(other)
    mine = alloc.malloc(12 * MiB, stream=0)
    assert mine != other
    assert alloc.last_decisions == (Decision(SEGMENT_ALLOC, mine, 12 * MiB, 0),)


def test_split_leaves_the_upper_part_free():
    """alloc_found_block: the request keeps the block's start, the remainder (upper part) goes
    back to the pool, and the next fitting request is carved from it."""
    alloc = CachingAllocator()
    x = alloc.malloc(MiB + 512)
    y = alloc.malloc(2 * MiB)
    assert y == x + MiB + 512
    (segment,) = alloc.segments()
    assert [(b.address - x, b.size, b.allocated) for b in segment.blocks] == [
        (0, MiB + 512, True),
        (MiB + 512, 2 * MiB, True),
        (3 * MiB + 512, 17 * MiB - 512, False),
    ]


def test_should_split_thresholds_per_pool():
    """should_split: a large-pool block splits only when more than kSmallSize (1 MiB) would
    remain; a small-pool block when at least kMinBlockSize would."""
    alloc = CachingAllocator()
    alloc.malloc(19 * MiB + 512 * 1024)  # a 20 MiB segment; 0.5 MiB would remain: no split
    assert alloc.allocated_bytes == 20 * MiB
    alloc = CachingAllocator()
    alloc.malloc(19 * MiB)  # exactly 1 MiB would remain: still no split
    assert alloc.allocated_bytes == 20 * MiB
    alloc = CachingAllocator()
    alloc.malloc(18 * MiB + 512 * 1024)  # 1.5 MiB would remain: split
    assert alloc.allocated_bytes == 18 * MiB + 512 * 1024
    alloc = CachingAllocator()
    alloc.malloc(2 * MiB - 512 - 1024 * 1024)  # the small pool leaves 512 + 1 MiB: split
    alloc.malloc(MiB)
    assert len(alloc.segments()) == 1


def test_free_merges_with_free_neighbours_of_the_segment():
    """free_block -> try_merge_blocks with prev and next: freeing the middle of three blocks
    leaves it alone, then each further free merges, until the segment is one free block."""
    alloc = CachingAllocator()
    a, b, c = (alloc.malloc(2 * MiB) for _ in range(3))
    alloc.free(b)
    assert [blk.allocated for blk in alloc.segments()[0].blocks] == [True, False, True, False]
    alloc.free(a)
    assert [(blk.size, blk.allocated) for blk in alloc.segments()[0].blocks][:2] == [
        (4 * MiB, False),
        (2 * MiB, True),
    ]
    alloc.free(c)
    assert alloc.segments()[0].blocks == [(a, 20 * MiB, False)]
    alloc.check_invariants()


def test_freed_block_is_reused_without_a_segment_decision():
    """The cache: a freed block serves the next request of its size at the same address."""
    alloc = CachingAllocator()
    x = alloc.malloc(3 * MiB)
    alloc.free(x)
    assert alloc.malloc(3 * MiB) == x
    assert alloc.last_decisions == () and len(alloc.decisions) == 1


def test_max_split_size_rules():
    """get_free_block with max_split_size: a request below it may not take an oversize block; a
    request at or above it takes one only if smaller than size + max_non_split_rounding_size
    (20 MiB), unsplit; without the setting the same request splits the cached block."""
    alloc = CachingAllocator(AllocatorConfig.parse("max_split_size_mb:40"))
    big = alloc.malloc(60 * MiB)
    alloc.free(big)
    small = alloc.malloc(30 * MiB)
    assert small != big and kinds(alloc.last_decisions) == [(SEGMENT_ALLOC, 30 * MiB)]
    alloc.free(small)
    assert alloc.malloc(50 * MiB) == big and alloc.allocated_bytes == 60 * MiB
    alloc.free(big)
    other = alloc.malloc(40 * MiB)  # 60 MiB >= 40 + 20: refused, a new segment
    assert other != big and kinds(alloc.last_decisions) == [(SEGMENT_ALLOC, 40 * MiB)]
    plain = CachingAllocator()
    big = plain.malloc(60 * MiB)
    plain.free(big)
    assert plain.malloc(30 * MiB) == big and plain.last_decisions == ()


# -- fallbacks under a capacity or a fraction ------------------------------------------------------


def test_cudamalloc_failure_frees_cached_segments_then_retries_then_ooms():
    """malloc's fallbacks: alloc_block fails at the capacity, release_cached_blocks cudaFrees the
    unsplit cached segments, alloc_block retries (num_alloc_retries); when that fails too,
    OutOfMemory (num_ooms) with the state intact."""
    alloc = CachingAllocator(capacity=100 * MiB)
    a = alloc.malloc(40 * MiB)
    alloc.malloc(40 * MiB)
    alloc.free(a)
    c = alloc.malloc(50 * MiB)
    assert alloc.last_decisions == (
        Decision(SEGMENT_FREE, a, 40 * MiB, 0),
        Decision(SEGMENT_ALLOC, c, 50 * MiB, 0),
    )
    assert alloc.num_alloc_retries == 1 and alloc.num_ooms == 0
    with pytest.raises(OutOfMemory, match=r"Tried to allocate 20\.00 MiB"):
        alloc.malloc(20 * MiB)
    assert (alloc.num_alloc_retries, alloc.num_ooms) == (2, 1)
    assert alloc.reserved_bytes == 90 * MiB and alloc.allocated_bytes == 90 * MiB
    alloc.check_invariants()


def test_release_available_cached_blocks_frees_one_oversize_block_first():
    """release_available_cached_blocks (max_split_size set): before the full flush, cudaFree the
    one cached oversize block of at least max(size, max_split_size); no retry is counted."""
    alloc = CachingAllocator(AllocatorConfig.parse("max_split_size_mb:40"), capacity=80 * MiB)
    big = alloc.malloc(60 * MiB)
    alloc.free(big)
    x = alloc.malloc(30 * MiB)
    assert alloc.last_decisions == (
        Decision(SEGMENT_FREE, big, 60 * MiB, 0),
        Decision(SEGMENT_ALLOC, x, 30 * MiB, 0),
    )
    assert alloc.num_alloc_retries == 0


def test_release_available_cached_blocks_frees_the_largest_until_enough():
    """release_available_cached_blocks: no single block large enough -> free the stream's largest
    oversize blocks, largest first, until max(size, max_split_size) bytes are back; smaller
    cached blocks stay."""
    alloc = CachingAllocator(AllocatorConfig.parse("max_split_size_mb:40"), capacity=200 * MiB)
    s60, s70 = alloc.malloc(60 * MiB), alloc.malloc(70 * MiB)
    alloc.malloc(30 * MiB)
    s24 = alloc.malloc(24 * MiB)
    for address in (s60, s70, s24):
        alloc.free(address)
    alloc.malloc(80 * MiB)
    assert kinds(alloc.last_decisions) == [
        (SEGMENT_FREE, 70 * MiB),
        (SEGMENT_FREE, 60 * MiB),
        (SEGMENT_ALLOC, 80 * MiB),
    ]
    assert alloc.num_alloc_retries == 0 and alloc.reserved_bytes == 134 * MiB


def test_per_process_memory_fraction_as_test_cuda_pins():
    """test_cuda.py::test_set_per_process_memory_fraction: at fraction 0.5, 0.499 of the card
    minus the peak reservation fits, half of the card does not (a 2 MiB small segment is held);
    fractions outside [0, 1] are refused."""
    total = GiB
    alloc = CachingAllocator(memory_fraction=0.5, device_total=total)
    alloc.malloc(1024 * 4)  # torch.zeros(1024, device="cuda")
    alloc.empty_cache()
    application = int(total * 0.499) - alloc.peak_reserved_bytes
    alloc.free(alloc.malloc(application))
    alloc.empty_cache()
    with pytest.raises(OutOfMemory):
        alloc.malloc(int(total * 0.5))
    for bad in (-0.1, 2.0):
        with pytest.raises(ValueError, match="memory_fraction"):
            alloc.set_memory_fraction(bad)
    from_config = CachingAllocator(
        AllocatorConfig(per_process_memory_fraction=0.25), device_total=total
    )
    assert from_config.allowed_memory_maximum == total // 4


def test_garbage_collection_frees_the_oldest_cached_segments_first():
    """garbage_collect_cached_blocks runs only with a fraction and a threshold set: past
    threshold * allowed it frees unsplit cached segments whose gc_count (free-block searches
    since caching) is at least the average, until the excess is back; younger ones stay."""

    def run(config: AllocatorConfig, fraction: float | None) -> tuple[CachingAllocator, int, int]:
        alloc = CachingAllocator(config, memory_fraction=fraction, device_total=200 * MiB)
        a, b = alloc.malloc(20 * MiB), alloc.malloc(20 * MiB)
        alloc.free(a)
        alloc.malloc(30 * MiB)
        alloc.free(b)
        alloc.malloc(40 * MiB)
        return alloc, a, b

    gc = AllocatorConfig(garbage_collection_threshold=0.5)
    alloc, a, b = run(gc, 0.5)
    assert kinds(alloc.last_decisions) == [(SEGMENT_FREE, 20 * MiB), (SEGMENT_ALLOC, 40 * MiB)]
    assert alloc.last_decisions[0].address == a and alloc.num_alloc_retries == 0
    assert any(s.address == b for s in alloc.segments())
    # A threshold without a fraction: no GC, and no limit to hit.
    alloc, _, _ = run(gc, None)
    assert kinds(alloc.last_decisions) == [(SEGMENT_ALLOC, 40 * MiB)]
    # A fraction without a threshold: no GC; the limit forces the full flush and a retry.
    alloc, a, b = run(AllocatorConfig(), 0.5)
    assert alloc.last_decisions[:2] == (
        Decision(SEGMENT_FREE, a, 20 * MiB, 0),
        Decision(SEGMENT_FREE, b, 20 * MiB, 0),
    )
    assert alloc.num_alloc_retries == 1


# -- expandable segments ----------------------------------------------------------------------


def test_expandable_segment_grows_by_pages():
    """try_allocate_expandable_block / map_block: the large pool maps 20 MiB pages, the small pool
    2 MiB pages, only as many as the rounded request needs; a request that fits the free tail
    maps nothing; growth maps at the end and merges with the free tail (reserved = mapped)."""
    alloc = CachingAllocator(AllocatorConfig.parse("expandable_segments:True"))
    x = alloc.malloc(30 * MiB)
    assert alloc.last_decisions == (Decision(SEGMENT_MAP, x, 40 * MiB, 0),)
    y = alloc.malloc(5 * MiB)
    assert y == x + 30 * MiB and alloc.last_decisions == ()
    z = alloc.malloc(15 * MiB)
    assert z == x + 35 * MiB
    assert alloc.last_decisions == (Decision(SEGMENT_MAP, x + 40 * MiB, 20 * MiB, 0),)
    s = alloc.malloc(512)
    assert kinds(alloc.last_decisions) == [(SEGMENT_MAP, 2 * MiB)]
    assert alloc.reserved_bytes == 62 * MiB
    large = next(seg for seg in alloc.segments() if seg.address == x)
    assert large.size == 60 * MiB and large.blocks[-1] == (x + 50 * MiB, 10 * MiB, False)
    assert s not in (x, y, z)
    alloc.check_invariants()


def test_expandable_release_unmaps_only_whole_free_pages():
    """release_blocks -> unmap_block: only pages wholly inside a free block are unmapped; the
    partial pages around stay mapped; a segment left wholly unmapped goes
    (release_expandable_segment); reserved falls by the unmapped bytes."""
    alloc = CachingAllocator(AllocatorConfig.parse("expandable_segments:True"))
    x = alloc.malloc(30 * MiB)
    y = alloc.malloc(5 * MiB)
    z = alloc.malloc(15 * MiB)
    alloc.free(y)
    alloc.empty_cache()
    assert alloc.last_decisions == () and alloc.reserved_bytes == 60 * MiB
    alloc.free(z)
    alloc.empty_cache()
    assert alloc.last_decisions == (Decision(SEGMENT_UNMAP, x + 40 * MiB, 20 * MiB, 0),)
    assert alloc.reserved_bytes == 40 * MiB
    alloc.free(x)
    alloc.empty_cache()
    assert alloc.last_decisions == (Decision(SEGMENT_UNMAP, x, 40 * MiB, 0),)
    assert alloc.reserved_bytes == 0 and alloc.segments() == []
    alloc.check_invariants()


def test_max_split_expandable_as_test_cuda_pins():
    """test_cuda.py::test_max_split_expandable: 120 MiB allowed, max_split_size_mb:40, three
    40 MiB tensors (the middle one expandable) fill it, a fourth OOMs; after freeing, 120 MiB
    fits once release_cached_blocks also unmaps the expandable segment."""
    base = AllocatorConfig.parse("expandable_segments:False,max_split_size_mb:40")
    alloc = CachingAllocator(base, memory_fraction=0.5, device_total=240 * MiB)
    a = alloc.malloc(40 * MiB)
    alloc.set_config(replace(base, expandable_segments=True))
    b = alloc.malloc(40 * MiB)
    assert alloc.last_decisions == (Decision(SEGMENT_MAP, b, 40 * MiB, 0),)
    alloc.set_config(base)
    c = alloc.malloc(40 * MiB)
    with pytest.raises(OutOfMemory):
        alloc.malloc(40 * MiB)
    for address in (a, b, c):
        alloc.free(address)
    alloc.malloc(120 * MiB)
    assert alloc.last_decisions[:3] == (
        Decision(SEGMENT_FREE, c, 40 * MiB, 0),
        Decision(SEGMENT_FREE, a, 40 * MiB, 0),
        Decision(SEGMENT_UNMAP, b, 40 * MiB, 0),
    )
    assert kinds(alloc.last_decisions[3:]) == [(SEGMENT_ALLOC, 120 * MiB)]
    assert alloc.num_ooms == 1 and alloc.reserved_bytes == 120 * MiB
    alloc.check_invariants()


def test_garbage_collect_expandable_as_test_cuda_pins():
    """test_cuda.py::test_garbage_collect_expandable: with an expandable block in the free list,
    GC frees only the unsplit ordinary segment (the expandable block is split from its unmapped
    range), and the 80 MiB request grows the expandable segment into the room."""
    base = AllocatorConfig.parse("expandable_segments:False,garbage_collection_threshold:0.5")
    alloc = CachingAllocator(base, memory_fraction=0.5, device_total=240 * MiB)
    a = alloc.malloc(40 * MiB)
    alloc.set_config(replace(base, expandable_segments=True))
    b = alloc.malloc(40 * MiB)
    alloc.free(a)
    alloc.free(b)
    assert alloc.malloc(80 * MiB) == b
    assert alloc.last_decisions == (
        Decision(SEGMENT_FREE, a, 40 * MiB, 0),
        Decision(SEGMENT_MAP, b + 40 * MiB, 40 * MiB, 0),
    )
    assert alloc.reserved_bytes == 80 * MiB


def test_expandable_blocks_are_skipped_when_the_setting_is_off():
    """get_free_block: with expandable_segments switched off, cached blocks of expandable
    segments are passed over for ordinary ones (or a new cudaMalloc)."""
    alloc = CachingAllocator(AllocatorConfig(expandable_segments=True))
    alloc.malloc(10 * MiB)
    b = alloc.malloc(12 * MiB)
    alloc.malloc(2 * MiB)
    alloc.free(b)  # two free expandable blocks now fit 11 MiB: 12 MiB and the 16 MiB tail
    alloc.set_config(AllocatorConfig())
    fresh = alloc.malloc(11 * MiB)
    assert alloc.last_decisions == (Decision(SEGMENT_ALLOC, fresh, 12 * MiB, 0),)
    alloc.check_invariants()


def test_expandable_segments_split_any_remainder_of_512_bytes():
    """should_split with is_expandable_segments_active: large-pool blocks split like small ones,
    whenever at least kMinBlockSize would remain (0.5 MiB here, which would not split else)."""
    alloc = CachingAllocator(AllocatorConfig(expandable_segments=True))
    alloc.malloc(19 * MiB + 512 * 1024)
    assert alloc.allocated_bytes == 19 * MiB + 512 * 1024 and alloc.reserved_bytes == 20 * MiB


# -- replay support: decisions, addresses, a recorded starting state ----------------------------


def test_addresses_are_increasing_and_aligned_and_each_call_reports_its_decisions():
    """Simulated cudaMalloc: each segment at the next 2 MiB boundary above the last; the log
    holds every segment decision in order, last_decisions those of the last call only."""
    alloc = CachingAllocator()
    a = alloc.malloc(3 * MiB)
    assert alloc.last_decisions == (Decision(SEGMENT_ALLOC, a, kLargeBuffer, 0),)
    b = alloc.malloc(100, stream=3)
    c = alloc.malloc(17 * MiB + 512)  # more than the first segment's 17 MiB remainder
    assert a < b < c and all(address % (2 * MiB) == 0 for address in (a, b, c))
    assert alloc.decisions == [
        Decision(SEGMENT_ALLOC, a, 20 * MiB, 0),
        Decision(SEGMENT_ALLOC, b, 2 * MiB, 3),
        Decision(SEGMENT_ALLOC, c, 18 * MiB, 0),
    ]
    assert alloc.malloc(11 * MiB) == a + 3 * MiB  # fits that remainder
    assert alloc.last_decisions == ()


def test_add_segment_starts_from_a_recorded_state():
    """add_segment: listed blocks are allocated, gaps free; malloc best-fits into the gaps, free
    accepts the recorded addresses and merges, new segments go above, overlaps are refused."""
    base = 0x7F00_4000_0000
    alloc = CachingAllocator()
    alloc.add_segment(base, 20 * MiB, 0, False, [(base, 2 * MiB), (base + 6 * MiB, 4 * MiB)])
    assert (alloc.reserved_bytes, alloc.allocated_bytes) == (20 * MiB, 6 * MiB)
    assert alloc.malloc(3 * MiB) == base + 2 * MiB and alloc.last_decisions == ()
    alloc.free(base)
    alloc.free(base + 2 * MiB)
    alloc.free(base + 6 * MiB)
    assert alloc.segments()[0].blocks == [(base, 20 * MiB, False)]
    new = alloc.malloc(12 * MiB, stream=1)
    assert new >= base + 20 * MiB
    alloc.empty_cache()
    assert kinds(alloc.last_decisions) == [(SEGMENT_FREE, 20 * MiB)]
    with pytest.raises(ValueError, match="overlaps"):
        alloc.add_segment(new + 2 * MiB, 2 * MiB, 1, True, [])
    alloc.check_invariants()


def test_add_segment_expandable_range_grows_like_a_live_one():
    """add_segment(expandable=True): a recorded mapped range joins (or starts) an expandable
    segment, so growth maps the next page after it (map_block) as on the card."""
    base = 0x7F10_0000_0000
    alloc = CachingAllocator(AllocatorConfig(expandable_segments=True))
    alloc.add_segment(base, 40 * MiB, 0, False, [(base, 30 * MiB)], expandable=True)
    assert alloc.malloc(15 * MiB) == base + 30 * MiB
    assert alloc.last_decisions == (Decision(SEGMENT_MAP, base + 40 * MiB, 20 * MiB, 0),)
    alloc.add_segment(base + 100 * MiB, 20 * MiB, 0, False, [], expandable=True)
    ranges = [(s.address - base, s.size) for s in alloc.segments()]
    assert ranges == [(0, 60 * MiB), (100 * MiB, 20 * MiB)]
    with pytest.raises(ValueError, match="pages"):  # ranges are whole 20 MiB pages
        alloc.add_segment(base + 400 * MiB, 30 * MiB, 0, False, [], expandable=True)
    alloc.check_invariants()


def test_empty_cache_keeps_split_segments():
    """release_blocks frees only blocks with neither prev nor next: a segment still holding an
    allocated block stays whole, the unsplit cached one goes."""
    alloc = CachingAllocator()
    small = alloc.malloc(4096)
    held = alloc.malloc(2 * MiB)
    alloc.free(alloc.malloc(2 * MiB))
    cached = alloc.malloc(30 * MiB)
    alloc.free(cached)
    alloc.free(small)
    alloc.empty_cache()
    # release_cached_blocks: the large pool first, then the small one.
    assert alloc.last_decisions == (
        Decision(SEGMENT_FREE, cached, 30 * MiB, 0),
        Decision(SEGMENT_FREE, small, 2 * MiB, 0),
    )
    assert alloc.reserved_bytes == 20 * MiB and alloc.segments()[0].address == held


def test_peaks_fragmentation_and_reset():
    """Stats as memory_stats keeps them: peaks of allocated and reserved; fragmentation is
    reserved - allocated when the peak reservation was reached; reset_peak_memory_stats sets
    the peaks to the current values."""
    alloc = CachingAllocator()
    alloc.malloc(MiB + 512)
    assert alloc.fragmentation_bytes == 20 * MiB - (MiB + 512)
    big = alloc.malloc(30 * MiB)
    assert alloc.peak_reserved_bytes == 50 * MiB
    assert alloc.fragmentation_bytes == 50 * MiB - (31 * MiB + 512)
    assert alloc.fragmentation_share == pytest.approx((19 * MiB - 512) / (50 * MiB))
    alloc.free(big)
    alloc.empty_cache()
    assert (alloc.peak_reserved_bytes, alloc.peak_allocated_bytes) == (50 * MiB, 31 * MiB + 512)
    assert alloc.fragmentation_bytes == 19 * MiB - 512
    alloc.reset_peak()
    assert (alloc.peak_reserved_bytes, alloc.peak_allocated_bytes) == (20 * MiB, MiB + 512)
    assert alloc.memory_stats()["reserved_bytes.all.peak"] == 20 * MiB


def test_free_of_an_unknown_address_is_refused():
    """NativeCachingAllocator::free: 'invalid device pointer' for an address it never gave."""
    alloc = CachingAllocator()
    x = alloc.malloc(4096)
    with pytest.raises(ValueError, match="not an allocated block"):
        alloc.free(x + 512)
    alloc.free(x)
    with pytest.raises(ValueError, match="not an allocated block"):
        alloc.free(x)


@pytest.mark.parametrize(
    "config",
    [
        AllocatorConfig(),
        AllocatorConfig(expandable_segments=True, max_split_size=40 * MiB),
        AllocatorConfig(garbage_collection_threshold=0.6, roundup_power2_divisions=4),
    ],
    ids=["default", "expandable", "gc"],
)
def test_fuzz_keeps_the_bookkeeping_consistent(config):
    """test_cuda.py::test_allocator_fuzz's pattern (random alloc/free/empty_cache on two streams)
    under a fraction and a capacity: blocks keep tiling their segments, pools list exactly the
    free blocks, counters add up, and everything returns with empty_cache."""
    rng = random.Random(123)
    alloc = CachingAllocator(config, capacity=600 * MiB, memory_fraction=0.5, device_total=GiB)
    live: list[int] = []
    for step in range(1500):
        action = rng.random()
        if action < 0.5 or not live:
            size = rng.choice((rng.randrange(1, 2 * MiB), rng.randrange(MiB, 80 * MiB)))
            with contextlib.suppress(OutOfMemory):
                live.append(alloc.malloc(size, stream=rng.choice((0, 0, 5))))
        elif action < 0.98:
            alloc.free(live.pop(rng.randrange(len(live))))
        else:
            alloc.empty_cache()
        if step % 100 == 0:
            alloc.check_invariants()
    for address in live:
        alloc.free(address)
    alloc.empty_cache()
    alloc.check_invariants()
    assert alloc.reserved_bytes == 0 and alloc.allocated_bytes == 0
    assert alloc.num_ooms > 0


def test_benchmark_runs():
    """The integrator's speed check (no timing asserted here): it replays and reports a rate."""
    assert benchmark(2000) > 0
