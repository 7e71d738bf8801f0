"""``ShardparTrainer`` (shardpar.integrations.transformers) under the real Hugging Face
``Trainer``, 2 CPU ranks, against the DDP Trainer (the plain ``Trainer``: accelerate wraps the
model in torch's DDP) with the same arguments, data, sampler and seed (the oracle).

The ranks are the harness's (started as torchrun would; accelerate takes their process
group); what they run is ``tests/support/trainer_runs.py``. Importing transformers takes seconds, so
each launch serves several tests (module fixtures) and the pytest process never imports it.

Tolerances: fp32 runs must match DDP within ``TOLERANCE`` (1e-5 relative, the parity contract
of tests/support/parity.py); stage 0 reduces buckets in DDP's order and matches exactly. Under
``bf16=True`` both trainers compute in accelerate's autocast on float32 parameters, so stage 0
equals DDP's bf16 run bit for bit; at stages 1-3 the first step is DDP's (its loss exactly,
its gradient norm to float32's reduction order) and later steps start from parameters a few
ulps apart, which bf16 rounding can turn into 1e-5 of loss (``BF16_TOLERANCE``).
"""

from __future__ import annotations

import os

import pytest
import torch

from shardpar.checkpoint.format import read_manifest
from tests.support.harness import run_ranks
from tests.support.parity import TOLERANCE, assert_params_close, relative_to_oracle

TIMEOUT_S = 300.0  # a launch imports transformers on each rank (seconds on a loaded machine), then trains
BF16_TOLERANCE = 1e-4


def _assert_close(got: list, want: list, tolerance: float, what: str) -> None:
    assert len(got) == len(want) > 0, f"{what}: {len(got)} values, the oracle {len(want)}"
    error = relative_to_oracle(torch.tensor(got), torch.tensor(want))
    assert error <= tolerance, f"{what}: {got} differ from the oracle's {want} by {error:.2e}"


# --------------------------------------------------------------------------- training at stages 0-3


def _parity_runs(directory: str) -> dict:
    from tests.support import trainer_runs as R

    def where(name: str) -> str:
        return os.path.join(directory, name.replace(" ", "-"))

    steps = {"gradient_accumulation_steps": 2}  # 2 epochs of 2 optimizer steps, max_grad_norm=0.3
    runs = {name: R.fit(name, where(name), **steps) for name in ("ddp", "stage0", "stage1", "stage2", "stage3")}
    for name in ("ddp", "stage2"):
        runs[f"{name} unclipped"] = R.fit(name, where(f"{name} unclipped"), evaluate=False, max_grad_norm=0.0)
    for name in ("ddp", "stage0", "stage3"):
        runs[f"{name} bf16"] = R.fit_bf16(name, where(f"{name} bf16"), **steps)
    for name in ("stage0", "stage3"):
        runs[f"{name} saved"] = R.save_and_reload(name, where(f"{name} saved"))
    runs["refusals"] = R.refusals(where("refusals"))
    return runs


@pytest.fixture(scope="module")
def parity(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return run_ranks(_parity_runs, 2, str(tmp_path_factory.mktemp("trainer")), timeout=TIMEOUT_S)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_trainer_trains_evaluates_and_predicts_as_ddp(parity: list[dict], stage: int) -> None:
    """Two epochs of 2 optimizer steps, each accumulating 2 micro-batches (the first under
    ``no_sync``: one synchronising backward per step), clipped at 0.3 (below every step's
    norm), the Trainer's AdamW (``adamw_torch_fused``, weight decay on its param groups) and
    linear schedule; then ``evaluate()`` and ``predict()``, which every rank runs."""
    for rank, runs in enumerate(parity):
        ours, ddp = runs[f"stage{stage}"], runs["ddp"]
        what = f"stage {stage}, rank {rank}"
        tolerance = 0.0 if stage == 0 else TOLERANCE
        assert ours["wrapped"] == "ShardedModule" and ours["model"] == ddp["model"] == "LlamaForCausalLM", what
        assert ddp["wrapped"] == "DistributedDataParallel", what
        assert ours["global_step"] == ddp["global_step"] == 4 and ours["steps"] == [1, 2, 3, 4], what
        assert ours["synchronising_backwards"] == 4, f"{what}: accumulation reduced outside the last micro-batch"
        _assert_close(ours["losses"], ddp["losses"], tolerance, f"{what}, losses")
        _assert_close(ours["grad_norms"], ddp["grad_norms"], max(tolerance, 1e-6), f"{what}, logged grad norms")
        assert min(ddp["grad_norms"]) > 0.3, "the oracle's steps must all clip"
        assert ours["lrs"] == ddp["lrs"] == [0.01, 0.0075, 0.005, 0.0025], what
        assert_params_close(ours["params"], ddp["params"], tolerance, what)
        for metric in ("eval_loss", "test_loss"):
            _assert_close([ours[metric]], [ddp[metric]], tolerance, f"{what}, {metric}")
        _assert_close(
            ours["logits"].flatten().tolist(),
            ddp["logits"].flatten().tolist(),
            max(tolerance, 1e-5),
            f"{what}, predict()'s logits",
        )
        assert ours["logits"].shape == ddp["logits"].shape == (8, 16, 64), what


def test_max_grad_norm_zero_logs_the_norm_and_clips_nothing(parity: list[dict]) -> None:
    for rank, runs in enumerate(parity):
        ours, ddp = runs["stage2 unclipped"], runs["ddp unclipped"]
        _assert_close(ours["grad_norms"], ddp["grad_norms"], TOLERANCE, f"rank {rank}, grad norms")
        assert_params_close(ours["params"], ddp["params"], TOLERANCE, f"rank {rank}")
        # unclipped training went elsewhere than clipped training
        assert (
            relative_to_oracle(ours["params"]["model.norm.weight"], runs["stage2"]["params"]["model.norm.weight"])
            > 1e-4
        )


@pytest.mark.parametrize("stage", [0, 3])
def test_bf16_is_the_ddp_trainers_bf16(parity: list[dict], stage: int) -> None:
    """``bf16=True``: the autocast accelerate gives the DDP Trainer's model (bfloat16 compute,
    float32 parameters and outputs), not dropped. Stage 0 is DDP's bf16 run bit for bit;
    stage 3's first step is (see the module docstring for later steps)."""
    for rank, runs in enumerate(parity):
        ours, ddp, fp32 = runs[f"stage{stage} bf16"], runs["ddp bf16"], runs[f"stage{stage}"]
        what = f"stage {stage}, rank {rank}"
        assert ours["compute_dtypes"] == ddp["compute_dtypes"] == ["torch.bfloat16"], what
        assert all(value.dtype == torch.float32 for value in ours["params"].values()), what
        if stage == 0:
            assert ours["losses"] == ddp["losses"] and ours["grad_norms"] == ddp["grad_norms"], what
            assert_params_close(ours["params"], ddp["params"], 0.0, what)
            assert ours["eval_loss"] == ddp["eval_loss"], what
        else:
            assert ours["losses"][0] == ddp["losses"][0], what
            _assert_close(ours["grad_norms"][:1], ddp["grad_norms"][:1], 1e-6, f"{what}, first grad norm")
            _assert_close(ours["losses"], ddp["losses"], BF16_TOLERANCE, f"{what}, losses")
            _assert_close([ours["eval_loss"]], [ddp["eval_loss"]], BF16_TOLERANCE, f"{what}, eval loss")
        # and it really computed in bf16: the first step's norm is not float32's
        assert relative_to_oracle(torch.tensor(ours["grad_norms"][:1]), torch.tensor(fp32["grad_norms"][:1])) > 1e-5, (
            what
        )


@pytest.mark.parametrize("stage", [0, 3])
def test_save_model_writes_what_from_pretrained_loads(parity: list[dict], stage: int) -> None:
    """``save_model`` on every rank (a gather at stage 3, then rank 0 writes): the Hugging
    Face layout with its config, the tied embedding kept tied, the trained weights."""
    for rank, runs in enumerate(parity):
        saved = runs[f"stage{stage} saved"]
        assert {"config.json", "model.safetensors"} <= set(saved["files"]), saved["files"]
        assert saved["tied"], f"rank {rank}: lm_head no longer tied to the embedding"
        assert_params_close(saved["reloaded"], saved["trained"], 0.0, f"stage {stage}, rank {rank}")


def test_naive_patterns_are_refused_by_name(parity: list[dict]) -> None:
    for rank, runs in enumerate(parity):
        refused = runs["refusals"]
        assert refused["sharded_model"].startswith("TypeError: ShardparTrainer got a model already wrapped"), rank
        assert "ShardedModule around LlamaForCausalLM" in refused["sharded_model"], rank
        assert refused["unknown_option"].startswith("TypeError: ShardparTrainer got unknown option(s) bucket_cap")
        assert refused["bad_stage"].startswith("ValueError: stage must be 0, 1, 2 or 3"), refused["bad_stage"]
        for where in ("ddp_around", "plain_trainer"):  # refused by the ShardedModule itself, when DDP asks it
            assert refused[where].startswith(
                "TypeError: torch DistributedDataParallel around a model wrapped by shardpar"
            ), (rank, where, refused[where])
            assert "ShardparTrainer(..., shardpar_stage=N)" in refused[where], rank


# --------------------------------------------------------------------------- checkpoints and resumption


def _checkpoint_runs(directory: str) -> dict:
    from tests.support import trainer_runs as R

    one_epoch = {"num_train_epochs": 1, "evaluate": False}
    saving = {"save_strategy": "steps", "save_steps": 2}
    ddp_dir, ours_dir = os.path.join(directory, "ddp"), os.path.join(directory, "stage1")
    runs = {
        "ddp": R.fit("ddp", ddp_dir, **saving, **one_epoch),
        "saved": R.fit("stage1", ours_dir, **saving, **one_epoch),
        "ddp resumed": R.fit(
            "ddp",
            os.path.join(directory, "ddp-resumed"),
            **one_epoch,
            resume_from=os.path.join(ddp_dir, "checkpoint-2"),
        ),
        "resumed at stage 3": R.fit(
            "stage3",
            os.path.join(directory, "stage3-resumed"),
            **one_epoch,
            resume_from=os.path.join(ours_dir, "checkpoint-2"),
        ),
        "from ddp": R.error_of(
            R.fit,
            "stage2",
            os.path.join(directory, "wrong"),
            **one_epoch,
            resume_from=os.path.join(ddp_dir, "checkpoint-2"),
        ),
    }
    return runs


def _resume_alone(directory: str) -> dict:
    """World size 1, twice the rows per device (the same rows per step as 2 ranks)."""
    from tests.support import trainer_runs as R

    options = {"num_train_epochs": 1, "evaluate": False, "per_device_train_batch_size": 2 * R.BATCH}
    return {
        "ddp": R.fit(
            "ddp",
            os.path.join(directory, "ddp-alone"),
            **options,
            resume_from=os.path.join(directory, "ddp", "checkpoint-2"),
        ),
        "stage2": R.fit(
            "stage2",
            os.path.join(directory, "stage2-alone"),
            **options,
            resume_from=os.path.join(directory, "stage1", "checkpoint-2"),
        ),
    }


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], dict, str]:
    directory = str(tmp_path_factory.mktemp("trainer-checkpoints"))
    runs = run_ranks(_checkpoint_runs, 2, directory, timeout=TIMEOUT_S)
    alone = run_ranks(_resume_alone, 1, directory, timeout=TIMEOUT_S)[0]
    return runs, alone, directory


def _after(run: dict, step: int) -> list[float]:
    return [loss for loss, at in zip(run["losses"], run["steps"]) if at > step]


def test_checkpoint_holds_a_shardpar_optimizer_and_the_trainers_files(
    checkpoints: tuple[list[dict], dict, str],
) -> None:
    _, _, directory = checkpoints
    for step in (2, 4):
        path = os.path.join(directory, "stage1", f"checkpoint-{step}")
        files = set(os.listdir(path))
        assert {
            "model.safetensors",
            "config.json",
            "scheduler.pt",
            "trainer_state.json",
            "rng_state_0.pth",
            "rng_state_1.pth",
            "shardpar",
        } <= files, files
        assert "optimizer.pt" not in files, "the optimizer must not be rank 0's torch.save"
        manifest = read_manifest(os.path.join(path, "shardpar"))
        assert (manifest.stage, manifest.world_size) == (1, 2) and manifest.optimizer is not None
        assert manifest.extra == {"global_step": step}


def test_resume_at_another_stage_continues_as_ddp_resumed(checkpoints: tuple[list[dict], dict, str]) -> None:
    """Saved at stage 1 at step 2, resumed at stage 3 (``resume_from_checkpoint``): steps 3-4
    are those of the DDP Trainer resumed from its own step-2 checkpoint, and the scheduler and
    step counter continue."""
    runs, _, _ = checkpoints
    for rank, run in enumerate(runs):
        ours, ddp = run["resumed at stage 3"], run["ddp resumed"]
        what = f"rank {rank}"
        assert ours["global_step"] == ddp["global_step"] == 4, what
        assert len(_after(ours, 2)) == 2, what
        _assert_close(_after(ours, 2), _after(ddp, 2), TOLERANCE, f"{what}, steps 3-4")
        assert_params_close(ours["params"], ddp["params"], TOLERANCE, what)
        assert ours["lrs"][-2:] == ddp["lrs"][-2:] == [0.005, 0.0025], what
        # and the uninterrupted runs agree with each other too
        assert_params_close(run["saved"]["params"], run["ddp"]["params"], TOLERANCE, f"{what}, saving runs")


def test_resume_at_another_world_size(checkpoints: tuple[list[dict], dict, str]) -> None:
    """The stage-1 checkpoint of 2 ranks resumed by one process at stage 2, against the DDP
    Trainer's checkpoint resumed by one process the same way, and against 2 ranks resumed."""
    runs, alone, _ = checkpoints
    ours, ddp = alone["stage2"], alone["ddp"]
    assert ours["global_step"] == ddp["global_step"] == 4
    _assert_close(_after(ours, 2), _after(ddp, 2), TOLERANCE, "world size 1, steps 3-4")
    assert_params_close(ours["params"], ddp["params"], TOLERANCE, "world size 1")
    assert_params_close(ours["params"], runs[0]["ddp resumed"]["params"], TOLERANCE, "world size 1 against 2")


def test_resuming_a_ddp_trainers_checkpoint_is_refused(checkpoints: tuple[list[dict], dict, str]) -> None:
    for rank, run in enumerate(checkpoints[0]):
        refused = run["from ddp"]
        assert refused.startswith("CheckpointError: ") and "optimizer.pt" in refused, f"rank {rank}: {refused}"
        assert "shardpar/" in refused, refused


# --------------------------------------------------------------------------- TRL


def _sft_runs(directory: str) -> dict:
    from tests.support import trainer_runs as R

    return {
        name: R.sft(name, os.path.join(directory, name)) for name in ("ddp", "stage0", "stage1", "stage2", "stage3")
    }


def test_sft_trainer_through_the_mixin(tmp_path: str) -> None:
    """TRL's ``SFTTrainer`` with ``ShardparTrainer`` mixed in first (tokenising its text
    dataset itself, its own collator, fused LM head and loss) trains as the plain SFTTrainer
    under DDP: 4 steps, each clipped at 0.3 (below every step's norm), at stages 0-3. Stage 0
    is DDP's run bit for bit; at stages 1-3 the norm is torch's to its last bit (see
    ``trainer_runs.sft`` for why the run has weight decay)."""
    for rank, runs in enumerate(run_ranks(_sft_runs, 2, str(tmp_path), timeout=TIMEOUT_S)):
        ddp = runs["ddp"]
        assert ddp["global_step"] == 4 and ddp["wrapped"] == "DistributedDataParallel"
        assert min(ddp["grad_norms"]) > 0.3, "the oracle's steps must all clip"
        for stage in (0, 1, 2, 3):
            ours, what = runs[f"stage{stage}"], f"stage {stage}, rank {rank}"
            tolerance = 0.0 if stage == 0 else TOLERANCE
            assert ours["wrapped"] == "ShardedModule" and ours["global_step"] == 4, what
            _assert_close(ours["losses"], ddp["losses"], tolerance, f"{what}, losses")
            _assert_close(ours["grad_norms"], ddp["grad_norms"], max(tolerance, 1e-6), f"{what}, grad norms")
            assert_params_close(ours["params"], ddp["params"], tolerance, what)
