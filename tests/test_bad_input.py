"""Bad arguments fail at once, with the right exception type and a message naming the
problem, on every rank, and never leave a rank waiting in a collective.

Multi-rank cases catch the error *inside* each rank and return its message, so the test
can assert that every rank raised (and the rank pool stays healthy for other tests); a
short harness timeout turns a hang into a failure within seconds.
"""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import shardpar
from shardpar.comm import collectives as C
from tests.support.harness import run_ranks
from tests.support.models import KITCHEN

SHORT = 30.0  # seconds: wrap-time checks take milliseconds; only a hang gets near this


def _mlp(hidden: int = 8) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, hidden), nn.Tanh(), nn.Linear(hidden, 2))


# --------------------------------------------------------------------------- one process


@pytest.mark.parametrize("stage", [4, -1, "x", True, None, 2.5])
def test_stage_outside_0_to_3(stage: object) -> None:
    with pytest.raises(ValueError, match="stage"):
        shardpar.wrap(_mlp(), stage=stage)


@pytest.mark.parametrize("not_a_module", [object(), torch.zeros(3), [nn.Linear(2, 2)], "model"])
def test_non_module(not_a_module: object) -> None:
    with pytest.raises(TypeError, match="nn.Module"):
        shardpar.wrap(not_a_module)


def test_unknown_option_is_named() -> None:
    with pytest.raises(TypeError, match="bucket_cap_gb"):
        shardpar.wrap(_mlp(), stage=0, bucket_cap_gb=1)


@pytest.mark.parametrize(
    "option, value",
    [
        ("bucket_cap_mb", 0),
        ("bucket_cap_mb", -1.0),
        ("timeout_s", 0),
        ("prefetch_units", -1),
        ("forward_prefetch_units", -1),
        ("backward_prefetch_units", -1),
    ],
)
def test_invalid_option_value_is_named(option: str, value: object) -> None:
    with pytest.raises(ValueError, match=option):
        shardpar.wrap(_mlp(), stage=0, **{option: value})


@pytest.mark.parametrize(
    "option, value",
    [
        ("bucket_cap_mb", "25"),
        ("timeout_s", "10"),
        ("timeout_s", None),
        ("prefetch_units", 1.5),
        ("min_unit_params", "1000"),
        ("prefetch_units", True),
        ("broadcast_buffers", "no"),
        ("reshard_after_forward", 0),
        ("prefetch_units", None),
        ("align_for_bandwidth", "yes"),
        ("align_for_bandwidth", 1),
        ("rebuild_buckets", "yes"),
        ("rebuild_buckets", 1),
        *[
            (option, value)
            for option in ("forward_prefetch_units", "backward_prefetch_units")
            for value in (1.5, True, "2")
        ],
    ],
)
def test_option_of_the_wrong_type_is_named(option: str, value: object) -> None:
    """A string from argparse or a config file must not end in "'>' not supported between
    'str' and 'int'": the error names the option and the value."""
    with pytest.raises(TypeError, match=rf"^{option} must be .*{value!r}"):
        shardpar.wrap(_mlp(), stage=0, **{option: value})


def test_numpy_numbers_are_accepted_as_options() -> None:
    import numpy as np

    config = shardpar.ShardConfig(
        bucket_cap_mb=np.float64(1.5), prefetch_units=np.int64(2), backward_prefetch_units=np.int64(0)
    )
    assert config.bucket_cap_mb == 1.5 and config.prefetch_units == 2
    assert config.units_to_prefetch_in_forward == 2 and config.units_to_prefetch_in_backward == 0


def test_params_on_two_devices_name_both_tensors() -> None:
    model = _mlp()
    model[2].weight = nn.Parameter(torch.empty(2, 8, device="meta"))
    with pytest.raises(ValueError) as info:
        shardpar.wrap(model, stage=0)
    message = str(info.value)
    assert "'0.weight'" in message and "'2.weight'" in message
    assert "cpu" in message and "meta" in message


def test_buffer_on_another_device_is_named() -> None:
    model = _mlp()
    model.register_buffer("stats", torch.zeros(3, device="meta"))
    with pytest.raises(ValueError) as info:
        shardpar.wrap(model, stage=1)
    assert "'stats'" in str(info.value) and "'0.weight'" in str(info.value)


def test_wrapping_twice() -> None:
    model = shardpar.wrap(_mlp(), stage=0)
    with pytest.raises(ValueError, match="already wrapped"):
        shardpar.wrap(model, stage=0)


def test_nothing_to_train() -> None:
    model = _mlp().requires_grad_(False)
    with pytest.raises(ValueError, match="requires_grad"):
        shardpar.wrap(model, stage=0)


@pytest.mark.parametrize("module_class", [nn.Embedding, nn.EmbeddingBag])
def test_sparse_embedding_is_named_at_wrap(module_class: type) -> None:
    model = nn.Sequential(module_class(10, 4, sparse=True), nn.Linear(4, 1))
    with pytest.raises(ValueError, match=r"module '0' \(" + module_class.__name__ + r"\) has sparse=True"):
        shardpar.wrap(model)
    frozen = nn.Sequential(module_class(10, 4, sparse=True), nn.Linear(4, 1))
    frozen[0].weight.requires_grad_(False)  # no gradient at all: nothing to refuse
    shardpar.wrap(frozen).engine.close()


class _SparseLookup(nn.Module):
    """A sparse gradient from a functional call, which no module check can see."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(10, 4))
        self.head = nn.Linear(4, 1)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(nn.functional.embedding(tokens, self.table, sparse=True))


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_sparse_gradient_names_the_parameter(stage: int) -> None:
    model = shardpar.wrap(_SparseLookup(), stage=stage, **({"min_unit_params": 1} if stage == 3 else {}))
    with pytest.raises(ValueError, match="parameter 'table' got a torch.sparse_coo gradient"):
        model(torch.tensor([[1, 2]])).sum().backward()
    model.engine.close()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_moving_or_casting_after_wrap_is_refused_and_no_ops_pass(stage: int) -> None:
    """``.double()``/``.half()``/``.to(dtype)``/``.to(memory_format=...)`` would give the
    parameters new tensors outside the engine's storage: refused, naming a tensor, with
    nothing changed. ``.to(device)`` to where the model is, ``.cpu()`` and ``.float()`` of an
    fp32 model change nothing and are allowed (scripts call them after wrapping DDP)."""
    torch.manual_seed(0)
    model = shardpar.wrap(
        nn.Sequential(nn.Conv2d(2, 4, 3), nn.Flatten(), nn.Linear(4 * 2 * 2, 1)),
        stage=stage,
        **({"min_unit_params": 1} if stage == 3 else {}),
    )
    opt = shardpar.optimizer(model, torch.optim.SGD, lr=0.1)
    before = model.full_state_dict()
    for target in (model, model.module):  # the wrapped module's own .to()/.half() too
        for call in (
            lambda m: m.double(),
            lambda m: m.half(),
            lambda m: m.to(torch.bfloat16),
            lambda m: m.to(memory_format=torch.channels_last),
            lambda m: m.to("meta"),
        ):
            with pytest.raises(ValueError, match="would move or cast '0.weight'.*before shardpar.wrap"):
                call(target)
        for call in (lambda m: m.to("cpu"), lambda m: m.cpu(), lambda m: m.float(), lambda m: m.to(torch.float32)):
            assert call(target) is target
    after = model.full_state_dict()
    assert all(torch.equal(after[k], v) and after[k].dtype == v.dtype for k, v in before.items())
    model(torch.randn(1, 2, 4, 4)).sum().backward()  # still trains
    opt.step()
    assert not torch.equal(model.full_state_dict()["2.weight"], before["2.weight"])
    model.engine.close()


@pytest.mark.parametrize(
    "cls", [object, torch.nn.Linear, "AdamW", torch.optim.AdamW([torch.zeros(1, requires_grad=True)])]
)
def test_optimizer_class_must_be_an_optimizer(cls: object) -> None:
    model = shardpar.wrap(_mlp(), stage=0)
    with pytest.raises(TypeError, match="Optimizer"):
        shardpar.optimizer(model, cls, lr=0.1)


def test_optimizer_needs_a_wrapped_model() -> None:
    with pytest.raises(TypeError, match="shardpar.wrap"):
        shardpar.optimizer(_mlp(), torch.optim.SGD, lr=0.1)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_param_group_with_a_foreign_tensor(stage: int) -> None:
    model = shardpar.wrap(_mlp(), stage=stage)
    stranger = nn.Parameter(torch.zeros(5, 3))
    with pytest.raises(ValueError, match=r"not a parameter of the wrapped model") as info:
        shardpar.optimizer(model, torch.optim.AdamW, [{"params": list(model.parameters())}, {"params": [stranger]}])
    assert "(5, 3)" in str(info.value)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_same_parameter_in_two_groups_is_named(stage: int) -> None:
    model = shardpar.wrap(_mlp(), stage=stage)
    params = dict(model.named_parameters())
    groups = [{"params": [params["0.weight"], params["2.bias"]]}, {"params": [params["2.bias"], params["2.weight"]]}]
    with pytest.raises(ValueError, match=r"'2\.bias'"):
        shardpar.optimizer(model, torch.optim.AdamW, groups, lr=0.1)


def test_tied_parameter_twice_through_its_alias_is_named() -> None:
    model = shardpar.wrap(KITCHEN.build(), stage=0)
    module = model.module
    # head.weight is emb.weight: naming it through both attributes lists one parameter twice
    with pytest.raises(ValueError, match=r"'emb\.weight'"):
        shardpar.optimizer(
            model, torch.optim.AdamW, [{"params": [module.emb.weight]}, {"params": [module.head.weight]}]
        )


def test_mixed_params_and_groups() -> None:
    model = shardpar.wrap(_mlp(), stage=0)
    params = list(model.parameters())
    with pytest.raises(TypeError, match="mixes"):
        shardpar.optimizer(model, torch.optim.SGD, [params[0], {"params": params[1:]}], lr=0.1)


# --------------------------------------------------------------------------- across ranks


def _wrap_and_report(hidden_on_rank_1: int, stage_on_rank_1: object, options_on_rank_1: dict) -> str | None:
    """wrap() on every rank, rank 1 with its own model/stage/options; the error message, or
    None when wrap returned. Nothing collective runs after wrap, so a rank that wrongly
    succeeds cannot hang the others."""
    rank = C.get_rank()
    module = _mlp(hidden_on_rank_1 if rank == 1 else 8)
    module.register_buffer("running", torch.zeros(2))
    stage = stage_on_rank_1 if rank == 1 else 1
    options = options_on_rank_1 if rank == 1 else {}
    try:
        shardpar.wrap(module, stage=stage, **options)
    except (TypeError, ValueError) as error:
        return f"{type(error).__name__}: {error}"
    return None


def _assert_every_rank_raised(messages: list[str | None], *fragments: str) -> None:
    for rank, message in enumerate(messages):
        assert message is not None, f"rank {rank} did not raise (the others did): {messages}"
        assert message.startswith("ValueError"), message
        for fragment in fragments:
            assert fragment in message, f"rank {rank}: {fragment!r} not in {message!r}"


@pytest.mark.parametrize("world_size", [2, 3])
def test_mismatched_models_fail_on_every_rank(world_size: int) -> None:
    messages = run_ranks(_wrap_and_report, world_size, 9, 1, {}, timeout=SHORT)
    _assert_every_rank_raised(messages, "'0.weight'", "rank 1", "(9, 4)", "(8, 4)")


@pytest.mark.parametrize("world_size", [2, 3])
def test_invalid_stage_on_one_rank_fails_on_every_rank(world_size: int) -> None:
    messages = run_ranks(_wrap_and_report, world_size, 8, 5, {}, timeout=SHORT)
    _assert_every_rank_raised(messages, "stage")
    assert "rank 1" in messages[0]


def test_different_stage_on_one_rank_fails_on_every_rank() -> None:
    messages = run_ranks(_wrap_and_report, 2, 8, 2, {}, timeout=SHORT)
    _assert_every_rank_raised(messages, "stage=1", "stage=2", "rank 1")


def test_different_bucket_cap_on_one_rank_fails_on_every_rank() -> None:
    messages = run_ranks(_wrap_and_report, 2, 8, 1, {"bucket_cap_mb": 1.0}, timeout=SHORT)
    _assert_every_rank_raised(messages, "bucket_cap_mb", "rank 1")


def test_different_broadcast_buffers_on_one_rank_fails_on_every_rank() -> None:
    # With broadcast_buffers=True rank 0 broadcasts its buffers once per step; a rank
    # with False would skip those collectives, and the ranks' collectives would no longer
    # pair up (a hang or, worse, a buffer all-reduced into a gradient). DESIGN.md: "a
    # mismatch between ranks (model shape, stage, config) is detected up front and raised
    # on every rank with a message that says what differs".
    messages = run_ranks(_wrap_and_report, 2, 8, 1, {"broadcast_buffers": False}, timeout=SHORT)
    _assert_every_rank_raised(messages, "broadcast_buffers", "rank 1")


def test_unknown_option_on_one_rank_fails_on_every_rank() -> None:
    messages = run_ranks(_wrap_and_report, 3, 8, 1, {"bucket_size": 3}, timeout=SHORT)
    assert messages[1] is not None and messages[1].startswith("TypeError") and "bucket_size" in messages[1]
    for rank in (0, 2):
        assert messages[rank] is not None and "rank 1" in messages[rank] and "bucket_size" in messages[rank]


def _frozen_on_rank_1() -> str | None:
    module = _mlp()
    if C.get_rank() == 1:
        module[0].bias.requires_grad_(False)
    try:
        shardpar.wrap(module, stage=2)
    except ValueError as error:
        return f"ValueError: {error}"
    return None


def test_different_requires_grad_on_one_rank_fails_on_every_rank() -> None:
    _assert_every_rank_raised(run_ranks(_frozen_on_rank_1, 2, timeout=SHORT), "'0.bias'", "requires_grad", "rank 1")


# --------------------------------------------------------------------------- optimizers that need whole parameters

_ELEMENTWISE = [
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.1}),
    (torch.optim.Adam, {"lr": 1e-3, "amsgrad": True, "foreach": False}),
    (torch.optim.Adam, {"lr": 1e-3, "fused": True}),
    (torch.optim.AdamW, {"lr": 1e-3, "weight_decay": 0.1, "maximize": True}),
    (torch.optim.Adamax, {}),
    (torch.optim.NAdam, {"decoupled_weight_decay": True, "weight_decay": 0.1}),
    (torch.optim.RAdam, {}),
    (torch.optim.Adagrad, {}),
    (torch.optim.Adadelta, {}),
    (torch.optim.RMSprop, {"centered": True, "momentum": 0.5}),
    (torch.optim.Rprop, {}),
    (torch.optim.ASGD, {}),
]


@pytest.mark.parametrize("optimizer_class, options", _ELEMENTWISE)
def test_elementwise_torch_optimizers_are_accepted_at_every_stage(optimizer_class: type, options: dict) -> None:
    from shardpar.optim.sharded import _not_elementwise

    assert _not_elementwise(optimizer_class, options, torch.device("cpu")) is None
    for stage in (0, 3):
        model = shardpar.wrap(_mlp(), stage=stage)
        shardpar.optimizer(model, optimizer_class, **options)
        model.engine.close()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_lbfgs_is_refused_at_stages_1_to_3_naming_why(stage: int) -> None:
    """LBFGS keeps its history over the vector of all its parameters (its step run with a
    closure, as it needs one): neither 1-D slices nor whole tensors owned by different ranks
    give it that. Refused at construction, naming the class and the stage."""
    model = shardpar.wrap(nn.Linear(4, 3, bias=False), stage=stage)
    name = "torch.optim.lbfgs.LBFGS"
    with pytest.raises(
        ValueError,
        match=rf"{re.escape(name)} does not update parameters element by element "
        rf"\(.*LBFGS's history and step sizes over the vector of all parameters.*nor each tensor on its own"
        rf".*at stage {stage} each rank updates only the slices or whole tensors it owns",
    ):
        shardpar.optimizer(model, torch.optim.LBFGS, lr=1e-2)
    model.engine.close()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("optimizer_class", [torch.optim.Adafactor, torch.optim.Muon])
def test_whole_tensor_optimizers_train_as_torch_at_every_stage_in_one_process(
    optimizer_class: type, stage: int
) -> None:
    """Adafactor's factored moments and Muon's whole-matrix update get the matrix whole, in its
    shape ([Note: whole-tensor ownership]); one process, so bit for bit as torch's."""
    torch.manual_seed(0)
    plain = nn.Linear(4, 3, bias=False)
    model = shardpar.wrap(nn.Linear(4, 3, bias=False), stage=stage)
    model.load_state_dict(plain.state_dict())
    opts = [optimizer_class(plain.parameters(), lr=1e-2), shardpar.optimizer(model, optimizer_class, lr=1e-2)]
    for step in range(3):
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(step))
        for net, opt in zip((plain, model), opts):
            net(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
    assert torch.equal(model.full_state_dict()["weight"], plain.weight.detach())
    model.engine.close()


@pytest.mark.parametrize("stage", [0, 3])
def test_a_lazy_module_not_run_yet_is_named_at_wrap(stage: int) -> None:
    """nn.LazyLinear has no shape before its first forward; after one it wraps and trains."""
    with pytest.raises(
        ValueError,
        match=r"parameter '0.weight' is not initialized yet .* run one forward with a "
        r"sample batch before shardpar.wrap",
    ):
        shardpar.wrap(nn.Sequential(nn.LazyLinear(4), nn.Linear(4, 1)), stage=stage)
    module = nn.Sequential(nn.LazyLinear(4), nn.Linear(4, 1))
    module(torch.randn(2, 3))
    model = shardpar.wrap(module, stage=stage)
    model(torch.randn(2, 3)).sum().backward()
    model.engine.close()
