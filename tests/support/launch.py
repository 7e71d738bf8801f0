"""Launch a script the way a cluster does: one ``torchrun`` agent per node, meeting through a
c10d rendezvous, here two agents on loopback playing two nodes (issue #34).

Public API:
- ``run_nodes(script, *args, nodes=2, nproc_per_node=2, timeout=90.0, env=None) -> NodesRun``
  starts ``nodes`` agents ``torchrun --nnodes N --nproc-per-node P --rdzv-backend c10d
  --rdzv-endpoint 127.0.0.1:PORT --rdzv-id ID script args...``, waits for all of them and
  returns each agent's exit code and output and each rank's report.
- ``report(record)``, called by the script on each rank: writes ``record`` (JSON-able) where
  ``run_nodes`` collects it, keyed by ``RANK``.

[Note: two nodes on one machine]
With the c10d rendezvous the agents agree on the job among themselves: ``--node-rank`` is
ignored (torchrun warns), each agent gets its ``GROUP_RANK`` in the order it joins, and the
ranks of one agent are numbered consecutively (``RANK = GROUP_RANK·P + LOCAL_RANK``), as on a
real cluster. One agent must host the rendezvous store on the endpoint; by default each agent
whose host name matches the endpoint tries to, and on loopback both match, so the first agent
is told ``is_host=1`` and the others ``is_host=0``. ``--local-addr 127.0.0.1`` makes each agent
advertise loopback as its address (the workers' ``MASTER_ADDR`` comes from it), whatever the
machine's host name resolves to. Everything runs on the CPU with gloo (``CPU_ONLY_ENV``).

On timeout every agent's process tree is killed (torchrun starts its workers in sessions of
their own, see ``kill_tree``) and ``NodesTimeout`` names what each agent printed last. When one
agent exits with an error the others get ``AFTER_FAILURE_S`` to end on their own (their
workers' collectives fail once a peer is gone) before they are killed: an agent still waiting
in the rendezvous would otherwise wait for its peer until the join timeout (600 s).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.support.harness import CPU_ONLY_ENV, free_port, kill_tree

__all__ = ["AgentRun", "NodesRun", "NodesTimeout", "report", "run_nodes"]

ROOT = Path(__file__).resolve().parents[2]
REPORT_DIR_ENV = "SHARDPAR_TEST_REPORT_DIR"
"""Where ``report`` writes (set by ``run_nodes`` for the script's ranks)."""
AFTER_FAILURE_S = 15.0
_POLL_S = 0.05
_TAIL_CHARS = 3000


@dataclass(frozen=True)
class AgentRun:
    """One torchrun agent: its exit code and everything it and its workers printed."""

    returncode: int
    stdout: str
    stderr: str


@dataclass(frozen=True)
class NodesRun:
    agents: list[AgentRun]
    ranks: dict[int, Any]
    """Each rank's ``report``, by global rank (ranks that reported nothing are absent)."""

    @property
    def ok(self) -> bool:
        return all(agent.returncode == 0 for agent in self.agents)

    def output(self) -> str:
        """Every agent's output, for an assertion message."""
        return "\n".join(
            f"--- agent {i} (exit {a.returncode}) ---\n{a.stdout[-_TAIL_CHARS:]}{a.stderr[-_TAIL_CHARS:]}"
            for i, a in enumerate(self.agents)
        )


class NodesTimeout(TimeoutError):
    """The agents ran past the timeout; all of them were killed."""


def report(record: Any) -> None:
    """Called on each rank of a script ``run_nodes`` started: hand ``record`` back to the test."""
    path = Path(os.environ[REPORT_DIR_ENV]) / f"rank-{os.environ['RANK']}.json"
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(record))
    os.replace(partial, path)  # a report is whole or absent


def run_nodes(
    script: str | os.PathLike[str],
    *args: str,
    nodes: int = 2,
    nproc_per_node: int = 2,
    timeout: float = 90.0,
    env: dict[str, str] | None = None,
) -> NodesRun:
    """Run ``script args`` under ``nodes`` torchrun agents on loopback; see the module's doc."""
    with tempfile.TemporaryDirectory(prefix="shardpar-nodes-") as tmp:
        out = Path(tmp)
        port, job = free_port(), f"shardpar-test-{uuid.uuid4().hex[:8]}"
        full_env = {
            **os.environ,
            **CPU_ONLY_ENV,
            "OMP_NUM_THREADS": "1",
            REPORT_DIR_ENV: str(out),
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
            **(env or {}),
        }
        for name in [n for n in full_env if n.startswith("TORCHELASTIC_")]:
            del full_env[name]  # stale if the test itself runs under torchrun
        agents = []
        for node in range(nodes):
            command = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                str(nodes),
                "--nproc-per-node",
                str(nproc_per_node),
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                f"127.0.0.1:{port}",
                "--rdzv-id",
                job,
                "--rdzv-conf",
                f"is_host={int(node == 0)}",
                "--local-addr",
                "127.0.0.1",
                "--max-restarts",
                "0",
                str(script),
                *args,
            ]
            stdout, stderr = open(out / f"agent-{node}.out", "w+"), open(out / f"agent-{node}.err", "w+")
            agents.append(
                (
                    subprocess.Popen(
                        command, stdout=stdout, stderr=stderr, env=full_env, cwd=ROOT, start_new_session=True
                    ),
                    stdout,
                    stderr,
                )
            )
        try:
            timed_out = _wait(agents, timeout)
        finally:
            for process, _, _ in agents:
                kill_tree(process.pid)  # no-op for agents that ended; workers orphaned by a crash too
                process.wait()
        runs = []
        for process, stdout, stderr in agents:
            stdout.seek(0), stderr.seek(0)
            runs.append(AgentRun(process.returncode, stdout.read(), stderr.read()))
            stdout.close(), stderr.close()
        if timed_out:
            raise NodesTimeout(
                f"{nodes} torchrun agents running {script} did not finish in {timeout:g} s; killed\n"
                + NodesRun(runs, {}).output()
            )
        ranks = {int(p.stem.split("-")[1]): json.loads(p.read_text()) for p in out.glob("rank-*.json")}
        return NodesRun(runs, ranks)


def _wait(agents: list[tuple[subprocess.Popen, Any, Any]], timeout: float) -> bool:
    """Wait until every agent has ended, or ``AFTER_FAILURE_S`` after one failed; True when
    the timeout ran out first."""
    deadline = time.monotonic() + timeout
    grace_ends = float("inf")
    while time.monotonic() < min(deadline, grace_ends):
        codes = [process.poll() for process, _, _ in agents]
        if None not in codes:
            return False
        if any(code not in (None, 0) for code in codes):
            grace_ends = min(grace_ends, time.monotonic() + AFTER_FAILURE_S)
        time.sleep(_POLL_S)
    return time.monotonic() >= deadline
