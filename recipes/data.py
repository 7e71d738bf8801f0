"""Character-level text that every Python installation already has: standard-library docstrings.

The corpus is the docstrings (``inspect.getdoc``) of a fixed, sorted list of pure-Python
standard-library modules and of the public classes, functions and methods they define. It is
real English prose (with some code), about 0.6 MB, needs no download, and is identical on every
machine with the same Python version. Nothing is cached on disk; building it takes well under a
second.

[Note: global batches and ranks]
Every optimizer step ``step`` has one *global* batch of ``global_batch_size`` windows, drawn from
a generator seeded only by ``(seed, split, step)``. Rank ``r`` of ``world_size`` takes the
contiguous rows ``[r * B / W, (r + 1) * B / W)`` of it. Hence the rows of all ranks, concatenated
in rank order, are exactly the batch a single process (``rank=0, world_size=1``) gets for the same
step. That is what makes an N-rank run match single-process training step for step (gradients
are averaged over the same global batch), and lets a run resume at a different world size
without replaying or skipping data: the batch depends on the step, not on who reads it.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib
import inspect
import unicodedata
import warnings
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "VOCAB",
    "VOCAB_SIZE",
    "encode",
    "decode",
    "build_corpus",
    "CharDataset",
    "load_dataset",
]

# A fixed vocabulary (newline + printable ASCII) so that the model's vocab_size does not depend
# on the text, and a checkpoint's embedding always means the same characters.
VOCAB: str = "\n" + "".join(chr(c) for c in range(32, 127))
VOCAB_SIZE: int = len(VOCAB)  # 96
_STOI: dict[str, int] = {ch: i for i, ch in enumerate(VOCAB)}

# Pure-Python modules present in every CPython build (no tkinter/ssl/sqlite3, which some builds
# lack), so the corpus is the same wherever this Python version runs. Kept sorted.
CORPUS_MODULES: tuple[str, ...] = (
    "abc",
    "argparse",
    "ast",
    "asyncio",
    "base64",
    "bisect",
    "calendar",
    "cmd",
    "codecs",
    "collections",
    "configparser",
    "contextlib",
    "copy",
    "csv",
    "dataclasses",
    "datetime",
    "decimal",
    "difflib",
    "email",
    "enum",
    "fnmatch",
    "fractions",
    "ftplib",
    "functools",
    "getopt",
    "gettext",
    "glob",
    "gzip",
    "heapq",
    "hmac",
    "html",
    "http.client",
    "http.server",
    "imaplib",
    "inspect",
    "io",
    "ipaddress",
    "json",
    "locale",
    "logging",
    "mailbox",
    "mimetypes",
    "numbers",
    "operator",
    "optparse",
    "os",
    "pathlib",
    "pdb",
    "pickle",
    "pkgutil",
    "platform",
    "plistlib",
    "pprint",
    "queue",
    "random",
    "re",
    "sched",
    "secrets",
    "selectors",
    "shelve",
    "shlex",
    "shutil",
    "smtplib",
    "socketserver",
    "statistics",
    "string",
    "struct",
    "subprocess",
    "tarfile",
    "tempfile",
    "textwrap",
    "threading",
    "timeit",
    "tokenize",
    "trace",
    "traceback",
    "typing",
    "unittest",
    "urllib.parse",
    "urllib.request",
    "uuid",
    "warnings",
    "wave",
    "weakref",
    "xml.dom.minidom",
    "zipfile",
)


def _normalise(text: str) -> str:
    """Map text onto VOCAB: tabs to spaces, accents stripped, anything else non-ASCII dropped."""
    text = unicodedata.normalize("NFKD", text.expandtabs(4))
    return "".join(ch for ch in text if ch in _STOI)


def encode(text: str) -> torch.Tensor:
    """Text -> 1-D int64 tensor of ids; characters outside VOCAB are normalised away first."""
    return torch.tensor([_STOI[ch] for ch in _normalise(text)], dtype=torch.long)


def decode(ids: torch.Tensor | list[int]) -> str:
    """Ids -> text (the inverse of :func:`encode` on VOCAB characters)."""
    if isinstance(ids, torch.Tensor):
        ids = ids.tolist()
    return "".join(VOCAB[i] for i in ids)


def _docstrings(module_name: str) -> list[str]:
    """Docstrings of a module and of what it defines itself, in sorted-name order."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a deprecated module is still good text
        module = importlib.import_module(module_name)
    docs = [inspect.getdoc(module)]
    replaced = _functions_replaced_at_run_time(module)
    for name in sorted(set(vars(module)) | set(replaced)):
        if name in replaced:  # the module's own function, whatever replaced it in this process
            docs.append(replaced[name])
            continue
        obj = vars(module)[name]
        # Only objects defined here: re-exports would repeat another module's text.
        if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
            continue
        if inspect.isfunction(obj):
            docs.append(inspect.getdoc(obj))
        elif inspect.isclass(obj):
            docs.append(inspect.getdoc(obj))
            # Methods defined here too: a library imported earlier may have added its own to a
            # standard class (transformers adds logging.Logger.warning_advice), and the corpus
            # must not depend on what the process imported before.
            docs.extend(
                inspect.getdoc(member)
                for member_name, member in sorted(vars(obj).items())
                if not member_name.startswith("_")
                and inspect.isfunction(member)
                and member.__module__ == module.__name__
            )
    return [d for d in docs if d]


def _functions_replaced_at_run_time(module: Any) -> dict[str, str]:
    """Docstrings, from the source, of public functions the module defines but that another
    module replaced in this process (``logging.captureWarnings`` replaces
    ``warnings.showwarning``): the corpus must not depend on what ran before."""
    try:
        tree = ast.parse(inspect.getsource(module))
    except (OSError, TypeError, SyntaxError):
        return {}
    out = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
            current = getattr(module, node.name, None)
            if getattr(current, "__module__", module.__name__) != module.__name__:
                doc = ast.get_docstring(node)
                if doc:
                    out[node.name] = doc
    return out


@functools.lru_cache(maxsize=1)
def build_corpus() -> str:
    """The full corpus text, already normalised to VOCAB (deterministic per Python version)."""
    return _normalise("\n\n".join(doc for name in CORPUS_MODULES for doc in _docstrings(name)))


def _generator(seed: int, split: str, step: int) -> torch.Generator:
    """A generator that depends only on (seed, split, step): no state carried between steps."""
    digest = hashlib.sha256(f"{seed}/{split}/{step}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))


@dataclass
class CharDataset:
    """Train/val token streams plus the per-rank batch sampler described in the module note."""

    train: torch.Tensor
    """1-D int64 ids, the first ``1 - val_fraction`` of the corpus."""
    val: torch.Tensor
    """1-D int64 ids, the rest (contiguous, so validation text is unseen in training)."""

    @classmethod
    def from_text(cls, text: str, val_fraction: float = 0.1) -> CharDataset:
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
        ids = encode(text)
        n_train = int(len(ids) * (1.0 - val_fraction))
        return cls(train=ids[:n_train], val=ids[n_train:])

    def get_batch(
        self,
        step: int,
        global_batch_size: int,
        block_size: int,
        rank: int,
        world_size: int,
        seed: int,
        split: str = "train",
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's ``(x, y)`` slice of the global batch for ``step``; both (B / W, block_size).

        Deterministic in ``(seed, split, step)``: concatenating the results of ranks
        ``0..world_size-1`` gives exactly ``get_batch(step, B, T, 0, 1, seed)``, so N-rank
        training sees the same data as one process, and a resumed run sees the same batches
        at any world size. ``y`` is ``x`` shifted left by one token.
        """
        if split not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world size {world_size}")
        if global_batch_size % world_size:
            raise ValueError(
                f"global batch size {global_batch_size} is not divisible by world size "
                f"{world_size}; change --batch-size"
            )
        data = self.train if split == "train" else self.val
        if len(data) <= block_size:
            raise ValueError(f"{split} split has {len(data)} tokens, too few for block size {block_size}")
        # Draw the whole global batch on every rank (B integers: cheap), then keep our rows.
        starts = torch.randint(len(data) - block_size, (global_batch_size,), generator=_generator(seed, split, step))
        per_rank = global_batch_size // world_size
        starts = starts[rank * per_rank : (rank + 1) * per_rank]
        windows = data[starts[:, None] + torch.arange(block_size + 1)]  # (B / W, T + 1)
        return windows[:, :-1], windows[:, 1:]


@functools.lru_cache(maxsize=1)
def load_dataset() -> CharDataset:
    """The standard-library docstring corpus, split 90/10 into train/val."""
    return CharDataset.from_text(build_corpus())
