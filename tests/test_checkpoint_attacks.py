"""Checkpoint files and the offline tools under attack: each test is one thing a damaged
disk, a killed job or a hostile file system does, and what the user must see instead of a
hang, an exhausted memory or a silent mix of two checkpoints (docs/reliability.md, section 7).

- An export (``tools/consolidate.py``, ``save_full``) or a reshard appears whole or not at
  all: a failure halfway leaves the output exactly as before, and no temporary behind.
- ``shardpar.json`` and ``latest`` are read with a size cap; a FIFO or a device where a
  checkpoint file should be is refused before ``open`` could block or a read could not end.
- A save sweeps the abandoned temporaries of *other* checkpoints, and only those.
- Errors name the file: a file where a directory is expected, a full disk.
- A Hugging Face model's ``config.json`` travels with the checkpoint into every export, so
  ``transformers.AutoModelForCausalLM.from_pretrained(OUT)`` works as is.

Operations that the code as found would never finish run in a thread with a deadline (a
FIFO) or under a cap on this process's address space (``/dev/zero``), so a regression fails
the test instead of hanging it or eating the machine's memory.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import shardpar
from shardpar import CheckpointError
from shardpar.checkpoint import io as checkpoint_io
from shardpar.checkpoint.format import MANIFEST, latest_checkpoint, read_manifest
from shardpar.checkpoint.offline import consolidate, reshard
from shardpar.comm import collectives as C
from tests.support.checkpoint_helpers import build, save_run, train
from tests.support.parity import run

ROOT = Path(__file__).resolve().parent.parent
TOOLS = ROOT / "tools"
FILE = "rank-00000-of-00001.safetensors"
DEADLINE_S = 20.0
"""A read that blocks longer than this on a FIFO counts as blocked forever."""


# --------------------------------------------------------------------------- fixtures and guards


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two checkpoints of the same model at world size 1: A (2 steps) and B (1 step)."""
    root = tmp_path_factory.mktemp("saved")
    save_run(2, str(root / "A"))
    save_run(2, str(root / "B"), 1)
    return {"A": root / "A", "B": root / "B"}


@pytest.fixture
def ckpt(saved: dict[str, Path], tmp_path: Path) -> Path:
    copy = tmp_path / "ckpt" / "step-2"
    shutil.copytree(saved["A"], copy)
    return copy


def damaged_late(source: Path, destination: Path) -> Path:
    """A copy of ``source`` whose *last* tensor names a key its file lacks (an unsigned,
    hand-edited manifest): every reader gets halfway through before it notices."""
    shutil.copytree(source, destination)
    manifest = json.loads((destination / MANIFEST).read_text())
    manifest.pop("manifest_sha256")
    last = list(manifest["tensors"])[-1]
    manifest["tensors"][last]["pieces"][0]["key"] = "no-such-key"
    (destination / MANIFEST).write_text(json.dumps(manifest))
    return destination


def snapshot(directory: Path) -> dict[str, str]:
    """Every file under ``directory`` -> sha256 of its bytes."""
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def hidden_names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


def finishes_within(seconds: float, fifos: list[Path], fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` in a thread; if it is still inside after ``seconds`` (blocked opening a
    FIFO), open the FIFOs' write ends to release it and fail the test."""
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["value"] = fn(*args)
        except BaseException as error:  # noqa: BLE001 -- handed to the test thread
            outcome["error"] = error

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        for fifo in fifos:  # a blocked open(fifo, "rb") returns once a writer appears
            with contextlib.suppress(OSError):
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(10)
        pytest.fail(f"{getattr(fn, '__name__', fn)} was still blocked after {seconds} s on a FIFO")
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value")


def _address_space_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


@contextlib.contextmanager
def address_space_grows_at_most(extra_bytes: int):
    """Cap this process's address space at its current size plus ``extra_bytes``, so an
    unbounded read ends in MemoryError within that much instead of exhausting the machine."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (_address_space_bytes() + extra_bytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def load_world_1(path: Path, stage: int = 0) -> Any:
    _, model, opt = build(stage, seed=3)
    return shardpar.load_checkpoint(path, model, opt)


# --------------------------------------------------------------------------- 1. exports appear whole or not at all


def test_consolidate_failing_halfway_leaves_the_previous_export_exactly_as_it_was(saved, tmp_path: Path) -> None:
    out = tmp_path / "hf"
    files = consolidate(saved["A"], out, max_shard_size="0.5KB", progress=False)
    assert len(files) > 2
    (out / "tokenizer.json").write_text('{"mine": true}')  # not ours: kept by every export
    before = snapshot(out)
    broken = damaged_late(saved["B"], tmp_path / "B-damaged")
    with pytest.raises(CheckpointError, match=r"has no tensor 'no-such-key'"):
        consolidate(broken, out, max_shard_size="0.5KB", progress=False)
    assert snapshot(out) == before, "a failed export changed the previous one: a mix of two checkpoints"
    assert hidden_names(tmp_path) == [], "a failed export left a temporary behind"

    # A successful export replaces the previous one as a whole (fewer files this time).
    assert consolidate(saved["B"], out, progress=False) == ["model.safetensors"]
    assert sorted(os.listdir(out)) == ["model.safetensors", "tokenizer.json"]
    assert (out / "tokenizer.json").read_text() == '{"mine": true}'
    assert hidden_names(tmp_path) == []


def test_consolidate_refuses_to_write_into_the_checkpoint_it_reads(ckpt: Path) -> None:
    before = snapshot(ckpt)
    with pytest.raises(ValueError, match=r"output directory must differ from the input checkpoint"):
        consolidate(ckpt, ckpt, progress=False)
    assert snapshot(ckpt) == before


def test_reshard_failing_halfway_leaves_the_previous_output_and_no_temporary(saved, tmp_path: Path) -> None:
    out = tmp_path / "resharded"
    reshard(saved["A"], out, world_size=3, progress=False)
    before = snapshot(out)
    broken = damaged_late(saved["B"], tmp_path / "B-damaged")
    with pytest.raises(CheckpointError, match=r"has no tensor 'no-such-key'"):
        reshard(broken, out, world_size=2, progress=False)
    assert snapshot(out) == before
    assert hidden_names(tmp_path) == [], "a failed reshard left its temporary directory behind"


# --------------------------------------------------------------------------- 2. bounded reads


def test_a_manifest_symlinked_to_dev_zero_is_refused_without_reading_it(ckpt: Path) -> None:
    (ckpt / MANIFEST).unlink()
    (ckpt / MANIFEST).symlink_to("/dev/zero")
    with address_space_grows_at_most(512 * 2**20):
        with pytest.raises(CheckpointError, match=r"shardpar.json is not a regular file \(a character device\)"):
            read_manifest(ckpt)
        with pytest.raises(CheckpointError, match=r"shardpar.json is not a regular file"):
            load_world_1(ckpt)
        assert latest_checkpoint(ckpt.parent) is None  # no valid checkpoint left, and no hang


def test_a_latest_pointer_symlinked_to_dev_zero_is_ignored_with_a_warning(ckpt: Path) -> None:
    (ckpt.parent / "latest").symlink_to("/dev/zero")
    with address_space_grows_at_most(512 * 2**20):
        with pytest.warns(
            UserWarning,
            match=r"latest pointer .*latest is not a regular file \(a character device\); refusing to read it; "
            r"latest_checkpoint takes the newest valid checkpoint instead",
        ):
            assert latest_checkpoint(ckpt.parent) == ckpt  # the newest valid one, as for a damaged latest
    _, model, opt = build(0)
    shardpar.save_checkpoint(ckpt.parent / "step-3", model, opt)  # the next save repairs it
    latest = ckpt.parent / "latest"
    assert not latest.is_symlink() and latest.read_text() == "step-3\n"


def test_an_oversized_manifest_or_latest_is_refused_by_its_size(ckpt: Path) -> None:
    from shardpar.checkpoint.format import MAX_LATEST_BYTES, MAX_MANIFEST_BYTES

    with open(ckpt / MANIFEST, "r+b") as f:  # sparse: no disk used, nothing worth reading
        f.truncate(MAX_MANIFEST_BYTES + 1)
    with address_space_grows_at_most(512 * 2**20):
        with pytest.raises(
            CheckpointError,
            match=rf"shardpar.json is {MAX_MANIFEST_BYTES + 1} bytes, more than "
            rf"the {MAX_MANIFEST_BYTES} bytes",
        ):
            read_manifest(ckpt)
    latest = ckpt.parent / "latest"
    latest.write_text("step-2\n")
    with open(latest, "r+b") as f:
        f.truncate(MAX_LATEST_BYTES + 1)
    with pytest.warns(
        UserWarning,
        match=rf"latest pointer .*latest is {MAX_LATEST_BYTES + 1} bytes, more than the "
        rf"{MAX_LATEST_BYTES} bytes a latest pointer may have",
    ):
        assert latest_checkpoint(ckpt.parent) is None


def test_a_save_refuses_to_write_a_manifest_it_would_refuse_to_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from shardpar.checkpoint import format as checkpoint_format

    _, model, opt = build(0)
    shardpar.save_checkpoint(tmp_path / "step-1", model, opt)
    monkeypatch.setattr(checkpoint_format, "MAX_MANIFEST_BYTES", 4000)
    with pytest.raises(
        CheckpointError, match=r"the manifest of .*step-2.* would be \d+ bytes, more than the 4000 bytes"
    ):
        shardpar.save_checkpoint(tmp_path / "step-2", model, opt, extra={"big": "x" * 4000})
    assert sorted(os.listdir(tmp_path)) == ["latest", "step-1"]
    assert (tmp_path / "latest").read_text() == "step-1\n"


# --------------------------------------------------------------------------- 3. FIFOs and other non-regular files


def replace_with_fifo(path: Path) -> Path:
    path.unlink(missing_ok=True)
    os.mkfifo(path)
    return path


def test_a_fifo_in_place_of_a_shard_file_is_refused_not_waited_on(ckpt: Path) -> None:
    fifo = replace_with_fifo(ckpt / FILE)
    with pytest.raises(CheckpointError, match=rf"shard file .*{FILE} is not a regular file \(a FIFO\)"):
        finishes_within(DEADLINE_S, [fifo], load_world_1, ckpt, 3)


def test_a_fifo_in_place_of_the_manifest_or_latest_is_refused_not_waited_on(ckpt: Path) -> None:
    latest = replace_with_fifo(ckpt.parent / "latest")
    with pytest.warns(UserWarning, match=r"latest pointer .*latest is not a regular file \(a FIFO\)"):
        assert finishes_within(DEADLINE_S, [latest], latest_checkpoint, ckpt.parent) == ckpt
    manifest = replace_with_fifo(ckpt / MANIFEST)
    with pytest.raises(CheckpointError, match=r"shardpar.json is not a regular file \(a FIFO\)"):
        finishes_within(DEADLINE_S, [manifest, latest], read_manifest, ckpt)


# --------------------------------------------------------------------------- 4. abandoned temporaries


def test_a_save_sweeps_abandoned_temporaries_of_other_checkpoints_and_only_those(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    _, model, opt = build(0)
    shardpar.save_checkpoint(root / "step-1", model, opt)
    two_hours_ago = time.time() - 7200

    def abandoned(path: Path, directory: bool = True) -> Path:
        if directory:
            path.mkdir()
            (path / FILE).write_bytes(b"half a file")
            os.utime(path / FILE, (two_hours_ago, two_hours_ago))
        else:
            path.write_text("step-")
        os.utime(path, (two_hours_ago, two_hours_ago))
        return path

    killed_save = abandoned(root / ".step-2.tmp-0123456789ab")  # a save killed mid-write
    killed_latest = abandoned(root / ".latest.tmp-89abcdef0123", directory=False)
    in_use = root / ".step-3.tmp-abcdef012345"  # another saver's, being written right now
    in_use.mkdir()
    (in_use / FILE).write_bytes(b"being written")
    not_ours = [
        abandoned(root / ".step-2.tmp-backup"),
        abandoned(root / "step-2.tmp-0123456789ab"),
        abandoned(root / ".notes.tmp-0123456789AB", directory=False),
    ]
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("keep")
    link = root / ".step-4.tmp-fedcba987654"
    link.symlink_to(outside, target_is_directory=True)
    os.utime(link, (two_hours_ago, two_hours_ago), follow_symlinks=False)

    shardpar.save_checkpoint(root / "step-5", model, opt)
    assert not killed_save.exists() and not killed_latest.exists()
    assert not link.is_symlink(), "an abandoned temporary that is a symlink is unlinked"
    assert (outside / "keep.txt").read_text() == "keep", "never followed out of the parent"
    assert (in_use / FILE).read_bytes() == b"being written", "a temporary in use was removed"
    assert all(p.exists() for p in not_ours), "a name that is not shardpar's temporary pattern was removed"


# --------------------------------------------------------------------------- 5. errors that name the problem


def test_a_file_where_a_checkpoint_directory_is_expected_is_called_a_file(ckpt: Path) -> None:
    with pytest.raises(CheckpointError, match=rf"{FILE} is not a directory"):
        load_world_1(ckpt / FILE)
    with pytest.raises(CheckpointError, match=rf"{FILE} is not a directory"):
        latest_checkpoint(ckpt / FILE)
    with pytest.raises(CheckpointError, match=rf"{FILE} is not a directory"):
        consolidate(ckpt, ckpt / FILE, progress=False)
    with pytest.raises(CheckpointError, match=rf"{FILE} is not a directory"):
        reshard(ckpt, ckpt / FILE, world_size=2, progress=False)
    under_a_file = rf"cannot create .*{FILE}/new: .*{FILE} is not a directory"
    with pytest.raises(CheckpointError, match=under_a_file):
        consolidate(ckpt, ckpt / FILE / "new", progress=False)
    with pytest.raises(CheckpointError, match=under_a_file):
        reshard(ckpt, ckpt / FILE / "new", world_size=2, progress=False)
    _, model, opt = build(0)
    with pytest.raises(CheckpointError, match=under_a_file):
        shardpar.save_checkpoint(ckpt / FILE / "new", model, opt)


class _DiskFills:
    """Stands in for ``open`` in shardpar.checkpoint.io/files: files whose name contains
    ``victim`` accept ``capacity`` bytes, then every write fails with ENOSPC, as a full disk
    does (the OSError names no file)."""

    def __init__(self, victim: str, capacity: int = 100) -> None:
        self.victim, self.capacity = victim, capacity

    def __call__(self, file, mode="r", *args, **kwargs):
        real = open(file, mode, *args, **kwargs)
        if self.victim not in os.fspath(file) or not set(mode) & set("wxa"):
            return real
        return _FillingFile(real, self.capacity)


class _FillingFile:
    def __init__(self, real, capacity: int) -> None:
        self._real, self._left = real, capacity

    def write(self, data):
        size = len(data.encode()) if isinstance(data, str) else memoryview(data).nbytes
        if size > self._left:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self._left -= size
        return self._real.write(data)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._real.close()

    def __getattr__(self, name):
        return getattr(self._real, name)


def fill_the_disk(monkeypatch: pytest.MonkeyPatch, victim: str, capacity: int = 100) -> None:
    from shardpar.checkpoint import files as checkpoint_files

    for module in (checkpoint_io, checkpoint_files):
        monkeypatch.setattr(module, "open", _DiskFills(victim, capacity), raising=False)


def assert_disk_full_error(error: BaseException, victim: str) -> None:
    assert isinstance(error, CheckpointError), f"{type(error).__name__}: {error}"
    assert victim in str(error) and "the disk is full" in str(error), str(error)
    assert isinstance(error.__cause__, OSError) and error.__cause__.errno == errno.ENOSPC


def save_with_a_full_disk_on_rank_0(path: str, async_save: bool) -> str:
    """Rank function: rank 0's disk fills while it writes its file; every rank reports (an
    asynchronous save: from ``wait()``, after a training step taken while it wrote)."""
    module, model, opt = build(0)
    patches = pytest.MonkeyPatch()  # undone before returning: the harness reuses this process
    if C.get_rank() == 0:
        fill_the_disk(patches, "rank-00000-of-00002")
    try:
        handle = shardpar.save_checkpoint(path, model, opt, async_save=async_save)
        train(module, model, opt, 0, 1)
        handle.wait()
    except Exception as error:  # noqa: BLE001 -- the outcome is the test's to check
        cause = error.__cause__
        while cause is not None and not isinstance(cause, OSError):
            cause = cause.__cause__
        return f"{type(error).__name__}|{getattr(cause, 'errno', None)}|{error}"
    finally:
        patches.undo()
    return "saved"


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_full_disk_on_rank_0_is_a_checkpoint_error_naming_the_file_on_every_rank(
    tmp_path: Path, async_save: bool
) -> None:
    path = tmp_path / "ckpt" / "step-1"
    outcomes = run(save_with_a_full_disk_on_rank_0, 2, str(path), async_save)
    kind, cause, message = outcomes[0].split("|", 2)
    assert (kind, cause) == ("CheckpointError", str(errno.ENOSPC)), outcomes[0]
    assert "rank-00000-of-00002.safetensors" in message and "the disk is full" in message, message
    if async_save:  # raised away from the call that caused it: it says which save and which rank
        assert f"asynchronous save_checkpoint to {path} failed" in message and "failed on rank 0" in message, message
    assert outcomes[1].startswith("CheckpointError") and "failed on rank 0" in outcomes[1], outcomes[1]
    assert "rank-00000-of-00002.safetensors" in outcomes[1] and "the disk is full" in outcomes[1]
    assert not path.exists() and os.listdir(path.parent) == [], "a failed save left something behind"


@pytest.mark.parametrize("victim", [MANIFEST, "latest"])
def test_a_full_disk_while_committing_names_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, victim: str
) -> None:
    _, model, opt = build(0)
    fill_the_disk(monkeypatch, victim, capacity=0)
    with pytest.raises(CheckpointError) as info:
        shardpar.save_checkpoint(tmp_path / "step-1", model, opt)
    assert_disk_full_error(info.value, victim)


def test_a_full_disk_during_an_export_names_the_file_and_keeps_the_previous_export(
    saved, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "hf"
    consolidate(saved["A"], out, max_shard_size="0.5KB", progress=False)
    before = snapshot(out)
    fill_the_disk(monkeypatch, "model-00003")
    with pytest.raises(CheckpointError) as info:
        consolidate(saved["B"], out, max_shard_size="0.5KB", progress=False)
    assert_disk_full_error(info.value, "model-00003")
    assert snapshot(out) == before and hidden_names(tmp_path) == []

    _, model, _ = build(1)
    with pytest.raises(CheckpointError) as info:
        shardpar.save_full(out, model, max_shard_size="0.5KB")
    assert_disk_full_error(info.value, "model-00003")
    assert snapshot(out) == before and hidden_names(tmp_path) == []


# --------------------------------------------------------------------------- the tools, end to end


@pytest.fixture(scope="module")
def tool_runs(saved, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every tool on a FIFO shard file and on files where directories are expected, all
    started at once (each imports torch); a run still going after its deadline is killed
    and reported as hung."""
    tmp = tmp_path_factory.mktemp("tools")
    with_fifo = tmp / "with-fifo"
    shutil.copytree(saved["A"], with_fifo)
    replace_with_fifo(with_fifo / FILE)
    a_file = tmp / "notes.txt"
    a_file.write_text("not a checkpoint")
    commands = {
        "inspect-fifo": ["inspect_ckpt.py", with_fifo, "--verify"],
        "consolidate-fifo": ["consolidate.py", with_fifo, tmp / "hf"],
        "reshard-fifo": ["reshard.py", with_fifo, tmp / "resharded", "--world-size", "2"],
        "inspect-file": ["inspect_ckpt.py", a_file],
        "consolidate-into-file": ["consolidate.py", saved["A"], a_file],
        "reshard-into-file": ["reshard.py", saved["A"], a_file, "--world-size", "2"],
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
    results: dict[str, Any] = {}
    deadline = time.monotonic() + 150
    for name, proc in procs.items():
        try:
            stdout, stderr = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
            stderr += "\n<hung: killed after the deadline>"
        results[name] = subprocess.CompletedProcess(commands[name], proc.returncode, stdout, stderr)
    return {"tmp": tmp, "results": results}


@pytest.mark.parametrize(
    "name, message",
    [
        ("inspect-fifo", rf"error: shard file .*{FILE} is not a regular file \(a FIFO\)"),
        ("consolidate-fifo", rf"error: shard file .*{FILE} is not a regular file \(a FIFO\)"),
        ("reshard-fifo", rf"error: shard file .*{FILE} is not a regular file \(a FIFO\)"),
        ("inspect-file", r"error: checkpoint directory .*notes.txt is not a directory"),
        ("consolidate-into-file", r"error: .*notes.txt is not a directory"),
        ("reshard-into-file", r"error: .*notes.txt is not a directory"),
    ],
)
def test_tools_refuse_bad_paths_with_one_line_and_leave_nothing_behind(tool_runs, name: str, message: str) -> None:
    result = tool_runs["results"][name]
    lines = [line for line in result.stderr.split("\n") if line.strip()]
    assert result.returncode == 1 and len(lines) == 1 and re.match(message, lines[0]), result.stderr[-2000:]
    leftovers = [p.name for p in tool_runs["tmp"].iterdir() if p.name not in ("with-fifo", "notes.txt")]
    assert leftovers == [], f"a failed tool left {leftovers}"


# --------------------------------------------------------------------------- 6. the Hugging Face config travels


def tiny_llama() -> torch.nn.Module:
    """A tiny Llama built from a config (nothing downloaded), its head tied to the embedding."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    return LlamaForCausalLM(config)


def train_and_save_hf(ckpt: str, export: str) -> dict[str, torch.Tensor]:
    """Rank function: a tiny Llama at stage 3, one optimizer step, then a sharded checkpoint
    and a full export; returns the full state the ranks trained to."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    model = shardpar.wrap(tiny_llama(), stage=3, wrap_policy=(LlamaDecoderLayer,))
    opt = shardpar.optimizer(model, torch.optim.AdamW, lr=1e-2)
    rank, world_size = C.get_rank(), C.get_world_size()
    tokens = torch.randint(0, 96, (2 * world_size, 16), generator=torch.Generator().manual_seed(1))
    mine = tokens[2 * rank : 2 * rank + 2]
    model(input_ids=mine, labels=mine).loss.backward()
    opt.step()
    shardpar.save_checkpoint(ckpt, model, opt)
    shardpar.save_full(export, model)
    return model.full_state_dict()


def hf_logits(model: torch.nn.Module) -> torch.Tensor:
    tokens = torch.randint(0, 96, (3, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        return model.eval()(input_ids=tokens).logits


def test_exports_of_a_hugging_face_model_load_with_from_pretrained(tmp_path: Path) -> None:
    import transformers  # the dev extra installs it

    ckpt, export = tmp_path / "ckpt" / "step-1", tmp_path / "save-full"
    state = run(train_and_save_hf, 2, str(ckpt), str(export), timeout=240)[0]
    expected_model = tiny_llama()
    expected_model.load_state_dict(state)
    expected = hf_logits(expected_model)

    consolidated = tmp_path / "consolidated"
    consolidate(ckpt, consolidated, progress=False)
    via_reshard = tmp_path / "via-reshard"
    reshard(ckpt, tmp_path / "resharded", world_size=3, progress=False)
    consolidate(tmp_path / "resharded", via_reshard, progress=False)
    for out in (consolidated, export, via_reshard):
        assert {"config.json", "generation_config.json", "model.safetensors"} <= set(os.listdir(out)), out
        config = json.loads((out / "config.json").read_text())
        assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
        loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
        assert type(loaded).__name__ == "LlamaForCausalLM" and loaded.lm_head.weight is loaded.model.embed_tokens.weight
        assert torch.equal(hf_logits(loaded), expected), f"{out.name}: other logits than the trained model"

    cast = tmp_path / "bf16"
    consolidate(ckpt, cast, dtype="bf16", progress=False)
    assert json.loads((cast / "config.json").read_text())["dtype"] == "bfloat16"
    assert transformers.AutoModelForCausalLM.from_pretrained(cast).model.embed_tokens.weight.dtype == torch.bfloat16
