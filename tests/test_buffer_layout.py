"""``BufferLayout``: buckets, padding, alignment and the three index spaces (no ranks needed).

Sizes are parametrized right around the padding edges the way Megatron's buffer tests do
(numels like 9000, 9025, 9050 with caps just below, at and above them), at N = 1..4, dense
and aligned for NCCL (tensors at multiples of 64 elements, buckets of lcm(N, 128)).
"""

from __future__ import annotations

import math
import random

import pytest
import torch

import shardpar
from shardpar.core.layout import Alignment, BufferLayout, Range, alignment_for, padded_size
from tests.support.parity import closed_form_buckets, closed_form_padding

WORLD_SIZES = [1, 2, 3, 4]


def _layout(numels: list[int], world_size: int, cap: int | None, aligned: bool = False) -> BufferLayout:
    return BufferLayout(
        [(f"t{i}", torch.Size([n])) for i, n in enumerate(numels)],
        world_size,
        cap,
        **alignment_for(aligned, None, world_size)._asdict(),
    )


def check_invariants(layout: BufferLayout, numels: dict[str, int]) -> None:
    """Everything that must hold for any layout, whatever the sizes, cap and alignment."""
    n, align, multiple = layout.world_size, layout.param_align, layout.bucket_multiple
    assert multiple % n == 0
    # Tensors in the given order, each at the first multiple of `align` after the previous
    # one inside a bucket; buckets back to back. The gaps are exactly what no tensor holds.
    assert layout.names == list(numels)
    offset = 0
    for bucket in layout.buckets:
        assert bucket.range.start == offset
        assert bucket.range.size % multiple == 0, f"bucket {bucket.index}: {bucket.range.size} % {multiple} != 0"
        assert bucket.shard_size * n == bucket.range.size
        cursor = bucket.range.start
        gaps = []
        for name in bucket.names:
            slot = layout.slots[name]
            start = padded_size(cursor, align)
            assert slot.bucket == bucket.index
            assert slot.range == Range(start, start + numels[name])
            assert slot.range.start % align == 0
            if start > cursor:
                assert start - cursor < align, "a gap in front of a tensor is the least that aligns it"
                gaps.append(Range(cursor, start))
            cursor = slot.range.end
        assert 0 <= bucket.range.end - cursor < multiple, "the tail is the least that completes the bucket"
        if bucket.range.end > cursor:
            gaps.append(Range(cursor, bucket.range.end))
        assert list(bucket.gaps) == gaps
        assert bucket.padding == bucket.range.size - sum(numels[name] for name in bucket.names)
        if (align, multiple) == (1, n):
            assert 0 <= bucket.padding < n, "padding is the least that makes the size a multiple of N"
        assert bucket.range.size == padded_size(cursor - bucket.range.start, multiple)
        offset = bucket.range.end
    assert layout.numel == offset
    assert layout.shard_numel * n == layout.numel
    assert layout.padding == sum(b.padding for b in layout.buckets) == layout.numel - sum(numels.values())
    assert sorted(name for b in layout.buckets for name in b.names) == sorted(numels)
    check_pieces(layout, numels)


def check_pieces(layout: BufferLayout, numels: dict[str, int]) -> None:
    """``pieces(r)`` over all ranks tile every tensor exactly once, and the three ranges of
    each piece name the same elements (checked on real data, not only on offsets)."""
    n = layout.world_size
    flat = torch.arange(layout.numel, dtype=torch.float64) + 1  # buffer space; padding too
    covered = {name: torch.zeros(numel, dtype=torch.int64) for name, numel in numels.items()}
    for rank in range(n):
        # This rank's local shard: its slice of every bucket, in bucket order.
        shard = torch.cat([b.shard(rank).of(flat) for b in layout.buckets])
        assert shard.numel() == layout.shard_numel
        local_covered = torch.zeros(layout.shard_numel, dtype=torch.int64)
        previous_end = -1
        for piece in layout.pieces(rank):
            slot = layout.slots[piece.name]
            bucket = layout.buckets[piece.bucket]
            assert piece.bucket == slot.bucket
            assert piece.param_range.size == piece.buffer_range.size == piece.local_range.size > 0
            assert piece.buffer_range == piece.param_range.shift(slot.range.start)
            assert piece.buffer_range.intersect(bucket.shard(rank)) == piece.buffer_range, (
                "piece outside the rank's slice"
            )
            assert piece.buffer_range.start >= previous_end, "pieces come in buffer order"
            previous_end = piece.buffer_range.end
            tensor = slot.range.of(flat)  # the tensor flattened, param space
            assert torch.equal(piece.local_range.of(shard), piece.buffer_range.of(flat))
            assert torch.equal(piece.param_range.of(tensor), piece.buffer_range.of(flat))
            covered[piece.name][piece.param_range.start : piece.param_range.end] += 1
            local_covered[piece.local_range.start : piece.local_range.end] += 1
        # shard_of: the bucket's part of the local shard is the bucket's slice of the buffer.
        for bucket in layout.buckets:
            assert torch.equal(layout.shard_of(bucket, shard), bucket.shard(rank).of(flat))
            assert layout.local_offset(bucket) == sum(b.shard_size for b in layout.buckets[: bucket.index])
        # What the rank owns but no piece names is exactly its share of the padding.
        padding_here = sum(
            b.shard(rank).size - sum(p.buffer_range.size for p in layout.pieces(rank) if p.bucket == b.index)
            for b in layout.buckets
        )
        assert int((local_covered == 0).sum()) == padding_here
        assert bool(torch.all(local_covered <= 1)), "two pieces overlap in local space"
    for name, count in covered.items():
        assert torch.all(count == 1), f"{name} is not covered exactly once by the ranks' pieces: {count.tolist()}"


# --------------------------------------------------------------------------- order


def test_layout_keeps_the_callers_order() -> None:
    # Reverse order is the caller's job (the engine passes reversed registration order).
    layout = _layout([3, 5, 2], 1, None)
    assert [layout.slots[n].range.start for n in ("t0", "t1", "t2")] == [0, 3, 8]


def _stage0_layout_names() -> tuple[list[str], list[int]]:
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))
    model = shardpar.wrap(module, stage=0)
    (layout,) = [space.layout for space in model.engine.storage.spaces]
    model.engine.close()
    return layout.names, [layout.slots[n].range.start for n in layout.names]


def test_engine_lays_out_the_last_registered_parameter_first() -> None:
    names, starts = _stage0_layout_names()
    assert names == ["2.bias", "2.weight", "0.bias", "0.weight"]
    assert starts[0] == 0


# --------------------------------------------------------------------------- buckets


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_cap_smaller_than_one_tensor(world_size: int) -> None:
    # A tensor above the cap gets a bucket of its own and is never split.
    numels = [10, 3, 7, 2]
    layout = _layout(numels, world_size, cap=5)
    assert [b.names for b in layout.buckets] == [("t0",), ("t1",), ("t2",), ("t3",)]
    check_invariants(layout, {f"t{i}": n for i, n in enumerate(numels)})


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_exactly_one_tensor_per_bucket(world_size: int) -> None:
    numels = [4, 4, 4]
    layout = _layout(numels, world_size, cap=4)
    assert [b.names for b in layout.buckets] == [("t0",), ("t1",), ("t2",)]
    assert all(b.range.size == padded_size(4, world_size) for b in layout.buckets)
    check_invariants(layout, {f"t{i}": n for i, n in enumerate(numels)})


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_cap_fills_buckets_up_to_the_cap_exactly(world_size: int) -> None:
    layout = _layout([2, 3, 5, 1], world_size, cap=5)
    assert [b.names for b in layout.buckets] == [("t0", "t1"), ("t2",), ("t3",)]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_one_bucket_for_everything(world_size: int) -> None:
    numels = [9000, 9025, 9050, 1, 7]
    layout = _layout(numels, world_size, cap=None)
    assert len(layout.buckets) == 1
    assert layout.buckets[0].names == tuple(f"t{i}" for i in range(len(numels)))
    assert layout.padding == padded_size(sum(numels), world_size) - sum(numels)
    check_invariants(layout, {f"t{i}": n for i, n in enumerate(numels)})


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("cap", [9000, 9024, 9025, 9026, 9050, 18025, 18075, 27075, 40000])
def test_sizes_around_the_padding_edges(world_size: int, cap: int) -> None:
    numels = [9000, 9025, 9050, 9000, 9049, 9051]
    layout = _layout(numels, world_size, cap)
    named = {f"t{i}": n for i, n in enumerate(numels)}
    check_invariants(layout, named)
    for bucket in layout.buckets:
        payload = sum(named[name] for name in bucket.names)
        assert payload <= cap or len(bucket.names) == 1


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("total", [11, 12, 13, 23, 24, 25])
def test_single_tensor_just_around_a_multiple_of_n(world_size: int, total: int) -> None:
    layout = _layout([total], world_size, None)
    assert layout.padding == (-total) % world_size
    check_invariants(layout, {"t0": total})


def test_random_layouts() -> None:
    rng = random.Random(0)
    for _ in range(60):
        world_size = rng.randint(1, 4)
        numels = [rng.choice([1, 2, 3, 5, rng.randint(1, 40)]) for _ in range(rng.randint(1, 8))]
        cap = rng.choice([None, 1, 3, 8, 17, 64])
        check_invariants(_layout(numels, world_size, cap), {f"t{i}": n for i, n in enumerate(numels)})


def test_multidimensional_shapes_and_views() -> None:
    shapes = [torch.Size([3, 4]), torch.Size([5]), torch.Size([2, 3, 2])]
    layout = BufferLayout([(f"p{i}", s) for i, s in enumerate(shapes)], 3, bucket_cap_numel=13)
    flat = torch.arange(layout.numel, dtype=torch.float32)
    for name, shape in zip(layout.names, shapes):
        view = layout.view(flat, name)
        assert view.shape == shape and view.data_ptr() == flat[layout.slots[name].range.start :].data_ptr()
    check_invariants(layout, {f"p{i}": s.numel() for i, s in enumerate(shapes)})


def test_invalid_world_size() -> None:
    with pytest.raises(ValueError, match="world_size"):
        BufferLayout([("a", torch.Size([3]))], 0)


# --------------------------------------------------------------------------- alignment


def test_alignment_is_chosen_in_one_place() -> None:
    """Megatron-core's choice when on; today's dense layout when off, or when None finds no
    NCCL process group (this process has none)."""
    assert alignment_for(True, None, 3) == Alignment(param_align=64, bucket_multiple=384)  # lcm(3, 128)
    assert alignment_for(True, None, 4) == Alignment(64, 128)
    assert alignment_for(True, None, 1) == Alignment(64, 128)
    assert alignment_for(True, None, 256) == Alignment(64, 256)
    assert alignment_for(False, None, 3) == Alignment(param_align=1, bucket_multiple=3)
    assert alignment_for(None, None, 3) == Alignment(1, 3)


def test_aligned_layout_by_hand() -> None:
    """Tensors of 3, 100, 64 and 1 elements in one bucket on N = 3 ranks (lcm(3, 128) = 384):

        t0 [0, 3)      gap [3, 64)     61
        t1 [64, 164)   gap [164, 192)  28   (164 rounded up to 192 = 3·64)
        t2 [192, 256)                       (256 = 4·64: no gap)
        t3 [256, 257)  tail [257, 384) 127  (257 rounded up to 384 = 1·384)

    numel 384 = 168 payload + 216 padding (61 + 28 + 127); each rank holds 128."""
    layout = _layout([3, 100, 64, 1], 3, None, aligned=True)
    assert [layout.slots[f"t{i}"].range for i in range(4)] == [
        Range(0, 3),
        Range(64, 164),
        Range(192, 256),
        Range(256, 257),
    ]
    (bucket,) = layout.buckets
    assert bucket.gaps == (Range(3, 64), Range(164, 192), Range(257, 384))
    assert (layout.numel, layout.padding, layout.shard_numel) == (384, 216, 128)
    assert 61 + 28 + 127 == 216 and 384 - (3 + 100 + 64 + 1) == 216
    # Rank 1 owns [128, 256): the end of t1 and all of t2, with the gap between them.
    assert [(p.name, p.param_range, p.local_range) for p in layout.pieces(1)] == [
        ("t1", Range(64, 100), Range(0, 36)),
        ("t2", Range(0, 64), Range(64, 128)),
    ]
    check_invariants(layout, {f"t{i}": n for i, n in enumerate([3, 100, 64, 1])})


def test_aligned_layout_with_a_cap_by_hand() -> None:
    """The same tensors with a cap of 128 elements on N = 2 (buckets of lcm(2, 128) = 128). The
    cap bounds a bucket's tensors with the gaps between them:

        bucket 0 [0, 128):    t0 [0, 3); t1 would start at 64 and end at 164 > 128: closes.
                              padding 125 (tail)
        bucket 1 [128, 256):  t1 [128, 228); t2 would start at 256 and end at 256 + 64 - 128
                              = 192 > 128 past the bucket start: closes. padding 28
        bucket 2 [256, 384):  t2 [256, 320), t3 [320, 321) (321 - 256 = 65 <= 128).
                              padding 63

    numel 384 = 168 + 216 (125 + 28 + 63)."""
    layout = _layout([3, 100, 64, 1], 2, 128, aligned=True)
    assert [b.names for b in layout.buckets] == [("t0",), ("t1",), ("t2", "t3")]
    assert [b.range for b in layout.buckets] == [Range(0, 128), Range(128, 256), Range(256, 384)]
    assert [b.padding for b in layout.buckets] == [125, 28, 63]
    assert layout.slots["t3"].range == Range(320, 321)
    assert (layout.numel, layout.padding) == (384, 125 + 28 + 63)
    check_invariants(layout, {f"t{i}": n for i, n in enumerate([3, 100, 64, 1])})


ALIGNED_SHAPES = {
    "odd": [3, 5, 7, 1, 100, 63, 65, 64, 129],
    "megatron-edges": [9000, 9025, 9050, 9000, 9049, 9051],
    "one": [1],
    "multiples-of-64": [64, 128, 640, 64],  # aligned already: only the bucket tail pads
    "with-empty": [5, 0, 7, 0],
}


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("cap", [None, 1, 100, 9050, 20000])
@pytest.mark.parametrize("shapes", list(ALIGNED_SHAPES))
def test_aligned_layouts(shapes: str, cap: int | None, world_size: int) -> None:
    numels = ALIGNED_SHAPES[shapes]
    layout = _layout(numels, world_size, cap, aligned=True)
    multiple = math.lcm(world_size, 128)
    assert all(slot.range.start % 64 == 0 for slot in layout.slots.values())
    assert all(
        b.range.size % multiple == 0 and b.shard(0).start % (multiple // world_size) == 0 for b in layout.buckets
    )
    check_invariants(layout, {f"t{i}": n for i, n in enumerate(numels)})
    dense = _layout(numels, world_size, cap)
    assert layout.padding >= dense.padding


def test_aligned_multiples_of_64_pad_only_the_tail() -> None:
    layout = _layout(ALIGNED_SHAPES["multiples-of-64"], 3, None, aligned=True)
    assert [layout.slots[f"t{i}"].range.start for i in range(4)] == [0, 64, 192, 832]
    assert layout.buckets[0].gaps == (Range(896, 1152),)  # 896 rounded up to 3·384


def test_random_aligned_layouts() -> None:
    rng = random.Random(1)
    for _ in range(60):
        world_size = rng.randint(1, 4)
        numels = [rng.choice([0, 1, 63, 64, 65, rng.randint(1, 300)]) for _ in range(rng.randint(1, 8))]
        cap = rng.choice([None, 1, 64, 100, 200, 1000])
        align = rng.choice([1, 2, 8, 64])
        multiple = math.lcm(world_size, align) * rng.choice([1, 2, 3])
        layout = BufferLayout(
            [(f"t{i}", torch.Size([n])) for i, n in enumerate(numels)],
            world_size,
            cap,
            param_align=align,
            bucket_multiple=multiple,
        )
        check_invariants(layout, {f"t{i}": n for i, n in enumerate(numels)})


@pytest.mark.parametrize(
    "param_align, bucket_multiple, match",
    [
        (0, None, "param_align"),
        (1, 3, "bucket_multiple"),
        (64, 2, "bucket_multiple"),
        (64, 96, "bucket_multiple"),
    ],
)
def test_invalid_alignment(param_align: int, bucket_multiple: int | None, match: str) -> None:
    """bucket_multiple must split into N equal slices (N = 2 here) and keep buckets aligned."""
    with pytest.raises(ValueError, match=match):
        BufferLayout([("a", torch.Size([3]))], 2, param_align=param_align, bucket_multiple=bucket_multiple)


def _aligned_stage0_layout(align: bool | None) -> BufferLayout:
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))
    model = shardpar.wrap(module, stage=0, align_for_bandwidth=align)
    (layout,) = model.engine.layouts()
    model.engine.close()
    return layout


def test_engine_aligns_when_asked_and_keeps_the_dense_layout_otherwise() -> None:
    # Reverse registration order: 2.bias (3), 2.weight (18), 0.bias (6), 0.weight (24).
    aligned = _aligned_stage0_layout(True)
    assert [aligned.slots[n].range.start for n in aligned.names] == [0, 64, 128, 192]
    assert (aligned.numel, aligned.padding) == (256, 256 - 51)  # 192 + 24 = 216 rounded up to 2·128
    for align in (False, None):  # None: no NCCL group here, so off
        dense = _aligned_stage0_layout(align)
        assert [dense.slots[n].range.start for n in dense.names] == [0, 3, 21, 27]
        assert (dense.numel, dense.padding) == (51, 0)


def test_the_engine_tests_closed_form_agrees_with_the_hand_arithmetic() -> None:
    """``tests.support.parity.closed_form_buckets`` (what the engines' byte and memory tests expect) on
    the cases worked out by hand above, and on KitchenSink's trainable parameters in layout
    order (out.bias 8, out.weight 64, unused.bias 8, unused.weight 64, body.bias 8,
    body.weight 64, emb.weight 128; cap 100, N = 2): [0, 8) | [128, 192) [192, 200) |
    [256, 320) [320, 328) | [384, 448) | [512, 640), five buckets of 128, padding
    120 + 56 + 56 + 64 + 0 = 296. Dense at N = 3: 8 + 64 + 8 = 80 -> 81 | 64 + 8 -> 72 |
    64 -> 66 | 128 -> 129."""
    assert closed_form_buckets([3, 100, 64, 1], 3, None, aligned=True) == [(384, 168)]
    assert closed_form_buckets([3, 100, 64, 1], 2, 128, aligned=True) == [(128, 3), (128, 100), (128, 65)]
    kitchen = [8, 64, 8, 64, 8, 64, 128]
    assert closed_form_buckets(kitchen, 2, 100, aligned=True) == [(128, 8), (128, 72), (128, 72), (128, 64), (128, 128)]
    assert closed_form_padding(kitchen, 2, 100, aligned=True) == 296
    assert closed_form_buckets(kitchen, 3, 100, aligned=False) == [(81, 80), (72, 72), (66, 64), (129, 128)]
    for numels, n, cap in [(kitchen, 3, 100), ([3, 100, 64, 1], 4, None), ([0, 5, 70, 0, 1], 2, 64)]:
        for aligned in (False, True):
            layout = _layout(numels, n, cap, aligned)
            assert closed_form_buckets(numels, n, cap, aligned) == [
                (b.range.size, b.range.size - b.padding) for b in layout.buckets
            ]
