"""Checkpoint fuzzing: a damaged checkpoint loads exactly as saved or fails with
``shardpar.CheckpointError`` naming what is wrong -- never another exception, never a
silently different model or optimizer, never an unpickling.

Every example copies a real two-file checkpoint (KitchenSink: tied weights, a frozen
parameter, buffers, AdamW in two param groups with per-group learning rates), damages it one
way, and loads it into a fresh model. "Loads exactly" means the model's full state dict, the
optimizer's full state (elementwise and scalar), its hyperparameters and ``extra`` are all
bit-identical to loading the undamaged checkpoint: a mutation may only be accepted if it
changes nothing that loading uses (whitespace, say). Hypothesis runs derandomized (a fixed
seed), with a bounded number of examples per mutation family, so the file takes seconds.
"""

from __future__ import annotations

import contextlib
import json
import pickle
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shardpar
from shardpar.checkpoint.format import MANIFEST, latest_checkpoint, read_manifest
from shardpar.checkpoint.offline import reshard
from tests.support.checkpoint_helpers import build, full_optimizer_state, train

FILES = (MANIFEST, "rank-00000-of-00002.safetensors", "rank-00001-of-00002.safetensors")
LOAD_STAGES = (0, 1, 2, 3)
FUZZ = settings(
    derandomize=True,  # a fixed seed: the same examples on every run
    database=None,
    deadline=None,
    max_examples=40,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


class Unpickled(AssertionError):
    """Raised by the stand-ins for pickle.load(s)/torch.load: loading must never unpickle."""


@contextlib.contextmanager
def no_unpickling() -> Iterator[None]:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise Unpickled("a checkpoint load tried to unpickle")

    saved = pickle.loads, pickle.load, torch.load
    pickle.loads, pickle.load, torch.load = refuse, refuse, refuse
    try:
        yield
    finally:
        pickle.loads, pickle.load, torch.load = saved


# --------------------------------------------------------------------------- the checkpoints


def _save(path: Path, steps: int) -> None:
    """A KitchenSink checkpoint after ``steps`` steps, rewritten as two rank files."""
    module, model, opt = build(stage=1)
    train(module, model, opt, 0, steps)
    single = path.parent / f"{path.name}-single"
    shardpar.save_checkpoint(single, model, opt, extra={"step": steps, "note": "fuzz"})
    reshard(single, path, world_size=2, progress=False)


def _loaded(path: Path, stage: int) -> dict[str, Any]:
    """Load into a fresh, differently initialised model: everything loading produced."""
    _, model, opt = build(stage, seed=7)
    extra = shardpar.load_checkpoint(path, model, opt)
    return {"model": model.full_state_dict(), "optimizer": full_optimizer_state(opt), "extra": extra}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("fuzz")
    _save(root / "a", steps=2)
    _save(root / "b", steps=3)  # same structure, other values: the source of swapped shards
    assert sorted(p.name for p in (root / "a").iterdir()) == sorted(FILES)
    with no_unpickling():
        expected = {stage: _loaded(root / "a", stage) for stage in LOAD_STAGES}
    manifest = read_manifest(root / "a")
    names = set(FILES) | set(manifest.tensors) | set(manifest.aliases) | {str(root / "a")}
    return Checkpoints(
        a=root / "a",
        b=root / "b",
        expected=expected,
        names=names,
        manifest=json.loads((root / "a" / MANIFEST).read_text()),
    )


class Checkpoints(dict):
    """The fixture's values; a short repr, so a falsifying example prints readably."""

    def __init__(self, **values: Any) -> None:
        super().__init__(values)

    def __repr__(self) -> str:
        return f"<checkpoints {self['a']} and {self['b']}>"


def _equal(actual: Any, expected: Any) -> bool:
    if isinstance(expected, dict):
        return (
            isinstance(actual, dict)
            and actual.keys() == expected.keys()
            and all(_equal(actual[k], v) for k, v in expected.items())
        )
    if isinstance(expected, (list, tuple)):
        return (
            isinstance(actual, (list, tuple))
            and len(actual) == len(expected)
            and all(_equal(a, e) for a, e in zip(actual, expected))
        )
    if isinstance(expected, torch.Tensor):
        return isinstance(actual, torch.Tensor) and actual.dtype == expected.dtype and torch.equal(actual, expected)
    return type(actual) is type(expected) and actual == expected


def check_outcome(ckpt: dict[str, Any], directory: Path, stage: int, what: str, blamed: tuple[str, ...] = ()) -> str:
    """Load the damaged copy: identical to the original, or a CheckpointError that names a
    file or tensor (one of ``blamed`` when given). Returns "loaded" or "refused"."""
    try:
        with no_unpickling():
            loaded = _loaded(directory, stage)
    except shardpar.CheckpointError as error:
        message = str(error)
        names = blamed or tuple(ckpt["names"] | {str(directory)})
        assert any(name in message for name in names), (
            f"{what}: the CheckpointError names none of {sorted(names)}: {message}"
        )
        return "refused"
    except Unpickled:
        raise
    except Exception as error:  # noqa: BLE001 -- the point: nothing but CheckpointError
        raise AssertionError(f"{what}: load raised {type(error).__name__}, not CheckpointError: {error}") from error
    for part in ("model", "optimizer", "extra"):
        assert _equal(loaded[part], ckpt["expected"][stage][part]), (
            f"{what}: loaded without error but the {part} differs from the saved checkpoint"
        )
    return "loaded"


@contextlib.contextmanager
def damaged_copy(ckpt: dict[str, Any]) -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="shardpar-fuzz-") as tmp:
        copy = Path(tmp) / "ckpt"
        shutil.copytree(ckpt["a"], copy)
        yield copy


def _blame(directory: Path, name: str) -> tuple[str, ...]:
    """What a message about a damaged ``name`` must mention."""
    return (name,) if name != MANIFEST else (MANIFEST, str(directory))


stages = st.sampled_from(LOAD_STAGES)
files = st.sampled_from(FILES)


# --------------------------------------------------------------------------- file damage


@FUZZ
@given(name=files, keep=st.floats(0.0, 1.0, exclude_max=True), stage=stages)
def test_truncated_file(checkpoints: dict[str, Any], name: str, keep: float, stage: int) -> None:
    with damaged_copy(checkpoints) as ckpt:
        path = ckpt / name
        data = path.read_bytes()
        path.write_bytes(data[: int(len(data) * keep)])
        what = f"{name} truncated to {int(len(data) * keep)} of {len(data)} bytes"
        assert check_outcome(checkpoints, ckpt, stage, what, _blame(ckpt, name)) == "refused", what


@FUZZ
@given(name=files, where=st.floats(0.0, 1.0, exclude_max=True), mask=st.integers(1, 255), stage=stages)
def test_flipped_byte(checkpoints: dict[str, Any], name: str, where: float, mask: int, stage: int) -> None:
    with damaged_copy(checkpoints) as ckpt:
        path = ckpt / name
        data = bytearray(path.read_bytes())
        offset = int(len(data) * where)
        data[offset] ^= mask
        path.write_bytes(bytes(data))
        what = f"{name}: byte {offset} of {len(data)} xor {mask:#04x}"
        # A flip inside the manifest's JSON whitespace may change nothing; anything else must
        # be refused (shard files are checksummed in full).
        outcome = check_outcome(checkpoints, ckpt, stage, what, _blame(ckpt, name))
        if name != MANIFEST:
            assert outcome == "refused", what


@FUZZ
@given(name=files, tail=st.binary(min_size=1, max_size=64), stage=stages)
def test_appended_bytes(checkpoints: dict[str, Any], name: str, tail: bytes, stage: int) -> None:
    with damaged_copy(checkpoints) as ckpt:
        with open(ckpt / name, "ab") as f:
            f.write(tail)
        check_outcome(checkpoints, ckpt, stage, f"{len(tail)} bytes appended to {name}", _blame(ckpt, name))


@FUZZ
@given(name=files, action=st.sampled_from(["delete", "rename", "replace-by-other"]), stage=stages)
def test_missing_or_renamed_file(checkpoints: dict[str, Any], name: str, action: str, stage: int) -> None:
    with damaged_copy(checkpoints) as ckpt:
        path = ckpt / name
        if action == "delete":
            path.unlink()
        elif action == "rename":
            path.rename(ckpt / (name + ".bak"))
        else:  # another file of the checkpoint takes this one's name
            other = next(f for f in FILES if f != name)
            shutil.copyfile(ckpt / other, path)
        what = f"{name}: {action}"
        assert check_outcome(checkpoints, ckpt, stage, what, _blame(ckpt, name)) == "refused", what


@FUZZ
@given(name=files, stage=stages)
def test_file_swapped_with_another_checkpoints(checkpoints: dict[str, Any], name: str, stage: int) -> None:
    """Same structure, same file names, other values (a later step): must not mix."""
    with damaged_copy(checkpoints) as ckpt:
        shutil.copyfile(checkpoints["b"] / name, ckpt / name)
        what = f"{name} taken from another checkpoint"
        assert check_outcome(checkpoints, ckpt, stage, what, _blame(ckpt, name)) == "refused", what


@settings(FUZZ, max_examples=4)
@given(stage=stages)
def test_rank_files_swapped_with_each_other(checkpoints: dict[str, Any], stage: int) -> None:
    with damaged_copy(checkpoints) as ckpt:
        first, second = ckpt / FILES[1], ckpt / FILES[2]
        first.rename(ckpt / "tmp")
        second.rename(first)
        (ckpt / "tmp").rename(second)
        what = "the two rank files swapped"
        assert check_outcome(checkpoints, ckpt, stage, what, FILES[1:]) == "refused", what


# --------------------------------------------------------------------------- manifest edits


def _paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path into a JSON value (dict keys and list indices), the root excluded."""
    out = []
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else []
    for key, child in items:
        out.append(prefix + (key,))
        out.extend(_paths(child, prefix + (key,)))
    return out


def _leaves(value: Any) -> list[Any]:
    if isinstance(value, dict):
        return [leaf for child in value.values() for leaf in _leaves(child)] + list(value)
    if isinstance(value, list):
        return [leaf for child in value for leaf in _leaves(child)]
    return [value]


def _get(value: Any, path: tuple) -> Any:
    for key in path:
        value = value[key]
    return value


json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-3, 2**40)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
)
json_values = st.recursive(
    json_scalars,
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3),
    max_leaves=6,
)


@st.composite
def replacements(draw: st.DrawFn, old: Any, leaves: list[Any]) -> Any:
    """A new value for a manifest field: a near miss of the old one, another value found in
    the manifest (a key, a file name, a number), or any JSON value."""
    choices = [json_values, st.sampled_from(leaves)]
    if isinstance(old, bool):
        choices.append(st.just(not old))
    elif isinstance(old, int):
        choices.append(st.integers(-2, 2).filter(bool).map(lambda d: old + d))
    elif isinstance(old, float):
        choices.append(st.sampled_from([old * 2, old / 2, old + 1e-7, -old, 0.0, int(old)]))
    elif isinstance(old, str):
        choices.append(st.sampled_from([old + "x", old[:-1], old.upper(), ""]))
    elif isinstance(old, list) and old:
        choices.append(st.just(old[::-1]))
    new = draw(st.one_of(*choices))
    return new


def _write_manifest(directory: Path, manifest: Any) -> None:
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=1))


@settings(FUZZ, max_examples=120)
@given(data=st.data(), stage=stages)
def test_manifest_field_edited(checkpoints: dict[str, Any], data: st.DataObject, stage: int) -> None:
    original = checkpoints["manifest"]
    path = data.draw(st.sampled_from(_paths(original)), label="path")
    new = data.draw(replacements(_get(original, path), _leaves(original)), label="new value")
    manifest = json.loads(json.dumps(original))
    _get(manifest, path[:-1])[path[-1]] = new
    with damaged_copy(checkpoints) as ckpt:
        _write_manifest(ckpt, manifest)
        check_outcome(checkpoints, ckpt, stage, f"manifest field {list(path)} set to {new!r}")


@settings(FUZZ, max_examples=80)
@given(data=st.data(), stage=stages)
def test_manifest_field_deleted(checkpoints: dict[str, Any], data: st.DataObject, stage: int) -> None:
    original = checkpoints["manifest"]
    path = data.draw(st.sampled_from(_paths(original)), label="path")
    manifest = json.loads(json.dumps(original))
    del _get(manifest, path[:-1])[path[-1]]
    with damaged_copy(checkpoints) as ckpt:
        _write_manifest(ckpt, manifest)
        check_outcome(checkpoints, ckpt, stage, f"manifest field {list(path)} deleted")


@settings(FUZZ, max_examples=40)
@given(data=st.data(), stage=stages)
def test_manifest_values_swapped(checkpoints: dict[str, Any], data: st.DataObject, stage: int) -> None:
    """Two fields trade values (two piece keys, two offsets, two learning rates...)."""
    original = checkpoints["manifest"]
    paths = [p for p in _paths(original) if not isinstance(_get(original, p), (dict, list))]
    first = data.draw(st.sampled_from(paths), label="first")
    second = data.draw(st.sampled_from(paths).filter(lambda p: p != first), label="second")
    manifest = json.loads(json.dumps(original))
    a, b = _get(manifest, first), _get(manifest, second)
    _get(manifest, first[:-1])[first[-1]], _get(manifest, second[:-1])[second[-1]] = b, a
    with damaged_copy(checkpoints) as ckpt:
        _write_manifest(ckpt, manifest)
        check_outcome(checkpoints, ckpt, stage, f"manifest fields {list(first)} and {list(second)} swapped")


@settings(FUZZ, max_examples=80)
@given(data=st.data(), stage=stages)
def test_unsigned_manifest_edit_never_raises_another_exception(
    checkpoints: dict[str, Any], data: st.DataObject, stage: int
) -> None:
    """A manifest without ``manifest_sha256`` (hand-edited, or written before the checksum)
    is trusted as written, so an edit may load; but a malformed one must still be refused
    with a CheckpointError, never crash the loader with a TypeError or KeyError."""
    original = {k: v for k, v in checkpoints["manifest"].items() if k != "manifest_sha256"}
    path = data.draw(st.sampled_from(_paths(original)), label="path")
    manifest = json.loads(json.dumps(original))
    if data.draw(st.booleans(), label="delete"):
        del _get(manifest, path[:-1])[path[-1]]
        what = f"unsigned manifest: field {list(path)} deleted"
    else:
        new = data.draw(replacements(_get(original, path), _leaves(original)), label="new value")
        _get(manifest, path[:-1])[path[-1]] = new
        what = f"unsigned manifest: field {list(path)} set to {new!r}"
    with damaged_copy(checkpoints) as ckpt:
        _write_manifest(ckpt, manifest)
        try:
            with no_unpickling():
                _loaded(ckpt, stage)
        except shardpar.CheckpointError as error:
            assert any(name in str(error) for name in checkpoints["names"] | {str(ckpt)}), f"{what}: {error}"
        except Unpickled:
            raise
        except Exception as error:  # noqa: BLE001
            raise AssertionError(f"{what}: load raised {type(error).__name__}, not CheckpointError: {error}") from error


def test_reformatted_manifest_loads_identically(checkpoints: dict[str, Any]) -> None:
    """The control: JSON whitespace and key layout are not content."""
    with damaged_copy(checkpoints) as ckpt:
        manifest = json.loads((ckpt / MANIFEST).read_text())
        (ckpt / MANIFEST).write_text(json.dumps(manifest, separators=(",", ":")))
        assert check_outcome(checkpoints, ckpt, 2, "manifest re-serialised compactly") == "loaded"


# --------------------------------------------------------------------------- the latest pointer


@FUZZ
@given(content=st.binary(max_size=40) | st.sampled_from([b"a\n", b"../a\n", b"/etc\n", b"b", b"a-single\n"]))
def test_latest_pointer_never_raises_and_never_names_an_invalid_checkpoint(
    checkpoints: dict[str, Any], content: bytes
) -> None:
    root = checkpoints["a"].parent
    (root / "latest").write_bytes(content)
    try:
        found = latest_checkpoint(root)
    finally:
        (root / "latest").unlink()
    assert found is not None and found.parent == root, f"latest = {content!r}: {found}"
    read_manifest(found)  # a valid checkpoint, whatever the pointer says
