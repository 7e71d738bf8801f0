"""Ranks that fall out of step are named on every rank, within the configured timeout.

See [Note: ranks out of step] in ``shardpar/comm/watch.py``. Each scenario lets the error
propagate out of the rank (after recording what it said and when, in a :class:`Caught`), so
the harness tears the rank pool down: after ranks fall out of step their process group holds
collectives that will never complete, and no later test may use it.

- A skipped backward, a different number of micro-batches, a skipped optimizer step: where
  the parted ranks' collectives still pair up, the counters riding on the gradient flags'
  all-reduce differ and every rank raises :class:`shardpar.RanksOutOfStep` at that backward,
  naming each rank's counts; where they no longer pair up (stage 3's gathers, stage 1's
  all-gather after the step), every rank raises after ``timeout_s`` with each rank's report
  (which pass, which collective). Before: stage 0 trained on silently with different
  weights; stage 2 ended in a bare gloo timeout naming nobody.
- ``save_checkpoint`` on one rank only (stages 0, 2, 3): the saving rank waits at the
  save's meeting point, the others in their next collective; after ``timeout_s`` every rank
  raises, naming what each was doing. Before: a bare gloo timeout.
- A rank that dies, or that never arrives (busy outside shardpar): the others raise after
  at most ``timeout_s``, naming it as the rank that sent no report.
"""

from __future__ import annotations

import json
import os
import re
import time
from typing import Any

import pytest
import torch
from torch import nn

import shardpar
from shardpar.comm import collectives as C
from shardpar.comm import watch
from tests.support.harness import RankFailure, run_ranks

TIMEOUT_S = 3.0
"""shardpar's timeout_s in these jobs: waits that cannot complete end after this long."""
SLACK_S = 12.0
"""Start-up, the post-mortem's grace for reports and a loaded two-core machine."""


LATE_S = 2.5 * watch.SLICE_S
"""A late rank: later than a few of the bounded wait's slices, well within the timeout."""


class Caught(Exception):
    """What a rank's RanksOutOfStep said and when, as one JSON line for the parent."""


def _record(error: shardpar.RanksOutOfStep, started: float) -> Caught:
    return Caught(
        json.dumps(
            {
                "elapsed": time.monotonic() - started,
                "message": str(error),
                "missing": error.missing,
                "reports": {str(r): v for r, v in error.reports.items()},
            }
        )
    )


def _caught(failure: RankFailure, rank: int) -> dict[str, Any]:
    text = failure.failures.get(rank, "")
    match = re.search(r"Caught: (\{.*\})\s*$", text, re.MULTILINE)
    assert match, f"rank {rank} did not raise RanksOutOfStep:\n{text[-3000:]}"
    return json.loads(match.group(1))


def _model(stage: int, timeout_s: float = TIMEOUT_S) -> tuple[Any, Any]:
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    model = shardpar.wrap(module, stage=stage, timeout_s=timeout_s, bucket_cap_mb=0.0002, min_unit_params=1)
    return model, shardpar.optimizer(model, torch.optim.AdamW, lr=1e-2)


def _train(stage: int, scenario: str, odd_rank: int, directory: str = "", timeout_s: float = TIMEOUT_S) -> Any:
    """Four steps of two micro-batches; ``odd_rank`` deviates at step 2 as ``scenario`` says."""
    model, opt = _model(stage, timeout_s)
    rank = C.get_rank()
    started = time.monotonic()
    try:
        for step in range(4):
            odd = step == 2 and rank == odd_rank
            if odd and scenario == "dies":
                os._exit(3)
            if odd and scenario == "busy":
                time.sleep(60)
            if odd and scenario == "late":
                time.sleep(LATE_S)
            micro_batches = 3 if odd and scenario == "extra micro-batch" else 2
            for _ in range(micro_batches - 1):
                with model.no_sync():
                    model(torch.randn(2, 8)).sum().backward()
            if odd and scenario == "save on one rank":
                shardpar.save_checkpoint(directory, model, opt)
            if not (odd and scenario == "skipped backward"):
                model(torch.randn(2, 8)).sum().backward()
            if not (odd and scenario == "skipped step"):
                opt.step()
            opt.zero_grad()
    except shardpar.RanksOutOfStep as error:
        raise _record(error, started) from error
    return model.state_dict()


def _run(scenario: str, stage: int, world_size: int = 2, odd_rank: int = 1, directory: str = "") -> RankFailure:
    with pytest.raises(RankFailure) as failure:
        run_ranks(_train, world_size, stage, scenario, odd_rank, directory, timeout=60)
    return failure.value


def _counters(rank0: tuple[int, int, int], rank1: tuple[int, int, int]) -> list[str]:
    """What the counters' error says: found at the first synchronising backward after the
    ranks parted, at once."""
    return [
        f"rank {rank}: {sync} synchronising backward passes, {total} backward passes in all, {steps} optimizer steps"
        for rank, (sync, total, steps) in enumerate((rank0, rank1))
    ]


def _reports(rank0: str, rank1: str) -> list[str]:
    """What the post-mortem says when the parted ranks' collectives no longer pair up (stage 3's
    gathers in forward, stage 2's all-gather after the step), after timeout_s."""
    return [f"rank 0: {rank0}", f"rank 1: {rank1}"]


IN_BACKWARD_6 = "in backward pass 6 and 2 optimizer steps, at unit '0'; waiting in reduce_scatter"
"""Stage 3 says which unit's forward or backward started last."""

# Rank 1 skips step 2's synchronising backward, so its next one (step 3's) pairs with rank 0's
# third: by then rank 1 has run one more micro-batch and one more step.
SKIPPED_BACKWARD = {
    0: _counters((3, 6, 2), (3, 7, 3)),
    1: _counters((3, 6, 2), (3, 7, 3)),
    2: _counters((3, 6, 2), (3, 7, 3)),
    3: _reports(
        IN_BACKWARD_6,
        "in a forward pass after 6 backward passes and 3 optimizer steps, at unit '0'; waiting in tagged all_gather",
    ),
}
EXTRA_MICRO_BATCH = {
    0: _counters((3, 6, 2), (3, 7, 2)),
    2: _counters((3, 6, 2), (3, 7, 2)),
    3: _reports(
        IN_BACKWARD_6,
        "in a forward pass after 6 backward passes and 2 optimizer steps, at unit '0'; waiting in tagged all_gather",
    ),
}
# Stages 1-2 all-gather after the step (in the next forward), which rank 1 skips.
STEP_ALL_GATHER = _reports(
    "in a forward pass after 6 backward passes and 3 optimizer steps; waiting in all_gather",
    "in backward pass 8 and 2 optimizer steps; waiting in reduce_scatter",
)
SKIPPED_STEP = {
    0: _counters((4, 8, 3), (4, 8, 2)),
    1: STEP_ALL_GATHER,
    2: STEP_ALL_GATHER,
    3: _counters((4, 8, 3), (4, 8, 2)),
}


def _assert_named(failure: RankFailure, expected: list[str], world_size: int = 2) -> None:
    for rank in range(world_size):
        caught = _caught(failure, rank)
        assert caught["elapsed"] < TIMEOUT_S + SLACK_S, f"rank {rank} raised after {caught['elapsed']:.1f} s"
        for text in expected:
            assert text in caught["message"], f"rank {rank}: {text!r} not in\n{caught['message']}"


@pytest.mark.parametrize("stage", sorted(SKIPPED_BACKWARD))
def test_a_skipped_backward_is_named_on_every_rank(stage: int) -> None:
    _assert_named(_run("skipped backward", stage), SKIPPED_BACKWARD[stage])


@pytest.mark.parametrize("stage", sorted(EXTRA_MICRO_BATCH))
def test_a_different_number_of_micro_batches_is_named_on_every_rank(stage: int) -> None:
    _assert_named(_run("extra micro-batch", stage), EXTRA_MICRO_BATCH[stage])


@pytest.mark.parametrize("stage", sorted(SKIPPED_STEP))
def test_a_skipped_optimizer_step_is_named_on_every_rank(stage: int) -> None:
    _assert_named(_run("skipped step", stage), SKIPPED_STEP[stage])


def test_three_ranks_name_the_one_that_skipped() -> None:
    failure = _run("skipped backward", 2, world_size=3, odd_rank=2)
    for rank in (0, 1, 2):
        message = _caught(failure, rank)["message"]
        for other in (0, 1):
            assert f"rank {other}: 3 synchronising backward passes, 6 backward passes in all, 2 optimizer" in message
        assert "rank 2: 3 synchronising backward passes, 7 backward passes in all, 3 optimizer steps" in message


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_save_checkpoint_on_one_rank_is_named_on_every_rank_within_the_timeout(stage: int, tmp_path) -> None:
    failure = _run("save on one rank", stage, directory=str(tmp_path / "ckpt"))
    for rank in (0, 1):
        caught = _caught(failure, rank)
        assert caught["elapsed"] < TIMEOUT_S + SLACK_S, f"rank {rank} took {caught['elapsed']:.1f} s"
        assert caught["missing"] == []
        assert caught["reports"]["1"]["doing"].startswith("save_checkpoint"), caught["reports"]["1"]
        assert caught["reports"]["1"]["waiting_in"] == "save_checkpoint"
        assert "save_checkpoint" not in caught["reports"]["0"]["doing"], caught["reports"]["0"]
    assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").iterdir())


@pytest.mark.parametrize("stage", [0, 3])
def test_a_rank_that_never_arrives_is_named_after_the_timeout(stage: int) -> None:
    failure = _run("busy", stage)
    caught = _caught(failure, 0)
    assert TIMEOUT_S - 0.5 < caught["elapsed"] < TIMEOUT_S + SLACK_S
    assert caught["missing"] == [1]
    assert f"did not complete within timeout_s={TIMEOUT_S:g}" in caught["message"]
    assert "rank 1: no report" in caught["message"]


@pytest.mark.parametrize("stage", [0, 3])
def test_a_rank_later_than_a_wait_slice_but_within_the_timeout_is_waited_for(stage: int) -> None:
    """Bounded waits are sliced (to look for other ranks' incidents): a slice running out must
    not disturb the collective. The job finishes and both ranks hold the same weights."""
    first, second = run_ranks(_train, 2, stage, "late", 1, "", 4 * LATE_S, timeout=60)
    assert first.keys() == second.keys()
    for name in first:
        assert torch.equal(first[name], second[name]), name


def _train_shortening_grace(stage: int, scenario: str, odd_rank: int) -> None:
    # The harness gives ranks 2 s to report once another died: shorten the post-mortem's
    # wait for the dead rank's report to fit (the pool is torn down after this test).
    watch.GRACE_S = 0.5
    _train(stage, scenario, odd_rank)


@pytest.mark.parametrize("stage", [0, 3])
def test_a_rank_that_dies_is_named_as_missing(stage: int) -> None:
    with pytest.raises(RankFailure) as failure:
        run_ranks(_train_shortening_grace, 2, stage, "dies", 1, timeout=60)
    assert "exit code 3" in failure.value.failures[1]
    caught = _caught(failure.value, 0)
    assert caught["missing"] == [1]
    assert "rank 1: no report -- it exited or died" in caught["message"]
    assert caught["elapsed"] < TIMEOUT_S + SLACK_S


def test_a_closed_engine_leaves_the_reports() -> None:
    """What a rank reports doing names the live engines only: closing one (while something
    still holds it) takes it out, and another engine stays in."""
    kept = shardpar.wrap(nn.Linear(3, 3), stage=0)
    closed = shardpar.wrap(nn.Linear(3, 3), stage=1)
    kept.engine.state.step_count, closed.engine.state.step_count = 11, 22
    assert "11 optimizer steps" in watch.doing() and "22 optimizer steps" in watch.doing()
    closed.engine.close()
    assert "11 optimizer steps" in watch.doing() and "22 optimizer steps" not in watch.doing()
    kept.engine.close()
    assert "11 optimizer steps" not in watch.doing()
