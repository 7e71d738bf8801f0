"""Ranks whose collectives can never meet again are named within seconds, not at the timeout.

See [Note: stalled waits] in ``shardpar/comm/stalls.py``. Each job below parts its ranks so
that no collective of theirs completes again: every rank waits in one that another rank will
never issue, and the tags that name a unit order mismatch are never exchanged. Before, every
rank waited the whole ``timeout_s`` (300 s by default) and then raised ``RanksOutOfStep``; now
every rank raises a named error a few seconds after the ranks part, with ``timeout_s=30``:

- stage 3, rank 0 never runs a unit's forward (an early exit past the only block) and goes
  straight into backward: ``UnitOrderMismatch``, each rank's pass, unit and collective;
- stage 3, branches (each block its own unit) that diverge after the first step, with the
  default prefetch: ``UnitOrderMismatch``;
- stage 3, Hugging Face ``generate`` of different lengths per rank without
  ``synced_gpus=True``, then a save or a state dict on every rank: ``RanksOutOfStep`` naming
  the rank still generating (a forward without autograd) and pointing to ``synced_gpus``;
  an evaluation on rank 0 only while the others train on: ``UnitOrderMismatch``;
- a state dict gathered on rank 0 only (``model.module.state_dict()``, ``full_state_dict()``,
  a copy of the module; stages 0-3), the other ranks training on: ``RanksOutOfStep`` saying
  rank 0 is gathering a full state dict, which the others did not start.

And what must not be called a divergence: a rank that is merely slow (busy computing while
the others' waits stall) is waited for, and the job ends with plain torch's parameters.

Each failing job lets the error propagate out of the rank (after recording what it said and
when), so the harness tears the rank pool down: its process group holds collectives that
will never complete.
"""

from __future__ import annotations

import copy
import json
import re
import time
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardpar
from shardpar.comm import collectives as C
from shardpar.comm import stalls, watch
from tests.support.harness import RankFailure, run_ranks
from tests.support.zero3_models import Block

TIMEOUT_S = 30.0
"""shardpar's timeout_s in these jobs."""
NAMED_WITHIN_S = 12.0
"""Every rank's error must come this soon after the ranks part: STALL_S, a slice to see every
rank stalled, one to confirm, one for the others to see the verdict, and a loaded machine."""
VOCAB, DIM, SEQ = 32, 16, 6


class Caught(Exception):
    """What a rank raised and when, as one JSON line for the parent."""


def _record(error: shardpar.RanksOutOfStep, parted_at: float) -> Caught:
    return Caught(
        json.dumps(
            {
                "type": type(error).__name__,
                "elapsed": time.monotonic() - parted_at,
                "message": str(error),
                "reports": {str(rank): report for rank, report in error.reports.items()},
            }
        )
    )


def _caught(failure: RankFailure, rank: int) -> dict[str, Any]:
    text = failure.failures.get(rank, "")
    match = re.search(r"Caught: (\{.*\})\s*$", text, re.MULTILINE)
    assert match, f"rank {rank} raised nothing named:\n{text[-3000:]}"
    return json.loads(match.group(1))


def _assert_named_in_time(
    failure: RankFailure, world_size: int, kind: str, *texts: str, line_per_rank: bool = True
) -> list[dict[str, Any]]:
    """``line_per_rank``: the stall verdict's layout (one line per rank); a tag mismatch found
    at a gather names the ranks in one sentence (then ``texts`` name them)."""
    caught = [_caught(failure, rank) for rank in range(world_size)]
    for rank, what in enumerate(caught):
        assert what["type"] == kind, f"rank {rank} raised {what['type']}:\n{what['message']}"
        assert what["elapsed"] < NAMED_WITHIN_S, f"rank {rank} raised {what['elapsed']:.1f} s after the ranks parted"
        assert what["message"] == caught[0]["message"], f"rank {rank} says something else than rank 0"
        for text in texts:
            assert text in what["message"], f"rank {rank}: {text!r} not in\n{what['message']}"
        for other in range(world_size if line_per_rank else 0):
            assert f"\n  rank {other}: " in what["message"], f"rank {rank} does not name rank {other}"
    return caught


# --------------------------------------------------------------------------- a unit skipped, branches


class BranchLM(nn.Module):
    """A small language model whose middle is the transformer blocks ``route`` names, each
    block its own stage-3 unit (``wrap_policy=[Block]``); embedding and head stay with the root."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleDict({"left": Block(DIM, 2), "right": Block(DIM, 2)})
        self.ln_f = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor, route: list[str]) -> torch.Tensor:
        x = self.tok(tokens)
        for name in route:
            x = self.blocks[name](x)
        return self.head(self.ln_f(x))


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    data = torch.randint(0, VOCAB, (2, SEQ + 1), generator=torch.Generator().manual_seed(100 * step + rank))
    return data[:, :-1], data[:, 1:]


def _route(scenario: str, step: int, rank: int) -> list[str]:
    """Every rank runs ``left`` in step 0. From step 1: "skip" -- rank 0 exits early past the
    block, the others run it; "branch" -- even ranks run ``left``, odd ranks ``right``."""
    if step == 0:
        return ["left"]
    if scenario == "skip":
        return [] if rank == 0 else ["left"]
    return [["left", "right"][rank % 2]]


def _diverge(scenario: str) -> None:
    torch.manual_seed(0)
    model = shardpar.wrap(BranchLM(), stage=3, wrap_policy=[Block], timeout_s=TIMEOUT_S)
    opt = shardpar.optimizer(model, torch.optim.AdamW, lr=1e-2)
    rank = C.get_rank()
    for step in range(3):
        parted_at = time.monotonic()
        tokens, targets = _batch(step, rank)
        try:
            logits = model(tokens, _route(scenario, step, rank))
            F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1)).backward()
            opt.step()
            opt.zero_grad()
        except shardpar.RanksOutOfStep as error:
            raise _record(error, parted_at) from error


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_rank_that_skips_a_units_forward_is_named_within_seconds(world_size: int) -> None:
    """Rank 0 never runs the block's forward and goes straight into backward, where it waits in
    the gather of the block that the last backward's order prefetches, while the others wait in
    a gradient reduction that rank 0 has not posted. Used to wait the whole timeout and raise
    RanksOutOfStep."""
    with pytest.raises(RankFailure) as failure:
        run_ranks(_diverge, world_size, "skip", timeout=90)
    caught = _assert_named_in_time(
        failure.value,
        world_size,
        "UnitOrderMismatch",
        "stage 3: units ran in a different order on different ranks",
        "rank 0: in backward pass 2 and 1 optimizer steps",
        "unit 'blocks.left'",
    )
    assert caught[0]["reports"].keys() == {str(rank) for rank in range(world_size)}


@pytest.mark.parametrize("world_size", [2, 3])
def test_branches_that_diverge_after_the_first_step_are_named_within_seconds(world_size: int) -> None:
    """From step 1 odd ranks take the other branch: with the default prefetch, the even ranks'
    forward ends with the prefetched block and their backward waits in a reduction, while the
    odd ranks gather ``right``, which no even rank ever gathers."""
    with pytest.raises(RankFailure) as failure:
        run_ranks(_diverge, world_size, "branch", timeout=90)
    _assert_named_in_time(
        failure.value,
        world_size,
        "UnitOrderMismatch",
        "stage 3: units ran in a different order on different ranks",
        "at unit 'blocks.right'; waiting in tagged all_gather of unit 'blocks.right'",
    )


# --------------------------------------------------------------------------- generate of different lengths


def _generate_then(then: str, directory: str) -> None:
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=32, bos_token_id=0, eos_token_id=63
    )
    module = transformers.GPT2LMHeadModel(config)
    model = shardpar.wrap(module, stage=3, min_unit_params=1, timeout_s=TIMEOUT_S)
    opt = shardpar.optimizer(model, torch.optim.AdamW, lr=1e-3)
    rank = C.get_rank()
    ids = torch.randint(1, 60, (2, 8), generator=torch.Generator().manual_seed(rank))
    model(ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()
    parted_at = time.monotonic()
    try:
        model.eval()
        with torch.no_grad():  # no synced_gpus=True: rank 1 runs four forwards more than rank 0
            module.generate(
                torch.tensor([[1 + rank, 2, 3]]), max_new_tokens=3 + 4 * rank, do_sample=False, pad_token_id=0
            )
        model.train()
        if then == "save_checkpoint":
            shardpar.save_checkpoint(directory, model, opt)
        else:
            model.full_state_dict()
    except shardpar.RanksOutOfStep as error:
        raise _record(error, parted_at) from error


@pytest.mark.parametrize("then", ["save_checkpoint", "full_state_dict"])
def test_generate_of_different_lengths_is_named_within_seconds(then: str, tmp_path) -> None:
    """Rank 0's generation ends first and it goes on to the collective that follows on every
    rank, while rank 1 still gathers units for its next token. Used to wait the whole timeout;
    every rank now names rank 1 as in a forward without autograd and says synced_gpus=True."""
    pytest.importorskip("transformers")
    with pytest.raises(RankFailure) as failure:
        run_ranks(_generate_then, 2, then, str(tmp_path / "ckpt"), timeout=120)
    caught = _assert_named_in_time(
        failure.value,
        2,
        "RanksOutOfStep",
        f"rank 0 is in {then}",
        "which rank 1 did not start",
        "without autograd (evaluation or generation)",
        "synced_gpus=True",
    )
    assert caught[0]["reports"]["1"]["waiting_in"].startswith("tagged all_gather of unit"), caught[0]["reports"]
    assert caught[0]["reports"]["0"]["waiting_in"] == then
    assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").iterdir())


def _evaluate_on_rank_0_then_train() -> None:
    """nanoGPT's ``if iter_num % eval_interval == 0 and master_process: estimate_loss()``."""
    from tests.support.zero3_models import Z3LM

    torch.manual_seed(0)
    model = shardpar.wrap(Z3LM(layers=2), stage=3, wrap_policy=[Block], timeout_s=TIMEOUT_S)
    opt = shardpar.optimizer(model, torch.optim.AdamW, lr=1e-2)
    rank = C.get_rank()
    generator = torch.Generator().manual_seed(rank)
    for step in range(2):
        parted_at = time.monotonic()
        try:
            if step == 1 and rank == 0:
                model.eval()
                with torch.no_grad():
                    for _ in range(2):
                        model(Z3LM.example(2, generator)[0])
                model.train()
            tokens, targets = Z3LM.example(2, generator)
            Z3LM.loss(model(tokens), targets).backward()
            opt.step()
            opt.zero_grad()
        except shardpar.RanksOutOfStep as error:
            raise _record(error, parted_at) from error


def test_evaluation_on_rank_0_only_at_stage_3_is_named_within_seconds() -> None:
    """Rank 0 evaluates while rank 1 trains on. Used to wait the whole timeout. Since buffers
    are broadcast at the end of backward (DDP's rule, engines/buffer_sync.py) rank 1's training
    forward starts with a gather, which pairs with rank 0's evaluation gather: the tags differ
    and every rank raises at that first gather, naming both units."""
    with pytest.raises(RankFailure) as failure:
        run_ranks(_evaluate_on_rank_0_then_train, 2, timeout=90)
    _assert_named_in_time(
        failure.value,
        2,
        "UnitOrderMismatch",
        "paired up wrongly: rank 0: unit '<root>'",
        "rank 1: unit 'blocks.0'",
        line_per_rank=False,
    )


# --------------------------------------------------------------------------- a state dict on rank 0 only


def _state_dict_on_rank_0(stage: int, how: str, mixed_precision: str | None) -> None:
    from tests.support.zero3_models import Z3LM

    torch.manual_seed(0)
    module = Z3LM(layers=2)
    options = {"wrap_policy": [Block]} if stage == 3 else {}
    model = shardpar.wrap(module, stage=stage, mixed_precision=mixed_precision, timeout_s=TIMEOUT_S, **options)
    opt = shardpar.optimizer(model, torch.optim.AdamW, lr=1e-2)
    rank = C.get_rank()
    for step in range(2):
        tokens, targets = Z3LM.example(2, torch.Generator().manual_seed(10 * step + rank))
        parted_at = time.monotonic()
        try:
            if step == 1 and rank == 0:  # nanoGPT's `if master_process:` checkpoint
                if how == "module.state_dict":
                    torch.save(model.module.state_dict(), "/dev/null")
                elif how == "model.state_dict":
                    model.state_dict()
                elif how == "full_state_dict":
                    model.full_state_dict()
                else:
                    copy.deepcopy(model.module)  # an EMA copy made on rank 0 only
            Z3LM.loss(model(tokens), targets).backward()
            opt.step()
            opt.zero_grad()
        except shardpar.RanksOutOfStep as error:
            raise _record(error, parted_at) from error


STATE_DICT_CASES = [
    (1, "model.state_dict", None),  # the masters are sharded: a collective (not at stage 0, where every rank
    # holds every value: test_ddp_habits' rank-0-only state dicts complete)
    (1, "module.state_dict", "bf16"),  # the fp32 masters are sharded: a collective
    (2, "module.state_dict", "bf16"),
    (3, "module.state_dict", None),
    (3, "full_state_dict", None),
    (3, "deepcopy", None),
]


@pytest.mark.parametrize("stage,how,mixed_precision", STATE_DICT_CASES)
def test_a_state_dict_on_rank_0_only_is_named_within_seconds(stage: int, how: str, mixed_precision: str | None) -> None:
    """Every rank says that rank 0 is gathering a full state dict, which rank 1 did not start,
    and where rank 1 waits. Before: every rank waited the whole timeout (stage 3), and at stages
    0-2 rank 0's all-reduce could pair with another rank's training collective (wrong bytes, or
    gloo aborting on a size mismatch); now the state dict's ranks first meet through the store."""
    with pytest.raises(RankFailure) as failure:
        run_ranks(_state_dict_on_rank_0, 2, stage, how, mixed_precision, timeout=90)
    caught = _assert_named_in_time(
        failure.value,
        2,
        "RanksOutOfStep",
        "rank 0 is in full_state_dict (gathering every parameter for a state dict",
        "which rank 1 did not start",
        "rank 0: full_state_dict (gathering every parameter for a state dict",
        "waiting in full_state_dict (rank 1 never started it)",
        "To save on one rank, gather on every rank",
    )
    assert caught[1]["reports"]["0"]["waiting_in"] == "full_state_dict"
    assert caught[1]["reports"]["1"]["waiting_in"] != "full_state_dict"


# --------------------------------------------------------------------------- slow is not divergent


def _slow_rank(stage: int, slow_rank: int) -> dict[str, torch.Tensor]:
    """Three steps of BranchLM on every rank's slice of one global batch; at step 1,
    ``slow_rank`` computes for STALL_S + 3 slices inside a block's forward, while the others
    wait for its gathers or reductions."""
    before = stalls.STALL_S
    stalls.STALL_S = 0.5  # stalls sooner, so that the slow rank is slow by several of them
    try:
        torch.manual_seed(0)
        module = BranchLM()
        rank, world_size = C.get_rank(), C.get_world_size()
        sleep_s = stalls.STALL_S + 3 * watch.SLICE_S
        handle = module.blocks["left"].register_forward_hook(
            lambda *_: time.sleep(sleep_s) if module.training and module.step == 1 and rank == slow_rank else None
        )
        options = {"wrap_policy": [Block], "min_unit_params": 1} if stage == 3 else {}
        model = shardpar.wrap(module, stage=stage, timeout_s=TIMEOUT_S, **options)
        opt = shardpar.optimizer(model, torch.optim.AdamW, lr=1e-2)
        for step in range(3):
            module.step = step
            tokens, targets = _global_batch(step)
            rows = slice(rank * len(tokens) // world_size, (rank + 1) * len(tokens) // world_size)
            logits = model(tokens[rows], ["left", "right"])
            F.cross_entropy(logits.reshape(-1, VOCAB), targets[rows].reshape(-1)).backward()
            opt.step()
            opt.zero_grad()
        handle.remove()
        return model.full_state_dict()
    finally:
        stalls.STALL_S = before


def _global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    data = torch.randint(0, VOCAB, (6, SEQ + 1), generator=torch.Generator().manual_seed(step))
    return data[:, :-1], data[:, 1:]


def _plain_torch() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    module = BranchLM()
    opt = torch.optim.AdamW(module.parameters(), lr=1e-2)
    for step in range(3):
        tokens, targets = _global_batch(step)
        F.cross_entropy(module(tokens, ["left", "right"]).reshape(-1, VOCAB), targets.reshape(-1)).backward()
        opt.step()
        opt.zero_grad()
    return module.state_dict()


@pytest.mark.parametrize("stage,world_size", [(0, 2), (3, 2), (3, 3)])
def test_a_slow_rank_is_waited_for_and_not_called_divergent(stage: int, world_size: int) -> None:
    """The others' waits stall for several STALL_S while the slow rank computes (it posts
    nothing: it is not waiting), so no verdict comes; the job ends with plain torch's
    parameters on every rank."""
    expected = _plain_torch()
    for rank, state in enumerate(run_ranks(_slow_rank, world_size, stage, world_size - 1, timeout=120)):
        for name, value in expected.items():
            torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6, msg=f"rank {rank}: {name}")


# --------------------------------------------------------------------------- the judgement itself


def _position(
    rank: int,
    group: str,
    ranks: list[int],
    issued: dict[str, int],
    *,
    number: int | None = None,
    meeting: str | None = None,
    op: str = "all_reduce (sum)",
) -> dict[str, Any]:
    waiting: dict[str, Any] = {"group": group, "ranks": ranks, "op": op}
    waiting.update({"meeting": meeting} if meeting is not None else {"number": number})
    return {
        "stall": 1,
        "waiting": waiting,
        "issued": issued,
        "doing": f"rank {rank}'s work",
        "operations": [],
        "engines": [{"phase": "backward", "backward_count": 2, "step_count": 1, "unit": None}],
    }


def test_every_rank_waiting_for_another_is_a_verdict_and_a_slow_collective_is_not() -> None:
    """``stalls.judge`` on positions as ranks post them (group "0": the main group, "1": stage
    3's gather group)."""
    both = [0, 1]
    # Rank 0 waits in collective 7 of the gather group, which rank 1 did not issue; rank 1 in
    # collective 5 of the main group, which rank 0 did not issue: neither can complete.
    parted = {
        0: _position(0, "1", both, {"0": 4, "1": 7}, number=7, op="tagged all_gather of unit 'a'"),
        1: _position(1, "0", both, {"0": 5, "1": 6}, number=5, op="reduce_scatter"),
    }
    verdict = stalls.judge(parted)
    assert verdict is not None and verdict["kind"] == "units", verdict
    assert "rank 1 has not issued it" in verdict["reports"]["0"]["cause"]
    # Rank 1 did issue collective 7 (it waits on a later one): rank 0's is in flight, only slow.
    slow = {0: parted[0], 1: _position(1, "1", both, {"0": 5, "1": 8}, number=8, op="tagged all_gather of unit 'b'")}
    assert stalls.judge(slow) is None
    # Both in the same collective (a third rank, or the network, holds them up): no verdict.
    same = {r: _position(r, "0", both, {"0": 5}, number=5) for r in both}
    assert stalls.judge(same) is None
    # The same collective number, other collectives: they can never pair.
    other_op = {0: same[0], 1: _position(1, "0", both, {"0": 5}, number=5, op="all_gather")}
    assert stalls.judge(other_op) is not None
    # A meeting that rank 1 never came to, while rank 1 waits in a collective rank 0 did not issue.
    meeting = {
        0: _position(0, "0", both, {"0": 4}, meeting="save_checkpoint-0", op="save_checkpoint"),
        1: _position(1, "0", both, {"0": 5}, number=5),
    }
    meeting[0]["operations"] = ["save_checkpoint"]
    verdict = stalls.judge(meeting)
    assert verdict is not None and verdict["kind"] == "operation", verdict
    assert "rank 0 is in save_checkpoint, which rank 1 did not start" in verdict["message"]
    # Both at the meeting, one of three ranks elsewhere but not held up: no verdict.
    three = [0, 1, 2]
    waiting_for_2 = {r: _position(r, "0", three, {"0": 4}, meeting="save_checkpoint-0") for r in (0, 1)}
    waiting_for_2[2] = _position(2, "0", three, {"0": 4}, number=4)  # its collective 4: everyone issued it
    assert stalls.judge(waiting_for_2) is None
    # Point-to-point waits carry no number: never judged.
    p2p = {0: _position(0, "0", both, {"0": 4}, number=None, op="recv from rank 1"), 1: parted[1]}
    assert stalls.judge(p2p) is None
    # Ranks at different points of training: RanksOutOfStep, not a unit order error.
    apart = copy.deepcopy(parted)
    apart[1]["engines"][0]["step_count"] = 2
    assert stalls.judge(apart)["kind"] == "training"
