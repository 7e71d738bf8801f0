"""recipes/finetune_hf.py end to end: a tiny Hugging Face Llama written by the recipe's own
helper is fine-tuned at world size 2 (stage 3, built on the meta device: the full model never
exists on a rank; weights in five safetensors shards plus an index) and at world size 1 (stage 0,
one model.safetensors), launched as a user launches it.

The proof that the weights were loaded rather than initialised: the loss the recipe prints at
step 0 equals, to rounding, the loss that ``transformers.AutoModelForCausalLM.from_pretrained``
gives on the same first batch in this process. The "pretrained" model is briefly trained by
``write_tiny_pretrained``, so its loss is far from what any fresh initialisation gives.

Every run imports torch and transformers (seconds), so all of them start together from one
module fixture, in threads; each test waits for the runs it reads.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import shardpar
from recipes.data import VOCAB_SIZE, load_dataset
from recipes.finetune_hf import write_tiny_pretrained
from recipes.hf_llama import HFCausalLM
from tests.support.harness import CPU_ONLY_ENV, run_script

ROOT = Path(__file__).resolve().parent.parent
PYTHON = [sys.executable]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
STEPS, BATCH, BLOCK, SEED = 6, 16, 64, 1337
FLAGS = [
    "--steps",
    str(STEPS),
    "--batch-size",
    str(BATCH),
    "--block-size",
    str(BLOCK),
    "--seed",
    str(SEED),
    "--log-every",
    "1",
    "--export",
]
ENV = {"OMP_NUM_THREADS": "1", **CPU_ONLY_ENV}  # the ranks share 2 cores; CPU/gloo even with GPUs
TIMEOUT_S = 180.0  # per run; generous because all runs share a loaded machine

STEP_LOSS = re.compile(r"^step (?P<step>\d+): loss (?P<loss>\S+) ", re.MULTILINE)
SUMMARY = re.compile(
    r"^done: (?P<steps>\d+) steps, world (?P<world>\d+), stage (?P<stage>\d) \| "
    r"train loss (?P<first>\S+) -> (?P<last>\S+) \|",
    re.MULTILINE,
)

# name -> (launcher, world size, stage, the pretrained directory's layout)
RUNS = {"ws2-stage3": (TORCHRUN, 2, 3, "sharded"), "ws1-stage0": (PYTHON, 1, 0, "single")}


def recipe(launcher: list[str], *args: str | Path) -> subprocess.CompletedProcess[str]:
    return run_script([*launcher, "-m", "recipes.finetune_hf", *map(str, args)], TIMEOUT_S, env=ENV, cwd=ROOT)


def without(pretrained: Path, key: str, out: Path) -> Path:
    """A copy of ``pretrained`` whose weights lack ``key``."""
    shutil.copytree(pretrained, out)
    tensors = load_file(out / "model.safetensors")
    del tensors[key]
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


class Runs:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        single = write_tiny_pretrained(tmp / "pretrained")
        sharded = tmp / "pretrained-sharded"  # the same weights, as transformers shards them
        transformers.AutoModelForCausalLM.from_pretrained(single).save_pretrained(sharded, max_shard_size="100KB")
        index = json.loads((sharded / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 1, index
        self.pretrained = {"single": single, "sharded": sharded}
        self.pool = ThreadPoolExecutor(max_workers=len(RUNS) + 1, thread_name_prefix="finetune-run")
        self.futures: dict[str, Future] = {
            name: self.pool.submit(
                recipe,
                launcher,
                "--pretrained",
                self.pretrained[layout],
                "--out",
                self.out(name),
                "--stage",
                str(stage),
                *FLAGS,
            )
            for name, (launcher, _, stage, layout) in RUNS.items()
        }
        lacking = without(single, "model.norm.weight", tmp / "lacking")
        self.futures["missing"] = self.pool.submit(
            recipe, PYTHON, "--pretrained", lacking, "--out", self.out("missing"), "--steps", "1"
        )

    def out(self, name: str) -> Path:
        return self.tmp / f"{name}-out"

    def get(self, name: str) -> subprocess.CompletedProcess[str]:
        return self.futures[name].result()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory):
    runs = Runs(tmp_path_factory.mktemp("finetune"))
    yield runs
    runs.pool.shutdown(wait=True)  # each run ends by itself or at its timeout, group killed


@pytest.fixture(scope="module")
def first_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """The recipe's step-0 global batch, as one process reads it."""
    return load_dataset().get_batch(0, BATCH, BLOCK, rank=0, world_size=1, seed=SEED)


def loss_of(directory: Path, batch: tuple[torch.Tensor, torch.Tensor]) -> float:
    """The loss of the Hugging Face model in ``directory`` on ``batch``, loaded by transformers itself."""
    model, info = transformers.AutoModelForCausalLM.from_pretrained(directory, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        return HFCausalLM(model.float())(*batch)[1].item()


def output(result: subprocess.CompletedProcess[str]) -> str:
    return (
        f"$ {' '.join(map(str, result.args))}\nexit {result.returncode}\n--- stdout ---\n{result.stdout}\n"
        f"--- stderr ---\n{result.stderr}"
    )


def finetuned(result: subprocess.CompletedProcess[str], world: int, stage: int) -> dict[int, float]:
    """Exit 0, rank 0's report of a complete load, one loss line per step and one summary;
    returns the losses by step."""
    assert result.returncode == 0, output(result)
    assert "Traceback" not in result.stdout + result.stderr, output(result)
    loads = [line for line in result.stdout.splitlines() if line.startswith("loaded ")]
    assert len(loads) == 1 and loads[0].endswith(": missing keys [], unexpected keys []"), output(result)
    losses = {int(m["step"]): float(m["loss"]) for m in STEP_LOSS.finditer(result.stdout)}
    assert sorted(losses) == list(range(STEPS)) and len(STEP_LOSS.findall(result.stdout)) == STEPS, output(result)
    summaries = SUMMARY.findall(result.stdout)
    assert len(summaries) == 1, "one summary line, from rank 0:\n" + output(result)
    assert summaries[0][:3] == (str(STEPS), str(world), str(stage)), summaries[0]
    return losses


@pytest.mark.parametrize("name", list(RUNS))
def test_finetune_starts_from_the_pretrained_weights_and_lowers_the_loss(
    runs: Runs, first_batch: tuple[torch.Tensor, torch.Tensor], name: str
) -> None:
    _, world, stage, layout = RUNS[name]
    losses = finetuned(runs.get(name), world, stage)
    pretrained_loss = loss_of(runs.pretrained[layout], first_batch)
    # The pretrained model is not a fresh initialisation (whose loss is about uniform's, ln 96).
    assert pretrained_loss < math.log(VOCAB_SIZE) - 0.3, pretrained_loss
    # Six decimals printed; the ranks' mean of half-batch means differs from the whole-batch mean
    # only by float rounding.
    assert abs(losses[0] - pretrained_loss) < 1e-5, (losses[0], pretrained_loss)
    assert losses[STEPS - 1] < losses[0] - 0.2, losses

    out = runs.out(name)
    assert shardpar.latest_checkpoint(out) == out / f"step-{STEPS:08d}"
    manifest = json.loads((out / f"step-{STEPS:08d}" / "shardpar.json").read_text())
    assert (manifest["world_size"], manifest["stage"], manifest["extra"]) == (world, stage, {"step": STEPS})
    # The export holds the fine-tuned weights: better than the pretrained ones on the batch trained on.
    assert loss_of(out / "hf", first_batch) < pretrained_loss - 0.1


def test_world_sizes_and_stages_fine_tune_alike(runs: Runs) -> None:
    """Every step's global batch is the same at any world size, so both runs train the same
    model up to float rounding: the same losses and the same exported weights."""
    two = finetuned(runs.get("ws2-stage3"), world=2, stage=3)
    one = finetuned(runs.get("ws1-stage0"), world=1, stage=0)
    for step in range(STEPS):
        assert abs(two[step] - one[step]) < 1e-4, (step, two, one)
    a = load_file(runs.out("ws2-stage3") / "hf" / "model.safetensors")
    b = load_file(runs.out("ws1-stage0") / "hf" / "model.safetensors")
    assert sorted(a) == sorted(b)
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-5, msg=lambda m, key=key: f"{key}: {m}")


def test_missing_keys_are_one_error_line(runs: Runs) -> None:
    result = runs.get("missing")
    assert result.returncode == 2, output(result)
    assert "Traceback" not in result.stdout + result.stderr, output(result)
    assert "missing keys ['model.norm.weight'], unexpected keys []" in result.stdout, output(result)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "model.norm.weight" in errors[0] and "--allow-missing" in errors[0], output(result)
    assert not runs.out("missing").exists(), "nothing is trained or saved after a failed load"
