"""``shardpar.comm.collectives`` against closed-form answers.

World size 1 calls the functions directly in this process, with no process group (that is
the contract: they work unchanged without one); world sizes 2-4 run on harness ranks.
Every rank's input is a function of its rank, so the right answer is known in closed form.
"""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch

from shardpar.comm import collectives as C
from shardpar.comm.tagged_gather import in_place_windows
from tests.support.harness import run_ranks

WORLD_SIZES = [2, 3, 4]


def _value(rank: int, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rank ``rank``'s input: distinct per element and per rank, exact in fp32."""
    return (torch.arange(numel, dtype=torch.float64) * 10 + rank + 1).to(dtype)


def _sum_over_ranks(world_size: int, numel: int) -> torch.Tensor:
    return sum(_value(r, numel) for r in range(world_size))


def _ring_bytes(factor: int, numel: int, element_size: int, world_size: int) -> float:
    """[Note: byte accounting]: ``factor · S · (N-1)/N``, rounded once."""
    return float(Fraction(factor * numel * element_size * (world_size - 1), world_size))


# --------------------------------------------------------------------------- rank functions


def _check_all(async_op: bool) -> list[str]:
    """Run every collective, sync or async, and check each against its closed form.

    Returns nothing but raises with the op's name on a wrong answer (so one harness call
    covers the whole module at one world size)."""
    rank, n = C.get_rank(), C.get_world_size()
    checked = []

    def finish(handle: C.Handle) -> None:
        assert isinstance(handle, C.Handle)
        handle.wait()
        handle.wait()  # calling it twice is fine
        assert handle.is_completed()

    # all_reduce sum and max
    t = _value(rank, 7)
    finish(C.all_reduce(t, async_op=async_op))
    torch.testing.assert_close(t, _sum_over_ranks(n, 7), rtol=0, atol=0, msg="all_reduce sum")
    t = _value(rank, 7) * (1 if rank % 2 else -1)
    finish(C.all_reduce(t, async_op=async_op, op="max"))
    expected = torch.stack([_value(r, 7) * (1 if r % 2 else -1) for r in range(n)]).amax(0)
    torch.testing.assert_close(t, expected, rtol=0, atol=0, msg="all_reduce max")
    checked += ["all_reduce sum", "all_reduce max"]

    # reduce_scatter into a separate output: rank r gets slice r of the sum
    size = 5
    full_sum = _sum_over_ranks(n, size * n)
    out = torch.full((size,), -1.0)
    inp = _value(rank, size * n)
    finish(C.reduce_scatter(out, inp, async_op=async_op))
    torch.testing.assert_close(out, full_sum[rank * size : (rank + 1) * size], rtol=0, atol=0, msg="reduce_scatter")

    # in place: the output is this rank's own slice of the input
    inp = _value(rank, size * n)
    own = inp[rank * size : (rank + 1) * size]
    finish(C.reduce_scatter(own, inp, async_op=async_op))
    torch.testing.assert_close(
        own, full_sum[rank * size : (rank + 1) * size], rtol=0, atol=0, msg="reduce_scatter in place"
    )
    checked += ["reduce_scatter", "reduce_scatter in place"]

    # all_gather: slice r of the output is rank r's input
    expected = torch.cat([_value(r, size) for r in range(n)])
    out = torch.full((size * n,), -1.0)
    finish(C.all_gather(out, _value(rank, size), async_op=async_op))
    torch.testing.assert_close(out, expected, rtol=0, atol=0, msg="all_gather")

    # in place: the input is this rank's slice of the output; the rest holds garbage
    out = torch.full((size * n,), -7.0)
    out[rank * size : (rank + 1) * size] = _value(rank, size)
    finish(C.all_gather(out, out[rank * size : (rank + 1) * size], async_op=async_op))
    torch.testing.assert_close(out, expected, rtol=0, atol=0, msg="all_gather in place")
    checked += ["all_gather", "all_gather in place"]

    # broadcast from the last rank (a non-zero source)
    src = n - 1
    t = _value(rank, 6)
    finish(C.broadcast(t, src, async_op=async_op))
    torch.testing.assert_close(t, _value(src, 6), rtol=0, atol=0, msg="broadcast")
    checked.append("broadcast")

    # other dtypes go through unchanged
    t = _value(rank, 4, torch.float64)
    finish(C.all_reduce(t, async_op=async_op))
    torch.testing.assert_close(t, sum(_value(r, 4, torch.float64) for r in range(n)), rtol=0, atol=0)

    assert C.all_gather_objects({"rank": rank}) == [{"rank": r} for r in range(n)]
    # the source's object everywhere; the others' are never pickled (a lambda would fail)
    sent = {"from": n - 1, "path": "ckpt/step-1"} if rank == n - 1 else (lambda: None)
    assert C.broadcast_object(sent, n - 1) == {"from": n - 1, "path": "ckpt/step-1"}
    C.barrier()
    return checked


def _stats_snapshot() -> dict:
    """Run a fixed sequence of collectives with padding and return the counters."""
    n = C.get_world_size()
    stats = C.CommStats()
    C.all_reduce(torch.zeros(10), stats=stats, padding_numel=2)
    C.all_reduce(torch.zeros(6, dtype=torch.float64), stats=stats)  # 8-byte elements
    C.reduce_scatter(torch.zeros(3), torch.zeros(3 * n), stats=stats, padding_numel=1)
    C.all_gather(torch.zeros(4 * n), torch.zeros(4), stats=stats, padding_numel=n - 1)
    C.all_gather(torch.zeros(2 * n, dtype=torch.bfloat16), torch.zeros(2, dtype=torch.bfloat16), stats=stats)
    C.broadcast(torch.zeros(9), 0, stats=stats)
    handle = C.reduce_scatter(torch.zeros(5), torch.zeros(5 * n), stats=stats, async_op=True)
    handle.wait()
    return stats.snapshot()


def _size_mismatch_messages() -> list[str]:
    n = C.get_world_size()
    messages = []
    with pytest.raises(ValueError) as info:
        C.reduce_scatter(torch.zeros(3), torch.zeros(3 * n + 1))
    messages.append(str(info.value))
    with pytest.raises(ValueError) as info:
        C.all_gather(torch.zeros(4 * n - 1), torch.zeros(4))
    messages.append(str(info.value))
    C.barrier()  # nobody started a collective: the group is still usable
    t = torch.ones(2)
    C.all_reduce(t)
    assert t.tolist() == [n, n]
    return messages


# --------------------------------------------------------------------------- world size 1


@pytest.mark.parametrize("async_op", [False, True])
def test_world_size_1_without_process_group(async_op: bool) -> None:
    assert not C.is_initialized()
    assert (C.get_world_size(), C.get_rank()) == (1, 0)
    # The same checks as on many ranks: with N = 1 every closed form is the identity.
    assert _check_all(async_op) == [
        "all_reduce sum",
        "all_reduce max",
        "reduce_scatter",
        "reduce_scatter in place",
        "all_gather",
        "all_gather in place",
        "broadcast",
    ]


def test_world_size_1_copies_into_a_separate_output() -> None:
    out, inp = torch.zeros(4), torch.arange(4.0)
    C.reduce_scatter(out, inp)
    assert out.tolist() == [0, 1, 2, 3] and out.data_ptr() != inp.data_ptr()
    out = torch.zeros(4)
    C.all_gather(out, inp)
    assert out.tolist() == [0, 1, 2, 3]


# --------------------------------------------------------------------------- many ranks


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("async_op", [False, True])
def test_collectives_match_closed_form(world_size: int, async_op: bool) -> None:
    results = run_ranks(_check_all, world_size, async_op)
    assert all(len(r) == 7 for r in results)


# --------------------------------------------------------------------------- byte accounting


def _expected_stats(n: int) -> dict:
    """[Note: byte accounting] evaluated by hand for :func:`_stats_snapshot`."""

    def traffic(factor: int, calls: list[tuple[int, int, int]]) -> dict:
        # calls: (numel counted, padding numel, element size)
        payload = sum((numel - pad) * size for numel, pad, size in calls)
        padding = sum(pad * size for numel, pad, size in calls)
        return {
            "calls": len(calls),
            "payload_bytes": payload,
            "padding_bytes": padding,
            "sent_bytes": _ring_bytes(factor, payload, 1, n),
            "padding_sent_bytes": _ring_bytes(factor, padding, 1, n),
        }

    expected = {
        "all_reduce": traffic(2, [(10, 2, 4), (6, 0, 8)]),
        "reduce_scatter": traffic(1, [(3 * n, 1, 4), (5 * n, 0, 4)]),  # S = the full input
        "all_gather": traffic(1, [(4 * n, n - 1, 4), (2 * n, 0, 2)]),  # S = the full output
        "broadcast": traffic(1, [(9, 0, 4)]),
    }
    expected["total"] = {
        "sent_bytes": sum(v["sent_bytes"] for v in expected.values()),
        "padding_sent_bytes": sum(v["padding_sent_bytes"] for v in expected.values()),
    }
    return expected


def _assert_stats_equal(actual: dict, expected: dict) -> None:
    assert set(actual) == set(expected)
    for op, fields in expected.items():
        for name, value in fields.items():
            assert actual[op][name] == value, f"{op}.{name}: {actual[op][name]!r}, expected {value!r}"


def test_byte_accounting_world_size_1() -> None:
    snapshot = _stats_snapshot()
    _assert_stats_equal(snapshot, _expected_stats(1))
    assert snapshot["total"] == {"sent_bytes": 0.0, "padding_sent_bytes": 0.0}
    assert snapshot["all_reduce"]["payload_bytes"] == 8 * 4 + 6 * 8


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_byte_accounting_matches_ring_formulas(world_size: int) -> None:
    snapshots = run_ranks(_stats_snapshot, world_size)
    expected = _expected_stats(world_size)
    for snapshot in snapshots:
        _assert_stats_equal(snapshot, expected)


def test_comm_stats_reset() -> None:
    stats = C.CommStats()
    C.all_reduce(torch.zeros(3), stats=stats)
    assert stats.snapshot()["all_reduce"]["calls"] == 1
    stats.reset()
    assert stats.snapshot() == {"total": {"sent_bytes": 0, "padding_sent_bytes": 0}}


# --------------------------------------------------------------------------- errors


def _assert_clear(messages: list[str], n: int) -> None:
    rs, ag = messages
    assert "reduce_scatter" in rs and str(3 * n + 1) in rs and "world size" in rs
    assert "all_gather" in ag and str(4 * n - 1) in ag and "world size" in ag


def test_size_mismatch_world_size_1() -> None:
    _assert_clear(_size_mismatch_messages(), 1)


@pytest.mark.parametrize("world_size", [2, 3])
def test_size_mismatch_is_value_error_on_every_rank(world_size: int) -> None:
    for messages in run_ranks(_size_mismatch_messages, world_size, timeout=30):
        _assert_clear(messages, world_size)


# --------------------------------------------------------------------------- tagged all-gather


def _tagged_gather(numel: int, max_numel: int, tag: list[int], in_place: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One :func:`C.all_gather_tagged` of this rank's ``_value`` (``numel`` elements) into a
    full buffer with (``in_place``) or without room in front; returns (tags, full)."""
    rank, n = C.get_rank(), C.get_world_size()
    send, payload = C.tagged_buffer(numel, torch.float32, torch.device("cpu"))
    payload.copy_(_value(rank, numel))
    full = C.gather_target(n * numel, torch.float32, torch.device("cpu")) if in_place else torch.empty(n * numel)
    full.fill_(-1.0)
    if in_place:
        torch.empty(0, dtype=torch.int64).set_(full.untyped_storage(), 0, (2,)).zero_()  # the room in front
    tags = C.all_gather_tagged(full, send, tag, max_shard_bytes=4 * max_numel).wait()
    return tags, full


def _tagged_gathers() -> list[dict]:
    """Largest and smaller shards, with and without room in front, then two mismatches."""
    rank, n = C.get_rank(), C.get_world_size()
    results = []
    for numel, max_numel, in_place in [(5, 5, True), (5, 5, False), (3, 5, True), (1, 1, True)]:
        windows = in_place_windows(
            C.gather_target(n * numel, torch.float32, torch.device("cpu")), rank, n, 4 * numel, 4 * max_numel
        )
        tags, full = _tagged_gather(numel, max_numel, [7, 11], in_place)
        expected = torch.cat([_value(r, numel) for r in range(n)])
        # The 16 bytes in front of the full buffer: peer 0's tag, if it was received in place.
        front = torch.empty(0, dtype=torch.int64).set_(full.untyped_storage(), 0, (2,)).tolist() if in_place else []
        results.append(
            {
                "tags": tags,
                "exact": torch.equal(full, expected),
                "in_place": sorted(windows) if in_place else [],
                "front": front,
            }
        )
    # Mismatched tags, same sizes: every rank sees every rank's tag.
    tags, _ = _tagged_gather(5, 5, [3, rank], True)
    results.append({"tags": tags})
    # Mismatched sizes (another unit's shard, shorter than the largest): no abort, tags say so.
    tags, _ = _tagged_gather(5 if rank == 0 else 2, 5, [4, 0 if rank == 0 else 9], True)
    results.append({"tags": tags})
    return results


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_tagged_all_gather_in_place_and_through_the_receive_buffer(world_size: int) -> None:
    """Closed-form payloads and tags; a largest-shard gather into a gather target receives
    peer 0 and peer rank+1 in place (every peer at N = 2), a smaller shard none."""
    for rank, results in enumerate(run_ranks(_tagged_gathers, world_size, timeout=60)):
        for result in results[:4]:
            assert result["tags"] == [[7, 11]] * world_size
            assert result["exact"], f"rank {rank}: wrong payload in {result}"
        expected_peers = sorted({0, rank + 1} - {rank} & set(range(world_size)))
        assert results[0]["in_place"] == expected_peers
        assert (results[0]["front"] == [7, 11]) == (rank != 0), "peer 0 was not received in place"
        assert results[2]["in_place"] == [] and results[1]["in_place"] == []
        # A one-element chunk is shorter than a tag: a window starting in this rank's chunk
        # would overlap the one before it, so nothing is received in place.
        assert results[3]["in_place"] == []
        assert results[4]["tags"] == [[3, r] for r in range(world_size)]
        assert results[5]["tags"] == [[4, 0]] + [[4, 9]] * (world_size - 1)
        if world_size == 2:
            assert expected_peers == [1 - rank]
