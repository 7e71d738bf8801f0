"""shardpar's Lightning strategies under Lightning's own ``Trainer`` and ``Fabric``, 2 CPU ranks,
against Lightning's DDP strategy run the same way (the oracle).

The ranks are the harness's (run as torchrun would start them, so Lightning launches no
processes of its own); what they run is ``tests/support/lightning_runs.py``. Importing Lightning takes
seconds, so each launch below serves several tests (module fixtures) and the pytest process
never imports it.

Tolerances: fp32 runs must match DDP within ``TOLERANCE`` (1e-5 relative, the parity
contract of tests/support/parity.py: reductions in another order differ by a few ulps, a wrong scale
or a lost accumulation by far more). Under bf16 the oracle that must match is shardpar's
own bf16 with autocast written by hand, bit for bit; DDP's bf16-mixed keeps float32
parameters where shardpar computes with bfloat16 copies, so it only has to agree to bf16's
precision (``BF16_TOLERANCE``, on the losses).
"""

from __future__ import annotations

import os

import pytest
import torch

from shardpar.checkpoint.format import read_manifest
from shardpar.checkpoint.json_values import decode_tree, encode_tree
from shardpar.errors import CheckpointError
from tests.support.harness import run_ranks
from tests.support.parity import TOLERANCE, assert_params_close, relative_to_oracle

TIMEOUT_S = 300.0  # a launch imports Lightning on each rank (seconds on a loaded machine), then trains
BF16_TOLERANCE = 0.05
FP16_TOLERANCE = 0.01  # float16 keeps 3 more bits than bfloat16


def _assert_losses_close(got: list, want: list, tolerance: float, what: str) -> None:
    assert len(got) == len(want) > 0, f"{what}: {len(got)} losses, the oracle {len(want)}"
    error = relative_to_oracle(torch.tensor(got), torch.tensor(want))
    assert error <= tolerance, f"{what}: losses {got} differ from the oracle's {want} by {error:.2e}"


# --------------------------------------------------------------------------- the Trainer at stages 0-3


def _parity_runs() -> dict:
    from shardpar.integrations.lightning import ShardparPrecision
    from tests.support import lightning_runs as R

    steps = {"accumulate_grad_batches": 2, "gradient_clip_val": 0.05}
    runs = {name: R.fit(name, **steps) for name in ("ddp", "stage0", "stage1", "stage2", "stage3")}
    runs["ddp bf16"] = R.fit("ddp", precision="bf16-mixed", test=False, **steps)
    runs["stage3 bf16"] = R.fit("stage3", precision="bf16-mixed", test=False, **steps)
    runs["stage3 bf16 by hand"] = R.fit(
        "stage3", module_options={"autocast": True}, test=False, strategy_options={"mixed_precision": "bf16"}, **steps
    )
    # Lightning turns precision="16-mixed" into "bf16-mixed" on the CPU; the plugin itself does not
    runs["stage2 fp16"] = R.fit("stage2", plugins=[ShardparPrecision("16-mixed")], test=False, **steps)
    return runs


@pytest.fixture(scope="module")
def parity() -> list[dict]:
    return run_ranks(_parity_runs, 2, timeout=TIMEOUT_S)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_trainer_trains_as_ddp(parity: list[dict], stage: int) -> None:
    """Two epochs of 2 optimizer steps, each accumulating 2 micro-batches (the first under
    ``no_sync``: one synchronising backward per step), clipped by norm (0.05 is below the
    gradients' norm, so every step clips), an LR scheduler per step; then the validation loops
    and ``trainer.test``, which every rank runs (collective at stage 3)."""
    for rank, runs in enumerate(parity):
        ours, ddp = runs[f"stage{stage}"], runs["ddp"]
        what = f"stage {stage}, rank {rank}"
        assert len(ddp["train"]) == 8 and ddp["global_step"] == ours["global_step"] == 4, what
        assert ours["synchronising_backwards"] == 4, f"{what}: accumulation reduced outside the last micro-batch"
        for loop in ("train", "val", "test"):
            _assert_losses_close(ours[loop], ddp[loop], TOLERANCE, f"{what}, {loop} losses")
        assert_params_close(ours["params"], ddp["params"], TOLERANCE, what)
        assert ours["lr"] == pytest.approx(ddp["lr"]) and ours["lr"] != [0.02, 0.02], what


def test_bf16_mixed_is_shardpar_bf16_under_autocast(parity: list[dict]) -> None:
    """``precision="bf16-mixed"`` trains exactly as ``mixed_precision="bf16"`` with the step
    under bf16 autocast: bfloat16 compute copies, float32 masters (what the checkpoint and
    ``full_state_dict`` hold) and float32 losses. Against DDP's bf16-mixed only the losses are
    compared: DDP keeps float32 weights and targets where shardpar rounds both to bfloat16, and
    Adam turns such differences in near-zero gradients into whole steps of a few weights."""
    for rank, runs in enumerate(parity):
        ours, by_hand, ddp = runs["stage3 bf16"], runs["stage3 bf16 by hand"], runs["ddp bf16"]
        assert ours["compute_dtypes"] == ["torch.bfloat16"], ours["compute_dtypes"]
        assert ddp["compute_dtypes"] == ["torch.float32"], ddp["compute_dtypes"]  # autocast only
        assert ours["train"] == by_hand["train"], f"rank {rank}"
        assert_params_close(ours["params"], by_hand["params"], 0.0, f"rank {rank}, against shardpar by hand")
        _assert_losses_close(ours["train"], ddp["train"], BF16_TOLERANCE, f"rank {rank}, against DDP bf16-mixed")
        # Far from fp32 training: the runs above really computed in bf16.
        assert relative_to_oracle(torch.tensor(ours["train"]), torch.tensor(runs["stage3"]["train"])) > 1e-4


def test_16_mixed_scales_the_loss_with_shardpars_scaler(parity: list[dict]) -> None:
    """``precision="16-mixed"``: float16 compute, and ``shardpar.GradScaler`` (agreeing on
    overflow across ranks) scales every step, none skipped, its state Lightning's to save."""
    for rank, runs in enumerate(parity):
        ours = runs["stage2 fp16"]
        assert ours["compute_dtypes"] == ["torch.float16"], ours["compute_dtypes"]
        assert ours["precision_state"] == {
            "scale": 2.0**16,
            "growth_factor": 2.0,
            "backoff_factor": 0.5,
            "growth_interval": 2000,
            "growth_tracker": 4,
        }, f"rank {rank}"
        _assert_losses_close(ours["train"], runs["stage2"]["train"], FP16_TOLERANCE, f"rank {rank}, against fp32")


# --------------------------------------------------------------------------- checkpoints and resumption


def _checkpoint_runs(directory: str, pickle_file: str) -> dict:
    from tests.support import lightning_runs as R

    built_late = {"build_in_configure_model": True}
    saved = R.fit("stage2", module_options=built_late, max_epochs=1, checkpoint_dir=directory, test=False)
    checkpoint = os.path.join(directory, next(n for n in saved["checkpoints"] if n.endswith(".ckpt")))
    resumed_dir = os.path.join(directory, "resumed")
    resumed = R.fit("stage3", module_options=built_late, ckpt_path=checkpoint, checkpoint_dir=resumed_dir)
    final = os.path.join(resumed_dir, next(n for n in resumed["checkpoints"] if n.endswith(".ckpt")))
    return {
        "ddp": R.fit("ddp", module_options=built_late),
        "saved": saved,
        "checkpoint": checkpoint,
        "resumed": resumed,
        "tested": R.test_only("stage1", final, module_options=built_late),
        "refusals": R.refusals(directory, pickle_file),
    }


def _resume_alone(checkpoint: str) -> dict:
    from tests.support import lightning_runs as R

    return R.fit(
        "stage0",
        devices=1,
        batch=2 * R.BATCH,
        module_options={"build_in_configure_model": True},
        ckpt_path=checkpoint,
        test=False,
    )


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], dict]:
    directory = tmp_path_factory.mktemp("lightning-checkpoints")
    pickle_file = tmp_path_factory.mktemp("ddp-checkpoint") / "epoch=0-step=4.ckpt"
    pickle_file.write_bytes(b"a Lightning checkpoint of strategy='ddp' is a pickle")
    runs = run_ranks(_checkpoint_runs, 2, str(directory), str(pickle_file), timeout=TIMEOUT_S)
    alone = run_ranks(_resume_alone, 1, runs[0]["checkpoint"], timeout=TIMEOUT_S)[0]
    return runs, alone


def test_configure_model_runs_on_meta_and_starts_as_ddp(checkpoints: tuple[list[dict], dict]) -> None:
    """``configure_model`` builds on the meta device (nothing allocated until the wrap), and
    the wrap initialises as the same seed does on the CPU under DDP: the first epoch's losses
    are DDP's."""
    runs, _ = checkpoints
    for rank, run in enumerate(runs):
        assert run["saved"]["built_on"] == "meta" and run["ddp"]["built_on"] == "cpu", f"rank {rank}"
        _assert_losses_close(run["saved"]["train"], run["ddp"]["train"][:4], TOLERANCE, f"rank {rank}, epoch 1")


def test_checkpoint_is_a_shardpar_directory_with_lightnings_state(checkpoints: tuple[list[dict], dict]) -> None:
    """What ``ModelCheckpoint`` wrote: a shardpar checkpoint (JSON manifest, one safetensors
    file per rank, no pickle), Lightning's state in the manifest."""
    path = checkpoints[0][0]["checkpoint"]
    assert sorted(os.listdir(path)) == [
        "rank-00000-of-00002.safetensors",
        "rank-00001-of-00002.safetensors",
        "shardpar.json",
    ]
    manifest = read_manifest(path)
    assert (manifest.stage, manifest.world_size) == (2, 2) and manifest.optimizer is not None
    state = decode_tree(manifest.extra["lightning"])
    assert (state["epoch"], state["global_step"]) == (0, 4)
    assert state["lr_schedulers"][0]["last_epoch"] == 4
    assert state["loops"]["fit_loop"]["epoch_loop.state_dict"]["_batches_that_stepped"] == 4
    assert any(key.startswith("ModelCheckpoint") for key in state["callbacks"])
    assert "state_dict" not in state and "optimizer_states" not in state  # those are the tensors


def test_resume_at_another_stage_continues_as_ddp(checkpoints: tuple[list[dict], dict]) -> None:
    """Saved at stage 2 after epoch 1, resumed at stage 3 (``ckpt_path=``): epoch 2, its
    validation and the test loop are DDP's, and Lightning's loop, step counter and scheduler
    continue from the checkpoint. The checkpoint it writes then, given to ``trainer.test`` of
    a fresh module at stage 1, tests as DDP's model."""
    runs, _ = checkpoints
    for rank, run in enumerate(runs):
        resumed, ddp = run["resumed"], run["ddp"]
        what = f"rank {rank}"
        assert resumed["global_step"] == ddp["global_step"] == 8, what
        _assert_losses_close(resumed["train"], ddp["train"][4:], TOLERANCE, f"{what}, epoch 2")
        _assert_losses_close(resumed["val"], ddp["val"][4:], TOLERANCE, f"{what}, epoch 2 validation")
        _assert_losses_close(resumed["test"], ddp["test"], TOLERANCE, f"{what}, test")
        assert_params_close(resumed["params"], ddp["params"], TOLERANCE, what)
        assert resumed["lr"] == pytest.approx(ddp["lr"]), what
        # its last checkpoint, tested by a fresh Trainer at stage 1: the weights load alone
        _assert_losses_close(run["tested"], ddp["test"], TOLERANCE, f"{what}, trainer.test(ckpt_path=...)")


def test_resume_at_another_world_size(checkpoints: tuple[list[dict], dict]) -> None:
    """The same checkpoint resumed by one process at stage 0 (twice the batch: the same rows
    per step) ends where DDP on 2 ranks does."""
    runs, alone = checkpoints
    ddp = runs[0]["ddp"]
    assert alone["global_step"] == 8
    assert_params_close(alone["params"], ddp["params"], TOLERANCE, "world size 1, stage 0")
    assert alone["lr"] == pytest.approx(ddp["lr"])


def test_refusals_name_the_problem_on_every_rank(checkpoints: tuple[list[dict], dict]) -> None:
    runs, _ = checkpoints
    for rank, run in enumerate(runs):
        refused = run["refusals"]
        assert refused["unstorable"].startswith("TypeError: ") and "hyper_parameters" in refused["unstorable"], rank
        assert "JSON" in refused["unstorable"] and "object" in refused["unstorable"], rank
        assert refused["unstorable_left"] == [], rank  # refused before anything was written
        assert refused["pickle"].startswith("CheckpointError: ") and "is a file" in refused["pickle"], rank
        assert "one optimizer" in refused["two_optimizers"] and "returned 2" in refused["two_optimizers"], rank
        assert refused["unknown_option"].startswith("TypeError: ") and "bucket_cap" in refused["unknown_option"]
        assert refused["bad_stage"].startswith("ValueError: stage must be 0, 1, 2 or 3")
        assert refused["plugin"].startswith("TypeError: ") and "_OwnPrecision" in refused["plugin"], rank


# --------------------------------------------------------------------------- Fabric


def _fabric_runs(directory: str) -> dict:
    from tests.support import lightning_runs as R

    checkpoint = os.path.join(directory, "fabric-step-2")
    return {
        "ddp": R.fabric_train("ddp"),
        "stage3": R.fabric_train("stage3", save_to=checkpoint),
        "resumed at stage 1": R.fabric_train("stage1", resume_from=checkpoint),
    }


@pytest.fixture(scope="module")
def fabric(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return run_ranks(_fabric_runs, 2, str(tmp_path_factory.mktemp("fabric")), timeout=TIMEOUT_S)


def test_fabric_trains_as_ddp_and_resumes_at_another_stage(fabric: list[dict]) -> None:
    """A Fabric loop (``fabric.setup`` with a scheduler, ``no_backward_sync`` accumulation,
    ``fabric.clip_gradients`` by value, ``fabric.save``/``fabric.load``) at stage 3 as under
    Fabric's DDP; resumed at stage 1 from its step-2 checkpoint, the last two steps too."""
    for rank, runs in enumerate(fabric):
        ddp, ours, resumed = runs["ddp"], runs["stage3"], runs["resumed at stage 1"]
        what = f"rank {rank}"
        _assert_losses_close(ours["train"], ddp["train"], TOLERANCE, what)
        assert_params_close(ours["params"], ddp["params"], TOLERANCE, what)
        _assert_losses_close(resumed["train"], ddp["train"][4:], TOLERANCE, f"{what}, resumed")
        assert_params_close(resumed["params"], ddp["params"], TOLERANCE, f"{what}, resumed")
        assert resumed["lr"] == pytest.approx(ddp["lr"]) and resumed["remainder"] == {}, what
        assert (ours["synchronising_backwards"], resumed["synchronising_backwards"]) == (4, 2), what


# --------------------------------------------------------------------------- the JSON the state travels in


def test_typed_json_tree_round_trip_and_refusals() -> None:
    """[Note: typed JSON trees]: what Lightning's state holds comes back with its types; a
    user's dict that looks like a tag stays a dict; objects and tensors of many values are
    refused, naming where they sit; a malformed tree is a CheckpointError."""
    state = {
        "epoch": 3,
        "best": torch.tensor(0.25),
        "kth": torch.tensor(float("inf")),
        "betas": (0.9, 0.95),
        "by_index": {0: "a", 1: [None, True]},
        "nan": float("nan"),
        "lookalike": {"tensor": 1, "dtype": "x"},
    }
    back = decode_tree(encode_tree(state, "checkpoint"))
    assert back["epoch"] == 3 and back["betas"] == (0.9, 0.95) and back["by_index"] == {0: "a", 1: [None, True]}
    assert back["best"].dtype == torch.float32 and back["best"].item() == 0.25 and back["kth"].item() == float("inf")
    assert back["nan"] != back["nan"] and back["lookalike"] == {"tensor": 1, "dtype": "x"}
    with pytest.raises(TypeError, match=r"checkpoint\['callbacks'\]\['EMA'\]\['weights'\] is a tensor of shape \[4\]"):
        encode_tree({"callbacks": {"EMA": {"weights": torch.zeros(4)}}}, "checkpoint")
    with pytest.raises(TypeError, match=r"checkpoint\['hyper_parameters'\] is a object"):
        encode_tree({"hyper_parameters": object()}, "checkpoint")
    for malformed in ({"dict": [1]}, {"tuple": 1}, {"items": [[1]]}, {"dict": {}, "tuple": []}, {"items": [[[1], 2]]}):
        with pytest.raises(CheckpointError):
            decode_tree(malformed)
