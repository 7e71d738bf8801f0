"""tools/consolidate.py, reshard.py and inspect_ckpt.py end to end, as a user runs them
(``python tools/x.py ...`` in a subprocess): outputs, exit codes, one-line errors.

Every tool run imports torch (seconds), so all runs are started together by one fixture and
run in parallel; each test then checks the outcome of its own runs.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import shardpar
from shardpar.checkpoint.format import read_manifest
from shardpar.checkpoint.offline import consolidate
from tests.support.checkpoint_helpers import K, assert_equal_states, build, full_optimizer_state, save_run
from tests.support.models import KITCHEN
from tests.support.parity import run

ROOT = Path(__file__).resolve().parent.parent
TOOLS = ROOT / "tools"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("tools")
    ckpt = tmp / "ckpt" / "step-2"
    saved = run(save_run, 2, 3, str(ckpt))[0]  # stage 3 at 2 ranks
    corrupted = tmp / "corrupted"
    shutil.copytree(ckpt, corrupted)
    bad = corrupted / "rank-00001-of-00002.safetensors"
    data = bytearray(bad.read_bytes())
    data[-3] ^= 0x10
    bad.write_bytes(bytes(data))

    commands = {
        # Each of these imports torch (seconds); they run in parallel.
        "consolidate": ["consolidate.py", ckpt, tmp / "hf", "--max-shard-size", "0.2KB"],
        "reshard": ["reshard.py", ckpt, tmp / "resharded", "--world-size", "3", "--stage", "1"],
        "inspect": ["inspect_ckpt.py", ckpt, "--verify"],
        "inspect-corrupted": ["inspect_ckpt.py", corrupted, "--verify"],
        # Usage errors are answered before torch is imported.
        "consolidate-bad-dtype": ["consolidate.py", ckpt, tmp / "out", "--dtype", "int3"],
        "reshard-usage": ["reshard.py", ckpt, tmp / "x"],
        "inspect-usage": ["inspect_ckpt.py"],
    }
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = {
        name: subprocess.Popen(
            [sys.executable, str(TOOLS / args[0]), *map(str, args[1:])],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, args in commands.items()
    }
    results = {}
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=180)
        results[name] = subprocess.CompletedProcess(commands[name], proc.returncode, stdout, stderr)
    return {"tmp": tmp, "ckpt": ckpt, "saved": saved, "results": results}


def error_lines(result: subprocess.CompletedProcess) -> list[str]:
    return [line for line in result.stderr.split("\n") if line.strip()]


def ok(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, f"{result.args}: exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    return result


def plain_model_from(tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
    """Load HF-layout tensors into the plain model the way transformers does for tied weights."""
    plain = KITCHEN.build()
    incompatible = plain.load_state_dict(tensors, strict=False)
    assert incompatible.missing_keys == ["head.weight"] and incompatible.unexpected_keys == []
    plain.load_state_dict({**tensors, "head.weight": tensors["emb.weight"]}, strict=True)
    return plain


def test_consolidate_output_loads_into_the_plain_model(runs: dict) -> None:
    result = ok(runs["results"]["consolidate"])
    out = runs["tmp"] / "hf"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files[-1] == f"model-{len(files):05d}-of-{len(files):05d}.safetensors"
    assert sorted(os.listdir(out)) == sorted(files + ["model.safetensors.index.json"])
    assert f"wrote {len(files)} file(s)" in result.stdout
    tensors = {}
    for file in files:
        part = load_file(str(out / file))
        assert all(index["weight_map"][name] == file for name in part)
        tensors.update(part)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    expected = runs["saved"]["model"]
    assert set(tensors) == set(expected) - {"head.weight"}, "tied weight once, under its first name"
    plain = plain_model_from(tensors)
    for name, tensor in plain.state_dict().items():
        assert torch.equal(tensor, expected[name]), name

    reference = KITCHEN.build()
    reference.load_state_dict(expected)
    tokens, _ = KITCHEN.build().example(5, torch.Generator().manual_seed(3))
    assert torch.equal(plain(tokens), reference(tokens)), "same weights, same outputs"


def test_consolidate_casts_to_one_file(runs: dict, tmp_path: Path) -> None:
    """The same function the tool runs, in this process: one file, bf16, format pt."""
    files = consolidate(runs["ckpt"], tmp_path, dtype="bf16", progress=False)
    assert files == ["model.safetensors"] and sorted(os.listdir(tmp_path)) == files
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}
    tensors = load_file(str(tmp_path / "model.safetensors"))
    for name, tensor in tensors.items():
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, runs["saved"]["model"][name].bfloat16()), name


def test_reshard_output_loads_at_the_new_world_size_with_optimizer_state(runs: dict) -> None:
    ok(runs["results"]["reshard"])
    out = runs["tmp"] / "resharded"
    manifest = read_manifest(out)
    assert (manifest.world_size, manifest.stage) == (3, 1)
    assert sorted(manifest.files) == [f"rank-0000{r}-of-00003.safetensors" for r in range(3)]
    sizes = [manifest.files[f].bytes for f in sorted(manifest.files)]
    assert max(sizes) < 0.6 * sum(sizes), f"rank files should share the data: {sizes}"
    assert manifest.extra == {"step": K, "note": "resume me"}
    _, model, opt = build(stage=2, seed=4)  # world size 1, yet another stage
    assert shardpar.load_checkpoint(out, model, opt)["step"] == K
    assert_equal_states(model.full_state_dict(), runs["saved"]["model"], "model")
    assert_equal_states(full_optimizer_state(opt), runs["saved"]["optimizer"], "optimizer")


def test_inspect_prints_a_summary_and_verifies(runs: dict) -> None:
    result = ok(runs["results"]["inspect"])
    text = result.stdout
    for expected in (
        "stage            3",
        "world size       2",
        "files            2,",
        "param tensors    7,",
        "torch.optim.adamw.AdamW",
        "exp_avg",
        '"note": "resume me"',
        "verify: OK",
    ):
        assert expected in text, f"{expected!r} not in:\n{text}"


def test_inspect_verify_reports_a_corrupted_file(runs: dict) -> None:
    result = runs["results"]["inspect-corrupted"]
    assert result.returncode == 1
    lines = error_lines(result)
    assert len(lines) == 1 and lines[0].startswith("error: checksum mismatch"), result.stderr
    assert "rank-00001-of-00002.safetensors" in lines[0]


@pytest.mark.parametrize(
    "name, code, message",
    [
        ("consolidate-bad-dtype", 2, "error: argument --dtype: invalid choice: 'int3'"),
        ("reshard-usage", 2, "error: the following arguments are required: --world-size"),
        ("inspect-usage", 2, "error: the following arguments are required: ckpt_dir"),
    ],
)
def test_bad_input_exits_non_zero_with_one_line(runs: dict, name: str, code: int, message: str) -> None:
    result = runs["results"][name]
    assert result.returncode == code, result.stderr
    lines = error_lines(result)
    assert len(lines) == 1 and lines[0].startswith(message), result.stderr
