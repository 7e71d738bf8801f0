"""Fault injection for tests/test_faults.py: one rank fails, dies or hangs at a chosen point.

    torchrun --standalone --nproc-per-node 2 tests/support/fault_script.py OUT --fault backward --rank 1

trains a small MLP with shardpar (``--stage``) and injects ``--fault`` on ``--rank`` at
``--fault-step``:

- ``forward`` / ``backward`` / ``step``: an :class:`InjectedFault` raised inside the model's
  forward (a pre-hook of a middle layer), inside autograd's backward (a hook on that layer's
  output) or inside the torch optimizer's ``step`` (between the gradient reduction and the
  parameter all-gather of stages 1-3);
- ``kill-step``: SIGKILL inside the optimizer's ``step``;
- ``kill-save``: SIGKILL halfway through writing this rank's file of the checkpoint saved at
  ``--fault-step`` (shardpar's crash hook, ``SHARDPAR_CHECKPOINT_TEST_CRASH``); with
  ``--async-save``, in the background thread of an asynchronous save, while training goes on;
- ``hang``: the rank sleeps in forward while the others wait in a collective, so only the
  process-group timeout (``--timeout-s``, shardpar's ``timeout_s``) can end the job.

Just before injecting, the failing rank writes ``OUT/fault.json`` (``time.time()`` of the
fault), so a test can measure how long the job took to end after it. Every ``--save-every``
steps it saves ``OUT/ckpt/step-<n>`` and rank 0 writes the full model it saved to
``OUT/expected-step-<n>.safetensors``. Faults fire on the first attempt of an elastic job only;
``--late-rank0-on-restart S`` delays rank 0 of a restarted attempt before ``shardpar.wrap``
creates the process group. ``--file-barrier`` makes the ranks wait for each other
(files in OUT) before creating the process group, for runs without torchrun where ranks are
plain processes started with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT.

``recipe`` mode runs ``recipes/train_gpt.py`` unchanged except that, on the first attempt of
an elastic job (``TORCHELASTIC_RESTART_COUNT=0``), rank ``--rank`` SIGKILLs itself when it
fetches the batch of step ``--fault-step``:

    torchrun --max-restarts 1 ... tests/support/fault_script.py recipe --rank 1 --fault-step 7 -- <recipe args>
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.elastic.multiprocessing.errors import record  # noqa: E402

FAULTS = ("none", "forward", "backward", "step", "kill-step", "kill-save", "hang")
SIZES = (16, 64, 64, 64, 4)
"""The MLP: four Linear layers, 13k parameters (several buckets, several stage-3 units)."""
HANG_S = 600.0


class InjectedFault(RuntimeError):
    """The exception a ``forward``/``backward``/``step`` fault raises."""


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _mark_fault(out: Path, fault: str, step: int) -> None:
    record_ = {"rank": _rank(), "fault": fault, "step": step, "time": time.time(), "pid": os.getpid()}
    (out / "fault.json").write_text(json.dumps(record_))


def _file_barrier(out: Path, world_size: int, timeout_s: float = 120.0) -> None:
    (out / f"ready-rank{_rank()}").touch()
    deadline = time.monotonic() + timeout_s
    while not all((out / f"ready-rank{r}").exists() for r in range(world_size)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {_rank()}: the other ranks never started")
        time.sleep(0.05)


class _Injector:
    """Arms at (rank, step); the hooks fire only while armed."""

    def __init__(self, out: Path, fault: str, rank: int, step: int) -> None:
        self.out, self.fault, self.rank, self.step = out, fault, rank, step
        self.armed = False

    def arm_if_due(self, step: int) -> None:
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"  # a restarted job runs clean
        self.armed = first_attempt and _rank() == self.rank and step == self.step

    def fire(self, where: str) -> None:
        if not self.armed or self.fault != where and not (where == "step" and self.fault == "kill-step"):
            return
        self.armed = False
        _mark_fault(self.out, self.fault, self.step)
        if self.fault == "kill-step":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.fault == "hang":
            time.sleep(HANG_S)
        raise InjectedFault(f"injected fault in {where} on rank {_rank()} at step {self.step}")


def _mark_pid(out: Path) -> None:
    """``OUT/pid-rank<r>-attempt<a>``: lets a test check that no rank outlived the job."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    (out / f"pid-rank{_rank()}-attempt{attempt}").write_text(str(os.getpid()))


def _fail_inside_step(optimizer: torch.optim.Optimizer, injector: _Injector) -> None:
    """The step fault fires inside the torch optimizer's own ``step`` (the class stays
    torch.optim.AdamW, so the checkpoints it saves load into a plain AdamW)."""
    step = optimizer.step

    def step_or_fail(*args: object, **kwargs: object) -> object:
        injector.fire("step")
        return step(*args, **kwargs)

    optimizer.step = step_or_fail  # type: ignore[method-assign]


def train(args: argparse.Namespace) -> None:
    from safetensors.torch import save_file

    import shardpar
    from shardpar.checkpoint.save import TEST_CRASH_ENV
    from shardpar.comm import collectives as C
    from tests.support.models import MLPStack

    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    _mark_pid(out)
    torch.set_num_threads(1)
    if args.file_barrier:
        _file_barrier(out, int(os.environ.get("WORLD_SIZE", "1")))
    if args.late_rank0_on_restart and _rank() == 0 and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        time.sleep(args.late_rank0_on_restart)  # the other ranks of the new attempt join the group first
    injector = _Injector(out, args.fault, args.rank, args.fault_step)

    torch.manual_seed(0)
    module = MLPStack(SIZES)
    options = {"wrap_policy": (nn.Linear,)} if args.stage == 3 else {"bucket_cap_mb": 4096 * 4 / 2**20}
    model = shardpar.wrap(module, stage=args.stage, timeout_s=args.timeout_s, **options)
    opt = shardpar.optimizer(model, torch.optim.AdamW, lr=1e-2)
    _fail_inside_step(opt.inner, injector)

    middle = module.layers[2]  # the second Linear: faults land with work before and after them

    def forward_pre_hook(_module: nn.Module, _args: object) -> None:
        injector.fire("hang")
        injector.fire("forward")

    def forward_hook(_module: nn.Module, _args: object, output: torch.Tensor) -> None:
        if injector.armed and injector.fault == "backward" and output.requires_grad:
            output.register_hook(lambda grad: injector.fire("backward"))

    middle.register_forward_pre_hook(forward_pre_hook)
    middle.register_forward_hook(forward_hook)

    rank = C.get_rank()
    saving = None
    for step in range(args.steps):
        injector.arm_if_due(step)
        x, y = module.example(8, torch.Generator().manual_seed(1000 * step + rank))
        module.loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        done = step + 1
        if args.save_every and done % args.save_every == 0:
            if args.fault == "kill-save" and done == args.fault_step and rank == args.rank:
                _mark_fault(out, "kill-save", done)
                os.environ[TEST_CRASH_ENV] = f"{rank}:write"
            saving = shardpar.save_checkpoint(
                out / "ckpt" / f"step-{done}", model, opt, extra={"step": done}, async_save=args.async_save
            )
            state = model.full_state_dict()  # a collective: every rank takes part (while an async save writes)
            if rank == 0:
                save_file({k: v.clone() for k, v in state.items()}, str(out / f"expected-step-{done}.safetensors"))
    if saving is not None:
        saving.wait()
    (out / f"done-rank{rank}").touch()


def _init_group_per_attempt(timeout_s: float = 300.0) -> None:
    """Create the default process group in a store namespace of its own per restart.

    [Note: stale addresses after an elastic restart]
    Under torchrun the workers of every attempt rendezvous in the agent's TCPStore, which
    outlives the attempts, and ``init_process_group`` (env://) uses the same keys each time.
    Here (torch 2.13, two loaded cores) restarted attempts that created their group that way
    failed in 3 of 5 runs: "Gloo connectFullMesh failed ... Connection refused" to an address
    of the dead attempt, or a wait in ``init_process_group`` until its timeout; with the
    store prefixed by the restart count, none failed. This test is about resuming, so it
    makes the group that way; the recipe then finds the group made and uses it. shardpar's
    own group creation across a restart is tested on its own (test_faults.py,
    test_shardpar_creates_a_working_group_again_after_an_elastic_restart).
    """
    import datetime

    import torch.distributed as dist

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or dist.is_initialized():
        return
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=False, timeout=timeout
    )
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore(f"shardpar/attempt-{attempt}", store),
        rank=_rank(),
        world_size=world_size,
        timeout=timeout,
    )


def run_recipe(args: argparse.Namespace) -> None:
    """``recipes/train_gpt.py`` with a SIGKILL on the first attempt (see the module doc)."""
    from recipes import data, train_gpt

    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    get_batch = data.CharDataset.get_batch
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        _mark_pid(args.out)

    def get_batch_or_die(self, step, *rest, **kwargs):
        if (
            attempt == 0
            and _rank() == args.rank
            and step == args.fault_step
            and kwargs.get("split", "train") == "train"
        ):
            if args.out is not None:
                _mark_fault(args.out, "kill-recipe", step)
            os.kill(os.getpid(), signal.SIGKILL)
        return get_batch(self, step, *rest, **kwargs)

    data.CharDataset.get_batch = get_batch_or_die
    _init_group_per_attempt()
    train_gpt.main(args.recipe_args)


@record
def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "recipe":
        parser = argparse.ArgumentParser(description="recipes/train_gpt.py with a SIGKILL on attempt 0")
        parser.add_argument("--rank", type=int, default=1)
        parser.add_argument("--fault-step", type=int, required=True)
        parser.add_argument("--out", type=Path, default=None, help="where fault.json and pid files go")
        parser.add_argument("recipe_args", nargs=argparse.REMAINDER)
        args = parser.parse_args(sys.argv[2:])
        if args.recipe_args[:1] == ["--"]:
            args.recipe_args = args.recipe_args[1:]
        run_recipe(args)
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--fault", choices=FAULTS, default="none")
    parser.add_argument("--rank", type=int, default=1, help="the rank that fails")
    parser.add_argument("--fault-step", type=int, default=1, help="0-based step (kill-save: the save after it)")
    parser.add_argument("--stage", type=int, choices=range(4), default=0)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--save-every", type=int, default=0)
    parser.add_argument(
        "--async-save", action="store_true", help="save with async_save=True (killed in the background)"
    )
    parser.add_argument("--timeout-s", type=float, default=600.0, help="shardpar's collective timeout")
    parser.add_argument("--file-barrier", action="store_true")
    parser.add_argument(
        "--late-rank0-on-restart",
        type=float,
        default=0.0,
        help="seconds rank 0 of a restarted attempt waits before shardpar.wrap creates the group",
    )
    train(parser.parse_args())


if __name__ == "__main__":
    main()
