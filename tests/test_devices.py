"""Devices bound right (issue 31): which device a rank trains on, and a model on the wrong one
refused on every rank.

Everything runs on CPU with gloo. CUDA is faked where the logic needs it: ``torch.cuda``'s
``is_available``, ``device_count``, ``current_device``, ``set_device`` and ``device`` (the
context manager) are replaced by :class:`FakeCuda`, a model "on a GPU" is a CPU model whose
device ``shardpar.wrap`` is told (``module_device``), and a group "running NCCL" is a gloo
group whose ``dist.get_backend_config`` says so (shardpar's collectives read
``dist.get_backend``, so they still run on gloo). Wrap-level tests stop at ``build_engine``,
which would allocate on the fake GPU.

- ``parse_backends`` reads mixed strings (``"cpu:gloo,cuda:nccl"``) and single names by
  what torch says each backend serves.
- ``rank_device`` follows the group's ``device_id``, then ``set_device``, then
  ``LOCAL_RANK``, and gives every rank ``cuda:0`` when each sees one GPU.
- ``check_module_device`` refuses a model on another GPU than the rank's, and a model whose
  device type the group has no backend for, naming both devices, the rank and the fix.
- A meta-built model is placed on ``cuda:LOCAL_RANK``: when wrap creates the group, and on a
  group the script made without ``set_device`` (on main before this change: ``cuda:0``
  on every rank, as the device was read before LOCAL_RANK was applied).
- The wrap agreement gathers its objects on the rank's GPU, not ``cuda:0`` (on main:
  ``cuda:0`` on every rank of a group made without ``set_device``).
- ``model.cuda()`` before ``set_device`` (every rank on ``cuda:0``) and a CPU model with an
  NCCL group are ValueErrors on every rank (on main: no error at wrap); one visible GPU per
  rank is not.
"""

from __future__ import annotations

import importlib
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import shardpar
from shardpar.comm import collectives as C
from shardpar.comm import devices as D
from tests.support.harness import run_ranks

wrap_module = importlib.import_module("shardpar.wrap")  # the module; shardpar.wrap is the function

SHORT = 60.0  # seconds: wrap-time checks take milliseconds; only a hang gets near this


class FakeCuda:
    """``torch.cuda`` as a process with ``count`` GPUs sees it; ``current`` is what
    ``set_device`` and ``torch.cuda.device`` change."""

    def __init__(self, mp: pytest.MonkeyPatch, count: int, current: int = 0) -> None:
        self.count, self.current = count, current
        self.set_calls: list[int] = []
        fake = self

        class _DeviceContext:  # torch.cuda.device(d): d current inside the block
            def __init__(self, device: Any) -> None:
                self.index = torch.device(device).index if not isinstance(device, int) else device

            def __enter__(self) -> None:
                self.previous, fake.current = fake.current, self.index

            def __exit__(self, *exc: Any) -> None:
                fake.current = self.previous

        mp.setattr(torch.cuda, "is_available", lambda: count > 0)
        mp.setattr(torch.cuda, "device_count", lambda: count)
        mp.setattr(torch.cuda, "current_device", lambda: fake.current)
        mp.setattr(torch.cuda, "set_device", self._set_device)
        mp.setattr(torch.cuda, "device", _DeviceContext)

    def _set_device(self, device: Any) -> None:
        index = device if isinstance(device, int) else torch.device(device).index
        assert 0 <= index < self.count, f"set_device({device}) with {self.count} GPU(s) visible"
        self.set_calls.append(index)
        self.current = index


class Stop(Exception):
    """Raised by the stand-in for ``build_engine``: wrap got as far as building the engine."""


def _stop_at_engine(mp: pytest.MonkeyPatch, seen: dict[str, Any]) -> None:
    """Record where a wrap would build the engine (and materialise a meta model), then stop."""

    def build_engine(
        module: nn.Module, config: Any, group: Any, deferred_init: Any = None, sharding: Any = None
    ) -> Any:
        seen["engine_device"] = deferred_init.device if deferred_init is not None else None
        raise Stop

    def materialise_whole(module: nn.Module, init_fn: Any, group: Any, device: Any = None) -> None:
        # Before this change wrap called it without a device, and it read the device itself.
        seen["materialised_on"] = device if device is not None else shardpar.core.deferred_init.target_device()

    mp.setattr(wrap_module, "build_engine", build_engine)
    mp.setattr(wrap_module, "materialise_whole", materialise_whole)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def _meta_mlp() -> nn.Module:
    with torch.device("meta"):
        return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


_TRUE_BACKEND_CONFIG = dist.get_backend_config


def _reports(mp: pytest.MonkeyPatch, config: str) -> None:
    """The group reports ``config`` as its backends (shardpar's collectives still run gloo)."""
    mp.setattr(dist, "get_backend_config", lambda group=None: config)


# --------------------------------------------------------------------------- backends


@pytest.mark.parametrize(
    "text, served",
    [
        ("cpu:gloo,cuda:nccl", {"cpu": "gloo", "cuda": "nccl"}),
        (" CPU:Gloo , CUDA:NCCL ", {"cpu": "gloo", "cuda": "nccl"}),
        ("cuda:nccl", {"cuda": "nccl"}),
        ("nccl", {"cuda": "nccl"}),
        ("gloo", {"cpu": "gloo", "cuda": "gloo"}),
        ("undefined", {}),
    ],
)
def test_backend_strings_are_read_per_device_type(text: str, served: dict[str, str]) -> None:
    assert D.parse_backends(text) == served


def test_a_mixed_group_runs_nccl_for_cuda_and_gloo_for_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    _reports(monkeypatch, "cpu:gloo,cuda:nccl")
    assert D.group_backend(None, "cuda") == "nccl"
    assert D.group_backend(None, "cpu") == "gloo"
    # A torch without get_backend_config: the name dist.get_backend gives is read the same way.
    monkeypatch.delattr(dist, "get_backend_config")
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    assert D.group_backend(None, "cuda") == "nccl"
    assert D.group_backend(None, "cpu") is None


# --------------------------------------------------------------------------- a rank's device


@pytest.mark.parametrize(
    "count, current, local, bound, expected",
    [
        (4, 0, "1", None, 1),  # torchrun, no set_device: LOCAL_RANK
        (4, 2, "1", None, 2),  # the script's set_device wins over LOCAL_RANK
        (4, 0, "1", torch.device("cuda", 3), 3),  # so does the group's device_id
        (1, 0, "1", None, 0),  # one visible GPU per rank: every rank's cuda:0
        (2, 0, None, None, 0),  # no launcher: the current device
    ],
)
def test_the_rank_device_follows_device_id_then_set_device_then_local_rank(
    monkeypatch: pytest.MonkeyPatch,
    count: int,
    current: int,
    local: str | None,
    bound: torch.device | None,
    expected: int,
) -> None:
    FakeCuda(monkeypatch, count, current)
    if local is None:
        monkeypatch.delenv("LOCAL_RANK", raising=False)
    else:
        monkeypatch.setenv("LOCAL_RANK", local)
    monkeypatch.setattr(D, "bound_device", lambda group=None: bound)
    assert D.rank_device().device == torch.device("cuda", expected)


def test_without_a_gpu_the_rank_device_is_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    FakeCuda(monkeypatch, 0)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert D.rank_device().device == torch.device("cpu")


# --------------------------------------------------------------------------- the check


def test_a_model_on_another_gpu_than_the_rank_s_is_refused_naming_both() -> None:
    expected = D.RankDevice(torch.device("cuda", 1), "LOCAL_RANK=1")
    with pytest.raises(ValueError) as error:
        D.check_module_device(
            torch.device("cuda", 0),
            rank=1,
            expected=expected,
            backends=D.parse_backends("nccl"),
            backend_text="cuda:nccl",
        )
    message = str(error.value)
    for fragment in ("rank 1", "cuda:0", "cuda:1", "LOCAL_RANK=1", "torch.cuda.set_device"):
        assert fragment in message, message


def test_one_visible_gpu_per_rank_is_not_refused() -> None:
    # CUDA_VISIBLE_DEVICES per rank: every rank's model and device are its own cuda:0.
    expected = D.RankDevice(torch.device("cuda", 0), "the only GPU visible to this rank")
    D.check_module_device(torch.device("cuda", 0), rank=3, expected=expected, backends=D.parse_backends("nccl"))


@pytest.mark.parametrize("config", ["nccl", "cuda:nccl"])
def test_a_cpu_model_with_an_nccl_group_is_refused(config: str) -> None:
    expected = D.RankDevice(torch.device("cuda", 1), "LOCAL_RANK=1")
    with pytest.raises(ValueError) as error:
        D.check_module_device(
            torch.device("cpu"), rank=1, expected=expected, backends=D.parse_backends(config), backend_text=config
        )
    message = str(error.value)
    for fragment in ("rank 1", "on cpu", config, "cuda", "model.to('cuda:1')", "gloo"):
        assert fragment in message, message


def test_a_cuda_model_with_a_cpu_only_group_is_refused() -> None:
    expected = D.RankDevice(torch.device("cuda", 0), "torch.cuda.current_device()")
    with pytest.raises(ValueError, match=r"cuda:0.*'cpu:gloo' serves only cpu.*nccl"):
        D.check_module_device(
            torch.device("cuda", 0),
            rank=0,
            expected=expected,
            backends=D.parse_backends("cpu:gloo"),
            backend_text="cpu:gloo",
        )


@pytest.mark.parametrize(
    "device, config",
    [
        ("cpu", "cpu:gloo,cuda:nccl"),
        ("cuda:1", "cpu:gloo,cuda:nccl"),
        ("cpu", "gloo"),
        ("meta", "nccl"),
        ("cpu", "undefined"),  # nothing known to check by
    ],
)
def test_models_the_group_can_serve_pass(device: str, config: str) -> None:
    expected = D.RankDevice(torch.device("cuda", 1), "LOCAL_RANK=1")
    D.check_module_device(torch.device(device), rank=1, expected=expected, backends=D.parse_backends(config))


@pytest.mark.parametrize(
    "config, device, expected",
    [
        ("cuda:nccl", torch.device("cuda", 1), torch.device("cuda", 1)),  # the engine's device
        ("cuda:nccl", None, torch.device("cuda", 1)),  # none given: the rank's (LOCAL_RANK)
        ("cpu:gloo,cuda:nccl", torch.device("cuda", 1), torch.device("cpu")),
        ("cpu:gloo,cuda:gloo", torch.device("cuda", 1), torch.device("cpu")),
    ],
)
def test_object_bytes_travel_on_the_cpu_or_the_engine_s_device(
    monkeypatch: pytest.MonkeyPatch, config: str, device: torch.device | None, expected: torch.device
) -> None:
    FakeCuda(monkeypatch, 2)  # current device 0, as in a script that never called set_device
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(D, "bound_device", lambda group=None: None)
    _reports(monkeypatch, config)
    assert D.object_device(None, device) == expected


# --------------------------------------------------------------------------- wrap, one process


@pytest.mark.parametrize("stage", [1, 3])
def test_a_meta_wrap_that_creates_the_group_trains_on_local_rank(monkeypatch: pytest.MonkeyPatch, stage: int) -> None:
    """Rank 1 of a torchrun job on a 2-GPU node, wrap creating the group. On main at stage 3 the
    device was read before the group (and set_device(LOCAL_RANK)) existed: cuda:0."""
    monkeypatch.setattr(dist, "is_initialized", lambda: False)  # as in a fresh process: wrap must create it
    cuda = FakeCuda(monkeypatch, 2)
    for name, value in {
        "WORLD_SIZE": "2",
        "RANK": "1",
        "LOCAL_RANK": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
    }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    created: dict[str, Any] = {}
    monkeypatch.setattr(dist, "init_process_group", lambda **kwargs: created.update(kwargs))
    seen: dict[str, Any] = {}
    _stop_at_engine(monkeypatch, seen)
    with pytest.raises(Stop):
        shardpar.wrap(_meta_mlp(), stage=stage)
    assert created["backend"] == "nccl" and created["device_id"] == torch.device("cuda", 1)
    assert cuda.set_calls == [1]
    placed = seen["engine_device"] if stage == 3 else seen["materialised_on"]
    assert placed == torch.device("cuda", 1)


# --------------------------------------------------------------------------- wrap, on ranks


def _meta_wrap_on_a_group_without_set_device(stage: int) -> str:
    """A gloo group the script made without set_device, two GPUs visible: where does a meta
    model go on this rank?"""
    with pytest.MonkeyPatch.context() as mp:
        FakeCuda(mp, 2)
        seen: dict[str, Any] = {}
        _stop_at_engine(mp, seen)
        try:
            shardpar.wrap(_meta_mlp(), stage=stage)
        except Stop:
            pass
        return str(seen["engine_device"] if stage == 3 else seen["materialised_on"])


@pytest.mark.parametrize("stage", [1, 3])
def test_a_meta_wrap_on_a_group_made_without_set_device_trains_on_local_rank(stage: int) -> None:
    # On main: cuda:0 on every rank (torch.cuda.current_device()).
    assert run_ranks(_meta_wrap_on_a_group_without_set_device, 2, stage, timeout=SHORT) == ["cuda:0", "cuda:1"]


def _gather_on_gloo(mp: pytest.MonkeyPatch, used: list[torch.device]) -> None:
    """Replace ``C.all_gather_objects`` by one that records the device its bytes would travel
    on over the group as reported (``devices.object_device``, as the real one picks it: on
    main it was ``torch.cuda.current_device()`` whatever the caller's) and gathers on the real
    gloo group."""
    real = C.all_gather_objects

    def spy(obj: Any, *, group: Any = None, device: torch.device | None = None, **counted: Any) -> list[Any]:
        used.append(D.object_device(group, device))
        with pytest.MonkeyPatch.context() as real_backends:
            real_backends.setattr(dist, "get_backend_config", _TRUE_BACKEND_CONFIG)
            return real(obj, group=group, **counted)

    mp.setattr(C, "all_gather_objects", spy)


def _agreement_device() -> str:
    """Every rank's model on its own GPU (cuda:LOCAL_RANK), an NCCL group made without
    set_device: the device the wrap agreement's object gather runs on."""
    used: list[torch.device] = []
    with pytest.MonkeyPatch.context() as mp:
        FakeCuda(mp, 2)
        _reports(mp, "cuda:nccl")
        mp.setattr(wrap_module, "module_device", lambda module: torch.device("cuda", C.get_rank()))
        _gather_on_gloo(mp, used)
        _stop_at_engine(mp, {})
        try:
            shardpar.wrap(_mlp(), stage=2)
        except Stop:
            pass
    assert len(used) == 1
    return str(used[0])


def test_the_wrap_agreement_gathers_on_the_rank_s_gpu() -> None:
    # On main: cuda:0 on both ranks, i.e. two ranks on one GPU in an NCCL collective.
    assert run_ranks(_agreement_device, 2, timeout=SHORT) == ["cuda:0", "cuda:1"]


def _wrap_on_gpus(visible: int, model_on: int | None, config: str) -> str | None:
    """wrap() with ``visible`` fake GPUs, the model on ``cuda:model_on`` (None: the CPU
    model it is), the group reporting ``config``; the error message, or None."""
    with pytest.MonkeyPatch.context() as mp:
        FakeCuda(mp, visible)
        _reports(mp, config)
        _gather_on_gloo(mp, [])
        if model_on is not None:
            mp.setattr(wrap_module, "module_device", lambda module: torch.device("cuda", model_on))
        _stop_at_engine(mp, {})
        try:
            shardpar.wrap(_mlp(), stage=2)
        except ValueError as error:
            return str(error)
        except Stop:
            return None
    return None


def test_model_cuda_before_set_device_is_refused_on_every_rank() -> None:
    # Every rank's model on cuda:0, two GPUs visible. On main: no error (NCCL then fails or hangs).
    messages = run_ranks(_wrap_on_gpus, 2, 2, 0, "cuda:nccl", timeout=SHORT)
    assert all(m is not None for m in messages), messages
    assert messages[0].startswith("shardpar.wrap failed on rank 1"), messages[0]
    for message in messages:
        for fragment in ("rank 1", "cuda:0", "cuda:1", "LOCAL_RANK=1", "set_device"):
            assert fragment in message, message


def test_one_visible_gpu_per_rank_wraps() -> None:
    # CUDA_VISIBLE_DEVICES per rank: one GPU visible, every rank's model on its cuda:0.
    assert run_ranks(_wrap_on_gpus, 2, 1, 0, "cuda:nccl", timeout=SHORT) == [None, None]


@pytest.mark.parametrize("visible", [0, 2], ids=["no-gpu", "two-gpus"])
def test_a_cpu_model_with_an_nccl_group_is_refused_on_every_rank(visible: int) -> None:
    # On main: no error at wrap; on a real NCCL group the first collective fails deep inside.
    messages = run_ranks(_wrap_on_gpus, 2, visible, None, "cuda:nccl", timeout=SHORT)
    for rank, message in enumerate(messages):
        assert message is not None, f"rank {rank} raised nothing"
        for fragment in ("on cpu", "cuda:nccl", "serves only cuda", "gloo"):
            assert fragment in message, message
        if visible:
            assert "model.to('cuda:" in message, message
