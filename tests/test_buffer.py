"""``BufferLayout``: buckets, padding and the three index spaces (no ranks needed).

Sizes are parametrized right around the padding edges the way Megatron's buffer tests do
(numels like 9000, 9025, 9050 with caps just below, at and above them), at N = 1..4.
"""

from __future__ import annotations

import random

import pytest
import torch

import shardpar
from shardpar.core.layout import BufferLayout, Range, padded_size

WORLD_SIZES = [1, 2, 3, 4]


def _layout(numels: list[int], world_size: int, cap: int | None) -> BufferLayout:
    return BufferLayout([(f"t{i}", torch.Size([n])) for i, n in enumerate(numels)], world_size, cap)


def check_invariants(layout: BufferLayout, numels: dict[str, int]) -> None:
    """Everything that must hold for any layout, whatever the sizes and cap."""
    n = layout.world_size
    # Tensors in the given order, back to back inside a bucket, buckets back to back.
    assert layout.names == list(numels)
    offset = 0
    for bucket in layout.buckets:
        assert bucket.range.start == offset
        assert bucket.range.size % n == 0, f"bucket {bucket.index} size {bucket.range.size} not a multiple of {n}"
        assert bucket.shard_size * n == bucket.range.size
        cursor = bucket.range.start
        for name in bucket.names:
            slot = layout.slots[name]
            assert slot.bucket == bucket.index
            assert slot.range == Range(cursor, cursor + numels[name])
            cursor = slot.range.end
        assert bucket.padding == bucket.range.end - cursor
        assert 0 <= bucket.padding < n, "padding is the least that makes the size a multiple of N"
        assert bucket.range.size == padded_size(cursor - bucket.range.start, n)
        offset = bucket.range.end
    assert layout.numel == offset
    assert layout.shard_numel * n == layout.numel
    assert layout.padding == sum(b.padding for b in layout.buckets)
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
            assert piece.buffer_range.intersect(bucket.shard(rank)) == piece.buffer_range, "piece outside the rank's slice"
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
        assert int(local_covered.max()) <= 1, "two pieces overlap in local space"
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
