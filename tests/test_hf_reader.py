"""The Hugging Face checkpoint reader (``shardpar.checkpoint.hf``): ranged reads equal the
safetensors oracle, only the requested bytes are read, bad input is a CheckpointError naming
the file and tensor, and missing/unexpected keys equal what ``transformers`` reports.

Checkpoints are tiny ``transformers`` models built from a config and written with
``save_pretrained`` into a temporary directory (nothing is downloaded): one file and several
shards, fp32 and bf16 on disk. Oracles: ``safetensors.torch.load_file`` and
``from_pretrained(..., output_loading_info=True)``.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from shardpar import CheckpointError
from shardpar.checkpoint import io as safetensors_io
from shardpar.checkpoint.hf import RangeRead, open_hf_checkpoint
from shardpar.checkpoint.hf_keys import hf_ignore_patterns, match_keys
from shardpar.checkpoint.io import MAX_HEADER_BYTES

LLAMA = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
GPT2 = dict(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=32, bos_token_id=0, eos_token_id=0)
SHARD_SIZE = "12KB"  # several shards per checkpoint (the fp32 Llama is about 70 KB)
LAYOUTS = [
    "llama-single-fp32",
    "llama-sharded-fp32",
    "llama-single-bf16",
    "llama-sharded-bf16",
    "gpt2-single-fp32",
    "gpt2-sharded-bf16",
]
DEST_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def llama(tied: bool = True) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA, tie_word_embeddings=tied))


def gpt2() -> transformers.PreTrainedModel:
    torch.manual_seed(1)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(**GPT2))


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for layout in LAYOUTS:
        family, kind, dtype = layout.split("-")
        model = (llama() if family == "llama" else gpt2()).to(torch.float32 if dtype == "fp32" else torch.bfloat16)
        out[layout] = root / layout
        model.save_pretrained(out[layout], max_shard_size=SHARD_SIZE if kind == "sharded" else "1GB")
    return out


@pytest.fixture
def sharded(saved: dict[str, Path], tmp_path: Path) -> Path:
    """A copy of the sharded fp32 Llama checkpoint to damage."""
    return Path(shutil.copytree(saved["llama-sharded-fp32"], tmp_path / "sharded"))


@pytest.fixture
def single(saved: dict[str, Path], tmp_path: Path) -> Path:
    return Path(shutil.copytree(saved["llama-single-fp32"], tmp_path / "single"))


def oracle(directory: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def weight_map(directory: Path) -> dict[str, str]:
    return json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"]


def edit_index(directory: Path, change: Callable[[dict[str, str]], None]) -> None:
    path = directory / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    change(index["weight_map"])
    path.write_text(json.dumps(index))


def header_of(path: Path) -> tuple[dict, int]:
    """The header and data start of a safetensors file, parsed here independently of hf.py."""
    raw = path.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8 : 8 + length]), 8 + length


def byte_range(path: Path, name: str, start: int, end: int) -> tuple[int, int]:
    """Bytes ``[lo, hi)`` of ``path`` holding elements ``[start, end)`` of tensor ``name``."""
    header, data_start = header_of(path)
    itemsize = {"F32": 4, "BF16": 2, "F16": 2}[header[name]["dtype"]]
    first = data_start + header[name]["data_offsets"][0]
    return first + start * itemsize, first + end * itemsize


def write_raw(path: Path, header: dict, data: bytes, length: int | None = None) -> Path:
    """A safetensors file from a hand-made header (any header, valid or not)."""
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes((len(raw) if length is None else length).to_bytes(8, "little") + raw + data)
    return path


@pytest.fixture
def trace(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int, int]]:
    """Every read of a safetensors file, as ``(inode, offset, bytes)``: io.py reads them only
    through ``_read_exact``; ``test_os_counts_only_the_requested_bytes`` checks that claim."""
    calls: list[tuple[int, int, int]] = []
    real = safetensors_io._read_exact

    def recording(file, offset, view, where):
        calls.append((os.fstat(file.fileno()).st_ino, offset, view.nbytes))
        real(file, offset, view, where)

    monkeypatch.setattr(safetensors_io, "_read_exact", recording)
    return calls


def rchar() -> tuple[int, int]:
    """``rchar`` of /proc/self/io (bytes this process got from read calls) and the size of
    the text just read, which the next reading will have counted."""
    text = Path("/proc/self/io").read_bytes()
    return int(text.split(b"rchar:")[1].split()[0]), len(text)


def random_ranges(numel: int, rng: random.Random, count: int = 6) -> list[tuple[int, int]]:
    ranges = [(0, numel), (0, 0), (numel - 1, numel), (numel // 2, numel // 2)]
    for _ in range(count):
        a, b = sorted(rng.randrange(numel + 1) for _ in range(2))
        ranges.append((a, b))
    return ranges


# --------------------------------------------------------------------------- values


@pytest.mark.parametrize("layout", LAYOUTS)
def test_tensors_listing_equals_oracle_and_reads_only_headers(saved, layout, trace) -> None:
    directory = saved[layout]
    with open_hf_checkpoint(directory) as ckpt:
        expected = {name: (t.dtype, tuple(t.shape)) for name, t in oracle(directory).items()}
        assert ckpt.tensors == expected
    headers = [header_of(f)[1] for f in sorted(directory.glob("*.safetensors"))]  # 8 + header length
    assert sum(n for _, _, n in trace) == sum(headers)  # no tensor data (the index is read whole, apart)
    if "sharded" in layout:
        assert len(headers) >= 3 and ckpt.files == sorted(set(weight_map(directory).values()))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_random_ranges_equal_oracle(saved, layout) -> None:
    rng = random.Random(layout)
    reference = oracle(saved[layout])
    with open_hf_checkpoint(saved[layout], chunk_bytes=24) as ckpt:  # several chunks per cast
        for name, full in reference.items():
            flat = full.flatten()
            for start, end in random_ranges(flat.numel(), rng):
                for dtype in DEST_DTYPES:
                    dest = torch.full((end - start,), float("nan"), dtype=dtype)
                    ckpt.read_range(name, start, end, dest)
                    assert torch.equal(dest, flat[start:end].to(dtype)), (name, start, end, dtype)


@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_hypothesis_ranges_equal_oracle(saved, data) -> None:
    layout = data.draw(st.sampled_from(LAYOUTS))
    reference = oracle(saved[layout])
    name = data.draw(st.sampled_from(sorted(reference)))
    flat = reference[name].flatten()
    start = data.draw(st.integers(0, flat.numel()))
    end = data.draw(st.integers(start, flat.numel()))
    dtype = data.draw(st.sampled_from(DEST_DTYPES))
    strided = data.draw(st.booleans())
    chunk_bytes = data.draw(st.integers(1, 96))
    storage = torch.zeros(2 * (end - start), dtype=dtype)
    dest = storage[::2] if strided else storage[: end - start]
    with open_hf_checkpoint(saved[layout], chunk_bytes=chunk_bytes) as ckpt:
        ckpt.read_range(name, start, end, dest)
    assert torch.equal(dest, flat[start:end].to(dtype))


@pytest.mark.parametrize("world_size", [1, 2, 3, 5])
@pytest.mark.parametrize("layout", ["llama-sharded-fp32", "llama-sharded-bf16"])
def test_zero3_shards_of_every_rank_reassemble_the_oracle(saved, layout, world_size, monkeypatch) -> None:
    """Each rank reads its 1/N piece of every flattened parameter (ceil(numel / N) elements,
    the last piece clipped) in one read_ranges call, in shuffled order, with at most two
    files open at once; the pieces of all ranks together equal the oracle."""
    reference = oracle(saved[layout])
    rebuilt = {name: torch.empty(t.numel(), dtype=torch.float32) for name, t in reference.items()}
    with open_hf_checkpoint(saved[layout], max_open=2) as ckpt:
        opened = []
        real = safetensors_io._read_exact
        monkeypatch.setattr(
            safetensors_io, "_read_exact", lambda *args: (opened.append(ckpt.open_file_count), real(*args))[1]
        )
        for rank in range(world_size):
            reads = []
            for name, dest in rebuilt.items():
                size = -(-dest.numel() // world_size)
                start, end = min(rank * size, dest.numel()), min((rank + 1) * size, dest.numel())
                reads.append(RangeRead(name, start, end, dest[start:end]))
            random.Random(rank).shuffle(reads)
            ckpt.read_ranges(reads)
        assert opened and max(opened) <= 2
    assert ckpt.open_file_count == 0
    for name, full in reference.items():
        assert torch.equal(rebuilt[name], full.flatten().float()), name


# --------------------------------------------------------------------------- bytes read


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reads_exactly_the_requested_bytes(single, trace, dtype) -> None:
    """Same dtype: one read straight into place; a cast: reads of at most chunk_bytes. Either
    way the reads tile exactly the requested byte range of the file that holds the tensor."""
    path = single / "model.safetensors"
    name, start, end = "model.layers.1.mlp.down_proj.weight", 101, 1337
    lo, hi = byte_range(path, name, start, end)
    with open_hf_checkpoint(single, chunk_bytes=64) as ckpt:
        trace.clear()
        ckpt.read_range(name, start, end, torch.empty(end - start, dtype=dtype))
    inode = os.stat(path).st_ino
    assert all(file == inode for file, _, _ in trace)
    position = lo
    for _, offset, nbytes in trace:
        assert offset == position
        position += nbytes
    assert position == hi
    if dtype == torch.float32:
        assert len(trace) == 1
    else:
        assert len(trace) == -(-(hi - lo) // 64) and max(n for _, _, n in trace) <= 64


@pytest.mark.skipif(sys.platform != "linux", reason="/proc/self/io is Linux's byte count")
def test_os_counts_only_the_requested_bytes(saved) -> None:
    """The kernel's count of bytes this process got from read calls, around one read_range:
    exactly the requested bytes, so no read bypasses the traced ones (a whole-file or
    whole-tensor read would show here)."""
    directory = saved["llama-sharded-bf16"]
    name = "model.embed_tokens.weight"
    with open_hf_checkpoint(directory, chunk_bytes=256) as ckpt:
        ckpt.read_range(name, 0, 1, torch.empty(1))  # warm up: file opened, code paths imported
        for start, end in [(5, 1500), (0, 2048), (777, 778)]:
            before, proc_text = rchar()
            ckpt.read_range(name, start, end, torch.empty(end - start))
            after, _ = rchar()
            assert after - before - proc_text == (end - start) * 2, (start, end)


def test_unrequested_bytes_do_not_matter(single) -> None:
    """Every data byte outside the requested range is overwritten with 0xFF (NaN in fp32);
    the read still equals the original values."""
    path = single / "model.safetensors"
    reference = load_file(path)
    name, start, end = "model.layers.0.self_attn.q_proj.weight", 33, 900
    lo, hi = byte_range(path, name, start, end)
    _, data_start = header_of(path)
    raw = bytearray(path.read_bytes())
    raw[data_start:lo] = b"\xff" * (lo - data_start)
    raw[hi:] = b"\xff" * (len(raw) - hi)
    path.write_bytes(bytes(raw))
    assert torch.isnan(load_file(path)[name].flatten()[:start]).all()  # the corruption is real
    with open_hf_checkpoint(single, chunk_bytes=40) as ckpt:
        for dtype in (torch.float32, torch.bfloat16):
            dest = torch.empty(end - start, dtype=dtype)
            ckpt.read_range(name, start, end, dest)
            assert torch.equal(dest, reference[name].flatten()[start:end].to(dtype))


# --------------------------------------------------------------------------- layouts and API


def test_file_and_index_paths_are_accepted(saved) -> None:
    single, sharded = saved["llama-single-fp32"], saved["llama-sharded-fp32"]
    with open_hf_checkpoint(single / "model.safetensors") as a, open_hf_checkpoint(single) as b:
        assert a.tensors == b.tensors
    with open_hf_checkpoint(sharded / "model.safetensors.index.json") as a, open_hf_checkpoint(sharded) as b:
        assert a.tensors == b.tensors and len(a.files) >= 3


def test_single_file_wins_over_an_index_as_in_transformers(saved, tmp_path) -> None:
    directory = Path(shutil.copytree(saved["llama-sharded-fp32"], tmp_path / "both"))
    save_file({"only": torch.ones(3)}, directory / "model.safetensors", metadata={"format": "pt"})
    with open_hf_checkpoint(directory) as ckpt:
        assert ckpt.files == ["model.safetensors"] and list(ckpt.tensors) == ["only"]


def test_symlinked_files_are_followed(saved, tmp_path) -> None:
    """The Hugging Face cache links snapshot files to blobs elsewhere."""
    source = saved["llama-sharded-fp32"]
    directory = tmp_path / "snapshot"
    directory.mkdir()
    for file in source.iterdir():
        (directory / file.name).symlink_to(file)
    reference = oracle(source)
    with open_hf_checkpoint(directory) as ckpt:
        dest = torch.empty(10)
        ckpt.read_range("model.norm.weight", 0, 10, dest)
        assert torch.equal(dest, reference["model.norm.weight"][:10])
        assert ckpt.tensors == {n: (t.dtype, tuple(t.shape)) for n, t in reference.items()}


def test_check_shape_names_tensor_shapes_and_file(sharded) -> None:
    name = "model.layers.0.mlp.gate_proj.weight"
    file = weight_map(sharded)[name]
    with open_hf_checkpoint(sharded) as ckpt:
        ckpt.check_shape(name, (48, 32))
        ckpt.check_shapes({name: [48, 32], "not.stored": [1]})
        with pytest.raises(
            CheckpointError,
            match=rf"'{name}' has shape \[48, 32\] in .*{file}, the model expects "
            r"\[32, 48\]",
        ):
            ckpt.check_shape(name, (32, 48))
        with pytest.raises(CheckpointError, match=r"no tensor 'not\.stored'"):
            ckpt.check_shape("not.stored", (1,))


def test_caller_errors(single, tmp_path) -> None:
    with open_hf_checkpoint(single) as ckpt:
        with pytest.raises(CheckpointError, match=r"has no tensor 'nope'"):
            ckpt.read_range("nope", 0, 1, torch.empty(1))
        with pytest.raises(ValueError, match=r"outside tensor 'model\.norm\.weight' \(32 elements\)"):
            ckpt.read_range("model.norm.weight", 30, 33, torch.empty(3))
        with pytest.raises(ValueError, match=r"needs a 1-D destination of 4 elements"):
            ckpt.read_range("model.norm.weight", 0, 4, torch.empty(2, 2))
        with pytest.raises(
            CheckpointError,
            match=r"'model\.norm\.weight' in .*model\.safetensors is float32; it "
            r"cannot be loaded into torch\.int64",
        ):
            ckpt.read_range("model.norm.weight", 0, 4, torch.empty(4, dtype=torch.long))
    with pytest.raises(ValueError, match="is closed"):
        ckpt.read_range("model.norm.weight", 0, 4, torch.empty(4))


@pytest.mark.parametrize("layout", ["llama-single-fp32", "llama-single-bf16"])  # read in place; cast
def test_parameter_destination_is_filled_in_place(saved, layout) -> None:
    param = torch.nn.Parameter(torch.zeros(32))
    with open_hf_checkpoint(saved[layout]) as ckpt:
        ckpt.read_range("model.norm.weight", 0, 32, param)
    stored = load_file(saved[layout] / "model.safetensors")["model.norm.weight"]
    assert torch.equal(param.detach(), stored.float()) and param.requires_grad


# --------------------------------------------------------------------------- bad input


def shard_holding(directory: Path, name: str) -> str:
    return weight_map(directory)[name]


def test_missing_shard_file(sharded) -> None:
    file = shard_holding(sharded, "model.norm.weight")
    (sharded / file).unlink()
    with pytest.raises(CheckpointError, match=rf"safetensors file .*{file} is missing"):
        open_hf_checkpoint(sharded)


def move_shard_outside(directory: Path, name: str, new_name: Callable[[Path], str]) -> str:
    """Move the shard holding ``name`` out of ``directory`` and point its tensors at it via
    ``new_name(moved path)``: without the name check this would load fine."""
    file = shard_holding(directory, name)
    moved = directory.parent / "outside.safetensors"
    os.replace(directory / file, moved)
    edit_index(directory, lambda wm: wm.update({k: new_name(moved) for k, v in wm.items() if v == file}))
    return file


def test_index_path_traversal_is_refused(sharded) -> None:
    move_shard_outside(sharded, "model.norm.weight", lambda moved: "../outside.safetensors")
    with pytest.raises(
        CheckpointError,
        match=r"index .*: tensor '.*': file name '\.\./outside\.safetensors' "
        r"contains '\.\.'",
    ):
        open_hf_checkpoint(sharded)


def test_index_absolute_path_is_refused(sharded) -> None:
    move_shard_outside(sharded, "model.norm.weight", lambda moved: str(moved.resolve()))
    with pytest.raises(CheckpointError, match=r"file name '/.*outside\.safetensors' is absolute"):
        open_hf_checkpoint(sharded)


def test_index_subdirectory_name_is_refused(sharded) -> None:
    file = shard_holding(sharded, "model.norm.weight")
    (sharded / "sub").mkdir()
    os.replace(sharded / file, sharded / "sub" / file)
    edit_index(sharded, lambda wm: wm.update({k: f"sub/{file}" for k, v in wm.items() if v == file}))
    with pytest.raises(CheckpointError, match=rf"file name 'sub/{file}' is not a plain file name"):
        open_hf_checkpoint(sharded)


def test_tensor_listed_in_a_file_that_lacks_it(sharded) -> None:
    name = "model.norm.weight"
    other = next(f for f in set(weight_map(sharded).values()) if f != shard_holding(sharded, name))
    edit_index(sharded, lambda wm: wm.update({name: other}))
    with pytest.raises(CheckpointError, match=rf"lists tensor '{name}' in .*{other}, which does not hold it"):
        open_hf_checkpoint(sharded)


def test_tensor_stored_in_two_files(sharded) -> None:
    name = "model.norm.weight"
    first = shard_holding(sharded, name)
    other = next(f for f in sorted(set(weight_map(sharded).values())) if f != first)
    tensors = load_file(sharded / other)
    tensors[name] = torch.ones(32)
    save_file(tensors, sharded / other, metadata={"format": "pt"})
    a, b = sorted([first, other])
    with pytest.raises(CheckpointError, match=rf"tensor '{name}' is stored twice: in .*{a} and in .*{b}"):
        open_hf_checkpoint(sharded)


def test_truncated_file_names_the_tensor_past_the_end(sharded) -> None:
    file = shard_holding(sharded, "model.norm.weight")
    header, _ = header_of(sharded / file)
    last = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][1])
    os.truncate(sharded / file, (sharded / file).stat().st_size - 4)
    with pytest.raises(CheckpointError, match=rf"{file}: tensor '{last}' has data_offsets .* outside the file's"):
        open_hf_checkpoint(sharded)


def test_file_truncated_inside_its_header(sharded) -> None:
    file = shard_holding(sharded, "model.norm.weight")
    os.truncate(sharded / file, 40)
    with pytest.raises(
        CheckpointError,
        match=rf"{file} is truncated or not a safetensors file: its header of "
        r"\d+ bytes ends past the end of the file \(40 bytes\)",
    ):
        open_hf_checkpoint(sharded)
    os.truncate(sharded / file, 5)
    with pytest.raises(CheckpointError, match=rf"{file} is truncated or not a safetensors file \(5 bytes\)"):
        open_hf_checkpoint(sharded)


def test_absurd_header_length_is_refused_before_reading_it(tmp_path) -> None:
    """A sparse file large enough to hold the claimed header: only the size cap refuses it."""
    path = tmp_path / "model.safetensors"
    with open(path, "wb") as f:
        f.write((MAX_HEADER_BYTES + 1).to_bytes(8, "little"))
        f.truncate(8 + MAX_HEADER_BYTES + 1024)
    with pytest.raises(
        CheckpointError,
        match=rf"{path} has a header length of {MAX_HEADER_BYTES + 1} bytes, "
        "over the .* bytes limit",
    ):
        open_hf_checkpoint(tmp_path)
    write_raw(path, {}, b"", length=2**63)
    with pytest.raises(CheckpointError, match=r"header length of 9223372036854775808 bytes"):
        open_hf_checkpoint(tmp_path)


# (header, data bytes, message after the file name): each header broken in one way
BAD_HEADERS = {
    "unknown dtype": (
        {"w": {"dtype": "F7", "shape": [2], "data_offsets": [0, 8]}},
        8,
        r": tensor 'w' has an unknown dtype 'F7'",
    ),
    "offsets past the end": (
        {"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}},
        8,
        r": tensor 'w' has data_offsets \[0, 16\) outside the file's 8 data bytes",
    ),
    "offsets reversed": (
        {"w": {"dtype": "F32", "shape": [0], "data_offsets": [8, 4]}},
        8,
        r": tensor 'w' has data_offsets \[8, 4\) outside",
    ),
    "offsets inconsistent with shape": (
        {"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}},
        8,
        r": tensor 'w' has data_offsets \[0, 8\) \(8 bytes\), but shape \[3\] of "
        r"float32 needs 12 bytes",
    ),
    "negative dimension": (
        {"w": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}},
        8,
        r": tensor 'w' has an invalid shape \[-2\]",
    ),
    "boolean dimension": (
        {"w": {"dtype": "F32", "shape": [True], "data_offsets": [0, 4]}},
        4,
        r": tensor 'w' has an invalid shape \[True\]",
    ),
    "one offset": (
        {"w": {"dtype": "F32", "shape": [1], "data_offsets": [4]}},
        4,
        r": tensor 'w' has invalid data_offsets \[4\]",
    ),
    "entry not an object": ({"w": [1, 2]}, 0, r": tensor 'w' has a header entry that is not an object"),
    "gap": (
        {
            "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
            "w": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]},
        },
        12,
        r": the data of tensor 'w' starts at byte 8 and leaves bytes \[4, 8\) unused",
    ),
    "overlap": (
        {
            "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
            "w": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]},
        },
        8,
        r": the data of tensor 'w' starts at byte 4 and overlaps the tensor before it",
    ),
    "trailing bytes": (
        {"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}},
        12,
        r" has 8 bytes after the last tensor's data",
    ),
    "metadata not strings": (
        {"__metadata__": {"format": 1}, "w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}},
        4,
        r": '__metadata__' must map names to strings",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_HEADERS))
def test_bad_header(tmp_path, case) -> None:
    header, data_bytes, message = BAD_HEADERS[case]
    path = write_raw(tmp_path / "model-00001-of-00001.safetensors", header, b"\0" * data_bytes)
    with pytest.raises(CheckpointError, match=rf"safetensors file .*{re.escape(path.name)}{message}"):
        open_hf_checkpoint(path)


def safetensors_accepts(path: Path) -> bool:
    try:
        with safe_open(path, "pt") as f:
            [f.get_tensor(k) for k in f.keys()]
        return True
    except Exception:  # noqa: BLE001 -- any refusal counts
        return False


@pytest.mark.parametrize("case", sorted(BAD_HEADERS))
def test_bad_headers_are_refused_by_safetensors_too(tmp_path, case) -> None:
    """The header rules are safetensors' own (so nothing safe_open opens is refused here);
    a good header written the same way is accepted, so the helper can tell them apart."""
    header, data_bytes, _ = BAD_HEADERS[case]
    assert not safetensors_accepts(write_raw(tmp_path / "bad.safetensors", header, b"\0" * data_bytes))
    good = {"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
    assert safetensors_accepts(write_raw(tmp_path / "good.safetensors", good, b"\0" * 8))


def test_header_not_json_or_not_an_object(tmp_path) -> None:
    path = tmp_path / "model.safetensors"
    path.write_bytes((4).to_bytes(8, "little") + b"{x: " + b"\0" * 4)
    with pytest.raises(CheckpointError, match=rf"{path} has a header that is not valid JSON"):
        open_hf_checkpoint(tmp_path)
    write_raw(path, [1], b"")
    with pytest.raises(CheckpointError, match=rf"{path} has a header that is not a JSON object"):
        open_hf_checkpoint(tmp_path)
    raw = (
        b'{"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, '
        b'"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}'
    )
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + b"\0" * 4)
    with pytest.raises(CheckpointError, match=r"not valid JSON: key 'w' appears twice"):
        open_hf_checkpoint(tmp_path)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda text: "{not json", r"is not valid JSON"),
        (lambda text: json.dumps({"metadata": {}}), r"is not a JSON object with a 'weight_map' object"),
        (lambda text: json.dumps([1]), r"is not a JSON object with a 'weight_map' object"),
        (
            lambda text: json.dumps({"metadata": 3, "weight_map": json.loads(text)["weight_map"]}),
            r"'metadata' is not an object",
        ),
        (
            lambda text: json.dumps({"weight_map": {"model.norm.weight": 7}}),
            r"tensor 'model\.norm\.weight': file "
            r"name 7 is not a string",
        ),
        (
            lambda text: text.replace('"weight_map": {', '"weight_map": {"model.norm.weight": "x", ', 1),
            r"not valid JSON: key 'model\.norm\.weight' appears twice",
        ),
    ],
)
def test_bad_index(sharded, change, message) -> None:
    index = sharded / "model.safetensors.index.json"
    index.write_text(change(index.read_text()))
    with pytest.raises(CheckpointError, match=rf"index {index}.*{message}"):
        open_hf_checkpoint(sharded)


def raises_without_blocking(action: Callable[[], object], fifo: Path) -> BaseException | None:
    """Run ``action`` in a thread; if it blocks (opening the FIFO for reading), open the
    FIFO's write end to release it and fail the test instead of hanging."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            action()
            outcome.append(None)
        except BaseException as error:  # noqa: BLE001 -- handed to the test
            outcome.append(error)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout=20)
    if thread.is_alive():
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # a reader is waiting: release it
        thread.join(timeout=20)
        pytest.fail(f"opening the checkpoint blocked on the FIFO {fifo}")
    return outcome[0]


@pytest.mark.parametrize("where", ["shard", "index", "single"])
def test_fifo_is_refused_without_blocking(sharded, single, where) -> None:
    directory = single if where == "single" else sharded
    fifo = (
        directory
        / {
            "shard": shard_holding(sharded, "model.norm.weight"),
            "index": "model.safetensors.index.json",
            "single": "model.safetensors",
        }[where]
    )
    fifo.unlink()
    os.mkfifo(fifo)
    error = raises_without_blocking(lambda: open_hf_checkpoint(directory), fifo)
    assert isinstance(error, CheckpointError) and f"{fifo} is not a regular file (a FIFO)" in str(error), error


def test_directory_in_place_of_a_shard(sharded) -> None:
    file = shard_holding(sharded, "model.norm.weight")
    (sharded / file).unlink()
    (sharded / file).mkdir()
    with pytest.raises(CheckpointError, match=rf"{file} is not a regular file \(a directory\)"):
        open_hf_checkpoint(sharded)


def test_directory_without_a_checkpoint(tmp_path) -> None:
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(
        CheckpointError,
        match=rf"{tmp_path} holds neither model\.safetensors nor "
        r"model\.safetensors\.index\.json",
    ):
        open_hf_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match=r"checkpoint .*nowhere does not exist"):
        open_hf_checkpoint(tmp_path / "nowhere")


def test_file_changed_after_opening(sharded) -> None:
    name = "model.norm.weight"
    file = sharded / shard_holding(sharded, name)
    with open_hf_checkpoint(sharded) as ckpt:
        os.truncate(file, file.stat().st_size - 4)
        with pytest.raises(CheckpointError, match=rf"{file} changed after the checkpoint was opened"):
            ckpt.read_range(name, 0, 32, torch.empty(32))


# --------------------------------------------------------------------------- missing and unexpected keys


def tied_aliases(model: torch.nn.Module) -> dict[str, str]:
    """alias -> canonical name for parameters that are one tensor (as shardpar's engines find them)."""
    first: dict[int, str] = {}
    aliases = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            aliases[name] = first[id(param)]
        else:
            first[id(param)] = name
    return aliases


def doctored(source: Path, target: Path, change: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    target.mkdir()
    shutil.copy(source / "config.json", target / "config.json")
    tensors = load_file(source / "model.safetensors")
    change(tensors)
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    return target


def reports(directory: Path, build: Callable[[], transformers.PreTrainedModel]) -> tuple[tuple, tuple]:
    """(transformers' report, ours), each (missing set, unexpected set)."""
    model = build()
    _, info = type(model).from_pretrained(directory, output_loading_info=True)
    theirs = (set(info["missing_keys"]), set(info["unexpected_keys"]))
    ignore_missing, ignore_unexpected = hf_ignore_patterns(model)
    with open_hf_checkpoint(directory) as ckpt:
        ours = match_keys(
            ckpt.tensors,
            model.state_dict().keys(),
            tied_aliases(model),
            ignore_missing=ignore_missing,
            ignore_unexpected=ignore_unexpected,
        )
    return theirs, (set(ours.missing_keys), set(ours.unexpected_keys))


EMBED = "model.embed_tokens.weight"


def drop_one_add_two(t: dict[str, torch.Tensor]) -> None:
    del t["model.layers.0.mlp.up_proj.weight"]
    t.update({"extra.weight": torch.ones(2), "model.layers.1.foo.bias": torch.ones(2)})


def store_buffers(t: dict[str, torch.Tensor]) -> None:
    # the first two are excused by transformers' inv_freq pattern, the third is not
    t.update(
        {
            "model.rotary_emb.inv_freq": torch.ones(4),
            "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(4),
            "model.rotary_emb.original_inv_freq": torch.ones(4),
        }
    )


def gpt2_old_mask_no_embedding(t: dict[str, torch.Tensor]) -> None:
    del t["transformer.wte.weight"]  # lm_head.weight is tied to it and not stored either
    t["transformer.h.0.attn.bias"] = torch.ones(1)  # excused by GPT-2's _keys_to_ignore_on_load_unexpected


KEY_CASES = {
    # case: (source checkpoint, model, change to the stored tensors, transformers' (missing, unexpected))
    "one removed, two extra": (
        "llama",
        llama,
        drop_one_add_two,
        ({"model.layers.0.mlp.up_proj.weight"}, {"extra.weight", "model.layers.1.foo.bias"}),
    ),
    "tied: only lm_head stored": ("llama", llama, lambda t: t.update({"lm_head.weight": t.pop(EMBED)}), (set(), set())),
    "tied: both stored, equal": (
        "llama",
        llama,
        lambda t: t.update({"lm_head.weight": t[EMBED].clone()}),
        (set(), set()),
    ),
    "tied: neither stored": ("llama", llama, lambda t: t.pop(EMBED), ({EMBED, "lm_head.weight"}, set())),
    "untied: lm_head removed": (
        "untied",
        lambda: llama(tied=False),
        lambda t: t.pop("lm_head.weight"),
        ({"lm_head.weight"}, set()),
    ),
    "non-persistent buffers stored": ("llama", llama, store_buffers, (set(), {"model.rotary_emb.original_inv_freq"})),
    "gpt2: old mask stored, tied embedding removed": (
        "gpt2",
        gpt2,
        gpt2_old_mask_no_embedding,
        ({"transformer.wte.weight", "lm_head.weight"}, set()),
    ),
}


@pytest.fixture(scope="module")
def key_sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("keys")
    builders = {"llama": llama, "untied": lambda: llama(tied=False), "gpt2": gpt2}
    for name, build in builders.items():
        build().save_pretrained(root / name)
    return {name: root / name for name in builders}


@pytest.mark.parametrize("case", list(KEY_CASES))
def test_missing_and_unexpected_keys_equal_transformers(key_sources, tmp_path, case) -> None:
    source, build, change, expected = KEY_CASES[case]
    directory = doctored(key_sources[source], tmp_path / "doctored", change)
    theirs, ours = reports(directory, build)
    assert theirs == expected  # the case tests what it says (transformers agrees)
    assert ours == theirs


def test_ignore_patterns_are_what_excuses_stored_buffers(key_sources, tmp_path) -> None:
    """Without transformers' patterns, stored non-persistent buffers are unexpected: the
    patterns, not the key matching, excuse them."""
    directory = doctored(
        key_sources["llama"], tmp_path / "d", lambda t: t.update({"model.rotary_emb.inv_freq": torch.ones(4)})
    )
    model = llama()
    with open_hf_checkpoint(directory) as ckpt:
        report = match_keys(ckpt.tensors, model.state_dict().keys(), tied_aliases(model))
    assert report.unexpected_keys == ["model.rotary_emb.inv_freq"] and report.missing_keys == []
    assert hf_ignore_patterns(torch.nn.Linear(2, 2)) == ([], [])


def test_tied_groups_of_three_and_chains() -> None:
    """Any stored member of a tied group provides all of them (transformers resolves chains
    to one source and ties symmetrically)."""
    model = ["a", "b", "c", "d"]
    aliases = {"b": "a", "c": "b"}
    assert match_keys(["c", "d"], model, aliases) == ([], [])
    assert match_keys(["d"], model, aliases) == (["a", "b", "c"], [])
    assert match_keys(["a", "x", "d"], model, aliases, ignore_unexpected=[r"^y"]) == ([], ["x"])
    assert match_keys(["a", "x"], model, aliases, ignore_missing=[r"^d$"], ignore_unexpected=[r"x"]) == ([], [])
    # model keys without their aliases (shardpar's stored names): a stored alias is still expected
    assert match_keys(["b", "d"], ["a", "d"], {"b": "a"}) == ([], [])
