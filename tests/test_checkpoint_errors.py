"""Bad checkpoints and mismatched models: each a CheckpointError naming the file or tensor,
raised before anything is unpickled -- nothing ever is.

Checkpoints are saved once at world size 1 (stage 2, one file) and at world size 2 and
copied per test; loads run in this process unless a test is about several ranks.
"""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

import shardpar
from shardpar import CheckpointError
from shardpar.checkpoint.format import FORMAT_VERSION
from tests.support.checkpoint_helpers import build, save_run, try_load
from tests.support.models import KITCHEN
from tests.support.parity import run

FILE = "rank-00000-of-00001.safetensors"


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("saved") / "step-2"
    save_run(2, str(path))
    return path


@pytest.fixture
def ckpt(saved: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "step-2"
    shutil.copytree(saved, copy)
    return copy


def load(path: Path, stage: int = 0, optimizer: str | None = None) -> None:
    _, model, opt = build(stage, optimizer=optimizer)
    shardpar.load_checkpoint(path, model, opt)


def edit_manifest(path: Path, change) -> None:
    manifest = json.loads((path / "shardpar.json").read_text())
    manifest.pop("manifest_sha256", None)  # hand-edited: unsigned, so the checks below it run
    change(manifest)
    (path / "shardpar.json").write_text(json.dumps(manifest))


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"checkpoint directory .*nowhere does not exist"):
        load(tmp_path / "nowhere")


def test_missing_manifest(ckpt: Path) -> None:
    (ckpt / "shardpar.json").unlink()
    with pytest.raises(CheckpointError, match=r"step-2 has no manifest shardpar.json"):
        load(ckpt)


def test_manifest_that_is_not_json(ckpt: Path) -> None:
    (ckpt / "shardpar.json").write_text('{"format": "shardpar-checkpoint", ')
    with pytest.raises(CheckpointError, match=r"manifest .*shardpar.json is not valid JSON"):
        load(ckpt)


def test_manifest_from_a_newer_format_version(ckpt: Path) -> None:
    edit_manifest(ckpt, lambda m: m.update(format_version=FORMAT_VERSION + 1))
    newer = FORMAT_VERSION + 1
    with pytest.raises(CheckpointError, match=rf"format_version {newer}, newer than {FORMAT_VERSION}.*upgrade"):
        load(ckpt)


def test_missing_shard_file(ckpt: Path) -> None:
    (ckpt / FILE).unlink()
    with pytest.raises(CheckpointError, match=rf"shard file .*{FILE} is missing"):
        load(ckpt)


def test_flipped_byte_fails_the_checksum(ckpt: Path) -> None:
    data = bytearray((ckpt / FILE).read_bytes())
    data[len(data) // 2] ^= 0x01
    (ckpt / FILE).write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"checksum mismatch in shard file .*{FILE}"):
        load(ckpt)


def test_truncated_file(ckpt: Path) -> None:
    data = (ckpt / FILE).read_bytes()
    (ckpt / FILE).write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointError, match=rf"shard file .*{FILE} is truncated: {len(data) - 100} bytes"):
        load(ckpt)


def test_truncated_file_caught_by_the_header_check_alone(ckpt: Path) -> None:
    """Without a manifest record (size, sha256) to compare with, the header's offsets still
    catch a file that ends early."""
    from shardpar.checkpoint.io import SafetensorsReader

    data = (ckpt / FILE).read_bytes()
    (ckpt / FILE).write_bytes(data[: len(data) - 100])
    with pytest.raises(
        CheckpointError,
        match=rf"{FILE}: tensor .* has data_offsets .* outside the file's \d+ data "
        r"bytes \(truncated or corrupted file\)",
    ):
        SafetensorsReader(ckpt / FILE)


def test_one_header_limit_for_writing_and_reading(ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank files, exports and Hugging Face files share one safetensors reader and writer with
    one header limit (safetensors' own): the writer refuses a header the reader would refuse,
    before creating the file, and the reader refuses a longer header by its length, naming
    the file -- a shard file of a checkpoint too, before any byte of it is loaded."""
    from shardpar.checkpoint import io as checkpoint_io

    assert checkpoint_io.MAX_HEADER_BYTES == 100_000_000
    header_bytes = int.from_bytes((ckpt / FILE).read_bytes()[:8], "little")
    monkeypatch.setattr(checkpoint_io, "MAX_HEADER_BYTES", header_bytes - 1)
    with pytest.raises(
        CheckpointError,
        match=rf"shard file .*{FILE} has a header length of {header_bytes} bytes, "
        rf"over the {header_bytes - 1} bytes limit",
    ):
        load(ckpt)
    entries = [(f"t{i}", torch.float32, (1,)) for i in range(header_bytes // 20)]
    with pytest.raises(
        CheckpointError,
        match=r"cannot write .*big\.safetensors: its safetensors header would be "
        rf"\d+ bytes, more than the {header_bytes - 1} bytes a reader accepts",
    ):
        checkpoint_io.SafetensorsWriter(tmp_path / "big.safetensors", entries)
    assert not (tmp_path / "big.safetensors").exists()


@pytest.mark.parametrize("name", ["/etc/passwd", "../outside.safetensors", "sub/../../x.safetensors"])
def test_file_names_outside_the_checkpoint_are_refused(ckpt: Path, name: str) -> None:
    def point_elsewhere(manifest):
        manifest["files"][name] = manifest["files"].pop(FILE)
        for entry in manifest["tensors"].values():
            for piece in entry["pieces"]:
                piece["file"] = name

    edit_manifest(ckpt, point_elsewhere)
    with pytest.raises(CheckpointError, match=r"is absolute|contains '\.\.'") as info:
        load(ckpt)
    assert repr(name) in str(info.value)


def test_missing_key_in_a_file_names_key_and_file(ckpt: Path) -> None:
    edit_manifest(ckpt, lambda m: m["tensors"]["body.weight"]["pieces"][0].update(key="body.weight[nope]"))
    with pytest.raises(CheckpointError, match=rf"{FILE} has no tensor 'body.weight\[nope\]'"):
        load(ckpt)


def test_piece_coverage_that_does_not_add_up(ckpt: Path) -> None:
    def drop_a_piece(manifest):
        pieces = manifest["tensors"]["body.weight"]["pieces"]
        pieces[0]["end"] -= 1

    edit_manifest(ckpt, drop_a_piece)
    with pytest.raises(CheckpointError, match=r"piece coverage of tensor 'body.weight' does not add up"):
        load(ckpt)


def test_overlapping_pieces(ckpt: Path) -> None:
    def duplicate(manifest):
        pieces = manifest["tensors"]["out.bias"]["pieces"]
        pieces.append(dict(pieces[0]))

    edit_manifest(ckpt, duplicate)
    with pytest.raises(CheckpointError, match=r"coverage of tensor 'out.bias' does not add up: .* stored twice"):
        load(ckpt)


def test_model_that_does_not_match_lists_every_difference(ckpt: Path) -> None:
    module = KITCHEN.build()
    module.unused = nn.Linear(8, 4)  # shapes differ
    module.out = nn.Linear(8, 8, bias=False)  # out.bias missing from the model
    module.extra_scale = nn.Parameter(torch.ones(3))  # not in the checkpoint
    model = shardpar.wrap(module, stage=0)
    opt = shardpar.optimizer(model, torch.optim.AdamW)
    with pytest.raises(CheckpointError) as info:
        shardpar.load_checkpoint(ckpt, model, opt)
    message = str(info.value)
    assert "does not match the model" in message
    assert "missing in checkpoint: extra_scale" in message
    assert "unexpected in checkpoint: out.bias" in message
    assert "unused.weight (checkpoint [8, 8], model [4, 8])" in message
    assert "unused.bias (checkpoint [8], model [4])" in message


def test_optimizer_of_another_class(ckpt: Path) -> None:
    with pytest.raises(CheckpointError, match=r"optimizer torch.optim.adamw.AdamW, not of torch.optim.sgd.SGD"):
        load(ckpt, optimizer="SGD")


def test_checkpoint_without_optimizer_state(tmp_path: Path) -> None:
    _, model, _ = build(0)
    shardpar.save_checkpoint(tmp_path / "c", model)
    with pytest.raises(CheckpointError, match=r"has no optimizer state"):
        load(tmp_path / "c")
    _, model, _ = build(1, seed=5)
    assert shardpar.load_checkpoint(tmp_path / "c", model) is None  # the model alone loads


def test_parameter_in_another_param_group(ckpt: Path) -> None:
    def swap(manifest):
        groups = manifest["optimizer"]["param_groups"]
        groups[0]["params"].remove("body.weight")
        groups[1]["params"].append("body.weight")

    edit_manifest(ckpt, swap)
    with pytest.raises(CheckpointError, match=r"'body.weight' is in optimizer param group 0, but in group 1"):
        load(ckpt)


@pytest.mark.parametrize("extra", [{"when": object()}, {"loss": float("nan")}])
def test_extra_must_be_json(tmp_path: Path, extra: dict) -> None:
    _, model, opt = build(0)
    with pytest.raises(TypeError, match=r"extra must be JSON-serialisable"):
        shardpar.save_checkpoint(tmp_path / "c", model, opt, extra=extra)
    assert not (tmp_path / "c").exists() and not list(tmp_path.iterdir()), "nothing written"


def test_refuses_to_replace_a_directory_that_is_not_a_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "notes.txt").write_text("mine")
    _, model, opt = build(0)
    with pytest.raises(CheckpointError, match=r"c exists and is not a shardpar checkpoint"):
        shardpar.save_checkpoint(tmp_path / "c", model, opt)
    assert (tmp_path / "c" / "notes.txt").read_text() == "mine"


def test_nothing_is_ever_unpickled(ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("a checkpoint load tried to unpickle")

    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "Unpickler", refuse)
    monkeypatch.setattr(torch, "load", refuse)
    load(ckpt, stage=3)


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_corrupted_file_fails_every_rank_without_a_hang(tmp_path: Path, async_save: bool) -> None:
    path = tmp_path / "step-2"
    run(save_run, 2, 3, str(path), async_save=async_save)
    bad = path / "rank-00001-of-00002.safetensors"
    data = bytearray(bad.read_bytes())
    data[-5] ^= 0xFF
    bad.write_bytes(bytes(data))
    outcomes = run(try_load, 2, 1, str(path))  # stage 1: every rank reads both files
    for outcome in outcomes:
        assert outcome.startswith("CheckpointError") and "checksum mismatch" in outcome
        assert "rank-00001-of-00002.safetensors" in outcome
    outcomes = run(try_load, 2, 3, str(path))  # stage 3, same layout: each rank reads its own file
    assert "checksum mismatch" in outcomes[1] and "rank-00001-of-00002.safetensors" in outcomes[1]
    assert "failed on rank 1" in outcomes[0] and "rank-00001-of-00002.safetensors" in outcomes[0]


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_failed_save_leaves_the_previous_checkpoint_and_no_leftovers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, async_save: bool
) -> None:
    from shardpar.checkpoint import io as checkpoint_io

    path = tmp_path / "ckpt" / "run"
    module, model, opt = build(0)
    shardpar.save_checkpoint(path, model, opt, extra={"step": 1}, async_save=async_save).wait()

    def disk_full(self, tensor):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint_io.SafetensorsWriter, "write", disk_full)
    # An asynchronous save's error names the checkpoint and the rank, caused by the OSError.
    with pytest.raises(CheckpointError if async_save else OSError, match="No space left"):
        shardpar.save_checkpoint(path, model, opt, extra={"step": 2}, async_save=async_save).wait()
    assert sorted(p.name for p in path.parent.iterdir()) == ["latest", "run"]
    monkeypatch.undo()
    _, fresh, fresh_opt = build(3, seed=2)
    assert shardpar.load_checkpoint(path, fresh, fresh_opt) == {"step": 1}


@pytest.mark.parametrize("numel", [1, 7, 8, 9, 23])
def test_the_pinned_bounce_moves_every_byte_across_chunk_edges(tmp_path, numel: int) -> None:
    """The two-buffer path checkpoint bytes of GPU tensors take ([Note: checkpoint bytes and the
    GPU] in checkpoint/host_bytes.py), driven here with CPU tensors and 8-element chunks: written bytes
    equal the tensor's, read bytes land in the right places, whatever the chunk count."""
    from shardpar.checkpoint.host_bytes import PinnedBounce

    values = torch.arange(numel, dtype=torch.float32) * 1.5 - 3
    written = bytearray()
    PinnedBounce(torch.float32, torch.device("cpu"), numel, chunk_bytes=32).to_host(
        values, lambda view: written.extend(view)
    )
    assert bytes(written) == values.numpy().tobytes()
    data = b"\0" * 12 + bytes(written)

    def readinto(offset: int, view: memoryview) -> None:
        view[:] = data[offset : offset + view.nbytes]

    dest = torch.full((numel,), float("nan"))
    PinnedBounce(torch.float32, torch.device("cpu"), numel, chunk_bytes=32).from_file(dest, readinto, 12)
    assert torch.equal(dest, values)
