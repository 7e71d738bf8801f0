"""Sharded checkpoints (issue 5): resume at another world size and stage, the files on disk,
``latest``, and the Hugging Face full export. Errors: test_checkpoint_errors.py; crash
safety and memory: test_checkpoint_crash.py; tools: test_checkpoint_tools.py.

World size 1 runs in this process; larger ones on harness ranks (tests.support.parity.run).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import load_file

import shardpar
from tests.support.checkpoint_helpers import (
    RECIPE,
    K,
    assert_equal_states,
    build,
    load_run,
    save_full_run,
    save_run,
)
from tests.support.models import KITCHEN
from tests.support.parity import reference, rel_error, run

RESUME_TOLERANCE = 1e-6
"""Relative error (``max|a-b| / max|b|``) allowed against 2K uninterrupted plain-torch steps.
A resumed run does the same arithmetic as an uninterrupted one except for the sum order of
gradient reductions at a different world size, a few ulps per step; a lost optimizer state,
step count or group hyperparameter shows at 1e-3 or more."""

# (stage, world size) saved -> (stage, world size) loaded
PAIRS = [
    ((3, 2), (1, 3)),
    ((0, 4), (3, 2)),
    ((2, 3), (0, 1)),
    ((1, 1), (2, 4)),
    ((3, 3), (3, 2)),
]


@pytest.mark.parametrize("saved, loaded", PAIRS, ids=[f"s{a}n{b}-to-s{c}n{d}" for (a, b), (c, d) in PAIRS])
def test_resume_at_another_world_size_and_stage(
    tmp_path: Path, saved: tuple[int, int], loaded: tuple[int, int]
) -> None:
    (save_stage, save_world), (load_stage, load_world) = saved, loaded
    path = str(tmp_path / "ckpt" / "step-2")
    before = run(save_run, save_world, save_stage, path)[0]
    after = run(load_run, load_world, load_stage, path)
    for rank, result in enumerate(after):
        # Exactly what was saved, on every rank: parameters, buffers, optimizer state (full
        # exp_avg/exp_avg_sq, step), group hyperparameters, extra.
        assert_equal_states(result["model"], before["model"], f"model after load, rank {rank}")
        assert_equal_states(result["optimizer"], before["optimizer"], f"optimizer after load, rank {rank}")
        assert result["extra"] == {"step": K, "note": "resume me"}
        assert_equal_states(result["final"], after[0]["final"], f"rank {rank} vs rank 0 after training on")
    expected = reference(RECIPE.with_(steps=2 * K)).state
    errors = {name: rel_error(after[0]["final"][name], tensor) for name, tensor in expected.items()}
    assert max(errors.values()) <= RESUME_TOLERANCE, errors


# (stage, world size, align_for_bandwidth) saved -> the same loaded
ALIGNMENT_PAIRS = [
    ((2, 2, True), (2, 2, False)),
    ((0, 2, False), (0, 2, True)),
    ((3, 3, True), (1, 2, False)),
    ((1, 3, False), (3, 2, True)),
]


@pytest.mark.parametrize(
    "saved, loaded",
    ALIGNMENT_PAIRS,
    ids=[f"s{a}n{b}{'a' if c else 'd'}-to-s{d}n{e}{'a' if f else 'd'}" for (a, b, c), (d, e, f) in ALIGNMENT_PAIRS],
)
def test_resume_across_aligned_and_dense_layouts(
    tmp_path: Path, saved: tuple[int, int, bool], loaded: tuple[int, int, bool]
) -> None:
    """A checkpoint is in param space, so where the buffers put parameters (dense, or aligned
    for NCCL with ``align_for_bandwidth``) does not matter: one saved aligned loads dense and
    the other way round (same stage and world size, and across both), exactly, and trains on
    like 2K uninterrupted plain-torch steps. The two layouts really differ (padding)."""
    (save_stage, save_world, save_aligned), (load_stage, load_world, load_aligned) = saved, loaded
    path = str(tmp_path / "ckpt" / "step-2")
    before = run(save_run, save_world, save_stage, path, options={"align_for_bandwidth": save_aligned})[0]
    after = run(load_run, load_world, load_stage, path, options={"align_for_bandwidth": load_aligned})
    for rank, result in enumerate(after):
        assert_equal_states(result["model"], before["model"], f"model after load, rank {rank}")
        assert_equal_states(result["optimizer"], before["optimizer"], f"optimizer after load, rank {rank}")
        assert_equal_states(result["final"], after[0]["final"], f"rank {rank} vs rank 0 after training on")
    expected = reference(RECIPE.with_(steps=2 * K)).state
    errors = {name: rel_error(after[0]["final"][name], tensor) for name, tensor in expected.items()}
    assert max(errors.values()) <= RESUME_TOLERANCE, errors
    manifest = json.loads((Path(path) / "shardpar.json").read_text())
    if save_stage < 3:  # the manifest records the buckets (information only)
        paddings = [b["padding"] for b in manifest["layout"]["buckets"]]
        assert all(p < save_world for p in paddings) != save_aligned, paddings


def test_files_are_plain_safetensors_and_the_manifest_says_where_everything_is(tmp_path: Path) -> None:
    path = tmp_path / "ckpt" / "step-2"
    run(save_run, 2, 1, str(path))
    names = sorted(os.listdir(path))
    assert names == ["rank-00000-of-00002.safetensors", "rank-00001-of-00002.safetensors", "shardpar.json"]
    manifest = json.loads((path / "shardpar.json").read_text())
    assert manifest["format_version"] == 1 and manifest["stage"] == 1 and manifest["world_size"] == 2
    assert manifest["torch_version"] == torch.__version__
    assert manifest["aliases"] == {"head.weight": "emb.weight"}
    kinds = {name: entry["kind"] for name, entry in manifest["tensors"].items()}
    assert kinds["frozen_bias"] == "frozen" and kinds["scale"] == "buffer" and kinds["emb.weight"] == "param"
    assert "mask" not in kinds and "head.weight" not in kinds  # non-persistent buffer; alias
    optimizer = manifest["optimizer"]
    assert optimizer["class"] == "torch.optim.adamw.AdamW"
    groups = optimizer["param_groups"]
    assert [g["hyperparameters"]["lr"] for g in groups] == [RECIPE.lr, RECIPE.lr / 2]
    assert groups[0]["hyperparameters"]["betas"] == [0.9, 0.999]
    assert "emb.weight" in groups[0]["params"] and "body.bias" in groups[1]["params"]
    assert optimizer["scalar_state"]["emb.weight"]["step"]["tensor"] == K
    assert set(optimizer["state"]["emb.weight"]) == {"exp_avg", "exp_avg_sq"}
    assert manifest["extra"] == {"step": K, "note": "resume me"}

    stored = {}
    for name, record in manifest["files"].items():
        data = (path / name).read_bytes()
        assert record["bytes"] == len(data) and record["sha256"] == hashlib.sha256(data).hexdigest()
        with safe_open(str(path / name), "pt") as f:  # readable by the reference implementation
            assert f.metadata()["format"] == "pt"
        stored[name] = load_file(str(path / name))
    for entry in manifest["tensors"].values():  # the pieces really hold the tensor
        if entry["kind"] == "buffer":
            piece = entry["pieces"][0]
            assert torch.equal(stored[piece["file"]][piece["key"]], KITCHEN.build().scale)
        covered = sorted((p["start"], p["end"]) for p in entry["pieces"])
        assert covered[0][0] == 0 and covered[-1][1] == torch.Size(entry["shape"]).numel()
    files_of = {p["file"] for e in manifest["tensors"].values() for p in e["pieces"] if e["kind"] == "param"}
    assert len(files_of) == 2, "both ranks write parameter pieces (in parallel)"


def test_latest_pointer_follows_saves_and_falls_back_to_the_newest_valid(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    assert shardpar.latest_checkpoint(root) is None
    module, model, opt = build(stage=0)
    for step in (1, 2):
        shardpar.save_checkpoint(root / f"step-{step}", model, opt, extra={"step": step})
        assert (root / "latest").read_text().strip() == f"step-{step}"
        assert shardpar.latest_checkpoint(root) == root / f"step-{step}"
    (root / "step-2" / "shardpar.json").write_text("{ not json")  # latest is no longer valid
    (root / ".step-3.tmp-0123456789ab").mkdir()  # an interrupted save: never a candidate
    assert shardpar.latest_checkpoint(root) == root / "step-1"
    (root / "latest").write_text("../elsewhere\n")
    assert shardpar.latest_checkpoint(root) == root / "step-1"
    assert not [p for p in root.iterdir() if p.name.startswith(".latest")]


def test_saving_over_a_checkpoint_replaces_it_completely(tmp_path: Path) -> None:
    path = tmp_path / "ckpt" / "run"
    run(save_run, 2, 3, str(path))  # 2 files
    run(save_run, 1, 0, str(path), 1)  # 1 file, one step
    assert sorted(os.listdir(path)) == ["rank-00000-of-00001.safetensors", "shardpar.json"]
    assert sorted(os.listdir(path.parent)) == ["latest", "run"], "no temporary directory left behind"
    module, model, opt = build(stage=0, seed=3)
    assert shardpar.load_checkpoint(path, model, opt)["step"] == 1


@pytest.mark.parametrize("stage, world_size", [(3, 2), (1, 2), (0, 1)])
def test_save_full_writes_the_hugging_face_layout(tmp_path: Path, stage: int, world_size: int) -> None:
    out = tmp_path / "hf"
    results = run(save_full_run, world_size, stage, str(out), "5GB", None)
    assert all(r["files"] == ["model.safetensors"] for r in results)
    assert sorted(os.listdir(out)) == ["model.safetensors"]
    expected = results[0]["state"]
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}
    tensors = load_file(str(out / "model.safetensors"))
    assert set(tensors) == set(expected) - {"head.weight"}, "tied weight written once, under its first name"

    plain = KITCHEN.build()  # how Hugging Face restores tied copies: load, then the tie holds
    incompatible = plain.load_state_dict(tensors, strict=False)
    assert incompatible.missing_keys == ["head.weight"] and incompatible.unexpected_keys == []
    assert plain.head.weight is plain.emb.weight
    plain.load_state_dict({**tensors, "head.weight": tensors["emb.weight"]}, strict=True)
    for name, tensor in plain.state_dict().items():
        assert torch.equal(tensor, expected[name]), name


def test_save_full_shards_by_size_and_casts(tmp_path: Path) -> None:
    out = tmp_path / "hf"
    results = run(save_full_run, 2, 3, str(out), "200B", "bf16")
    files = results[0]["files"]
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    expected = results[0]["state"]
    assert set(index["weight_map"]) == set(expected) - {"head.weight"}
    assert set(index["weight_map"].values()) == set(files)
    total = 0
    for file in files:
        with safe_open(str(out / file), "pt") as f:
            assert f.metadata() == {"format": "pt"}
            for key in f.keys():
                assert index["weight_map"][key] == file
                tensor = f.get_tensor(key)
                assert tensor.dtype == torch.bfloat16
                assert torch.equal(tensor, expected[key].to(torch.bfloat16)), key
                total += tensor.numel() * tensor.element_size()
    assert index["metadata"]["total_size"] == total
    with safe_open(str(out / index["weight_map"]["emb.weight"]), "pt") as f:
        assert list(f.keys()) == ["emb.weight"], "a tensor above the limit gets a file of its own"


def test_mixed_precision_saves_and_restores_the_fp32_masters(tmp_path: Path) -> None:
    model = shardpar.wrap(KITCHEN.build(), stage=1, mixed_precision="bf16")
    opt = shardpar.optimizer(model, torch.optim.AdamW, lr=1e-2)
    x, y = model.module.example(4, torch.Generator().manual_seed(0))
    model.module.loss(model(x), y).backward()
    opt.step()
    shardpar.save_checkpoint(tmp_path / "c", model, opt)
    manifest = json.loads((tmp_path / "c" / "shardpar.json").read_text())
    assert manifest["tensors"]["body.weight"]["dtype"] == "float32"
    fresh = shardpar.wrap(dataclasses.replace(KITCHEN, seed=5).build(), stage=3, mixed_precision="bf16")
    fresh_opt = shardpar.optimizer(fresh, torch.optim.AdamW, lr=1e-2)
    shardpar.load_checkpoint(tmp_path / "c", fresh, fresh_opt)
    assert_equal_states(fresh.full_state_dict(), model.full_state_dict(), "model")
    for m, o in ((model, opt), (fresh, fresh_opt)):
        o.zero_grad()
        m.module.loss(m(x), y).backward()
        o.step()
    assert_equal_states(fresh.full_state_dict(), model.full_state_dict(), "after one more step")


@settings(max_examples=60, deadline=None)
@given(numels=st.lists(st.integers(0, 50), max_size=8), world_size=st.integers(1, 9))
def test_even_split_tiles_every_tensor_and_balances_ranks(numels: list[int], world_size: int) -> None:
    from shardpar.checkpoint.offline import even_split

    split = even_split(numels, world_size)
    covered = [[] for _ in numels]
    for ranges in split:
        for index, start, end in ranges:
            covered[index].append((start, end))
    for numel, ranges in zip(numels, covered):
        position = 0
        for start, end in sorted(ranges):
            assert start == position and end > start
            position = end
        assert position == numel
    loads = [sum(end - start for _, start, end in ranges) for ranges in split]
    assert max(loads) - min(loads) <= 1


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.integers(0, 40), min_size=1, max_size=8), limit=st.integers(4, 100))
def test_hf_shards_keep_order_and_respect_the_limit(tmp_path_factory, sizes: list[int], limit: int) -> None:
    from shardpar.checkpoint.hf import HFLayoutWriter

    out = tmp_path_factory.mktemp("hf")
    entries = [(f"t{i}", torch.uint8, (n,)) for i, n in enumerate(sizes)]
    writer = HFLayoutWriter(out, entries, limit)
    for i, n in enumerate(sizes):
        writer.write(torch.full((n,), i, dtype=torch.uint8))
    files = writer.close()
    order = [name for file in files for name in load_file(str(out / file))]
    assert sorted(order, key=lambda n: int(n[1:])) == [n for n, _, _ in entries]
    for file in files:
        tensors = load_file(str(out / file))
        assert sum(t.numel() for t in tensors.values()) <= limit or len(tensors) == 1
        assert all(bool((t == int(n[1:])).all()) for n, t in tensors.items())
    if len(files) > 1:
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert index["metadata"]["total_size"] == sum(sizes)
