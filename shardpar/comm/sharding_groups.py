"""Hybrid sharding's process groups: shard within a group of G ranks, replicate across the
R = N/G groups (FSDP2's HSDP, DeepSpeed's MiCS, Megatron's distributed-optimizer instances).

[Note: sharding groups]
The user's choice (``shard_group_size``: None, an int G, ``"node"``, or a 2-D ``DeviceMesh``
(replicate, shard) as FSDP2's HSDP takes it) resolves to one immutable
:class:`ShardingGroups`:

- the **shard group**: G consecutive ranks ``r//G*G .. r//G*G + G-1``. torchrun numbers the
  ranks of a node consecutively, so with G dividing the node size a shard group lies inside
  one node, and its gathers and reduce-scatters stay on the fast links;
- the **replica group**: the R ranks with the same index in their shard groups
  (``r % G, r % G + G, ...``). Only the all-reduce of each owned shard runs on it, Ψ/G
  elements, and it is the only traffic that crosses nodes when shard groups fit in one.

G = N is full sharding (the replica group has one rank: no collective across replicas);
G = 1 is pure replication: nothing is sharded and every gradient is all-reduced over all N
ranks, which is what stage 0 does with one collective kind fewer. G = 1 is allowed, as FSDP2
allows a (N, 1) mesh (torch's own ``replicate()`` is FSDP2 on a replicate-only mesh) and
DeepSpeed a MiCS shard size of 1; the planner never picks it, since stage 0 moves the same
bytes. A group of one rank is ``None`` here: nothing runs on it (``None`` does *not* mean the
default group, as it does to the collectives: test ``shard_size``/``replica_size`` first).

Agreement before creation. ``dist.new_group`` names groups by a counter every rank of the
job advances, so every rank must create every group in the same order; a rank that asked for
another G would create other groups and its collectives would pair with the wrong ranks (a
hang, or wrong sums). So every rank first sends its resolved G (or its local error) to all
others with one small all-gather on the parent group, and every rank raises the same
ValueError naming the ranks and their values before any group exists. Then every rank
creates all shard groups, then all replica groups (as ``DeviceMesh`` does), and keeps its
own. A mesh brings its own groups (``mesh.get_group(dim)``).

Lifetime: created groups are kept per parent group, weakly in the parent, as the sibling
groups are ([Note: no group outlives destroy_process_group] in process_group.py), so a
second wrap with the same G reuses them and ``destroy_process_group`` frees them.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Union

import torch.distributed as dist

from .collectives import all_gather_objects
from .process_group import ProcessGroup, backend_timeout, get_rank, get_world_size

ShardGroupSize = Union[None, int, str]
"""``shard_group_size`` as ``wrap`` takes it: None (full sharding), an int G, or ``"node"``."""

NODE = "node"


@dataclass(frozen=True)
class ShardingGroups:
    """Where this rank's shards live: its shard group (G ranks) and its replica group (R = N/G
    ranks holding the same shard), see [Note: sharding groups]. Ranks are global ranks."""

    world_size: int
    """N: ranks of the parent group."""
    shard_size: int
    """G: ranks sharing one copy of the model state."""
    replica_size: int
    """R = N/G: copies of each shard."""
    shard_rank: int
    """This rank's index in its shard group: the slice of every bucket and unit it owns."""
    replica_rank: int
    """This rank's index in its replica group (= which shard group it is in, for consecutive groups)."""
    shard_ranks: tuple[int, ...]
    """The shard group's global ranks, in group-rank order."""
    replica_ranks: tuple[int, ...]
    shard_group: ProcessGroup | None
    """Gathers and reduce-scatters run here; None when G = 1."""
    replica_group: ProcessGroup | None
    """The all-reduce of each owned shard runs here; None when R = 1 (full sharding)."""
    source: str = "full sharding"
    """How the user asked for it, for messages."""

    @classmethod
    def whole(cls, group: ProcessGroup | None) -> ShardingGroups:
        """Full sharding over ``group`` itself (None: the default group, or world size 1 without
        one), with no collective and no group created: what every stage has without
        ``shard_group_size``. The shard group is ``group`` as given, so collectives keep
        running on it unchanged."""
        world_size, rank = get_world_size(group), get_rank(group)
        ranks = tuple(dist.get_process_group_ranks(group or dist.group.WORLD)) if world_size > 1 else (rank,)
        return cls(world_size, world_size, 1, rank, 0, ranks, (ranks[rank],), group, None)

    @property
    def is_hybrid(self) -> bool:
        """Sharded within groups and replicated across them (1 < G < N)."""
        return 1 < self.shard_size < self.world_size

    def describe(self) -> str:
        """One line for messages: the sizes, where they came from, and this rank's groups."""
        if self.world_size == 1:
            return "one rank: nothing sharded or replicated"
        if self.replica_size == 1:
            layout = f"full sharding over {self.world_size} ranks"
        elif self.shard_size == 1:
            layout = f"no sharding: every rank holds everything, {self.world_size} replicas"
        else:
            layout = (
                f"hybrid sharding: shard groups of {self.shard_size} ranks, "
                f"replicated across {self.replica_size} groups"
            )
        return (
            f"{layout} ({self.source}); this rank is {self.shard_rank} of shard group "
            f"{list(self.shard_ranks)} and {self.replica_rank} of replica group {list(self.replica_ranks)}"
        )


def resolve_shard_group_size(choice: ShardGroupSize, world_size: int, environ: Mapping[str, str] = os.environ) -> int:
    """G for ``shard_group_size=choice`` on ``world_size`` ranks (None: G = N); ValueError
    naming the problem when G is not a positive divisor of the world size, or ``"node"`` has
    no ``LOCAL_WORLD_SIZE`` to read or one that does not divide the world size."""
    if choice is None:
        return world_size
    if choice == NODE:
        text = environ.get("LOCAL_WORLD_SIZE")
        if text is None:
            raise ValueError(
                "shard_group_size='node' reads LOCAL_WORLD_SIZE (the ranks per node, which torchrun "
                "sets), and it is not set; launch with torchrun or pass the number of ranks per node"
            )
        try:
            local = int(text)
        except ValueError:
            raise ValueError(f"shard_group_size='node': LOCAL_WORLD_SIZE={text!r} is not an integer") from None
        if local < 1 or world_size % local:
            raise ValueError(
                f"shard_group_size='node': the world size {world_size} is not a multiple of "
                f"LOCAL_WORLD_SIZE={local}; every node must run the same number of ranks"
            )
        return local
    if isinstance(choice, bool) or not isinstance(choice, int):
        raise ValueError(f"shard_group_size must be None, an int or 'node', got {choice!r}")
    if choice < 1 or world_size % choice:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ValueError(
            f"shard_group_size={choice} must be a positive divisor of the world size {world_size} "
            f"(one of {', '.join(map(str, divisors))})"
        )
    return choice


def consecutive_groups(world_size: int, shard_size: int) -> tuple[list[list[int]], list[list[int]]]:
    """All shard groups (consecutive ranks) and all replica groups (stride G), each in rank
    order, in the order every rank creates them."""
    replicas = world_size // shard_size
    shards = [list(range(i * shard_size, (i + 1) * shard_size)) for i in range(replicas)]
    replica_groups = [list(range(j, world_size, shard_size)) for j in range(shard_size)]
    return shards, replica_groups


_CREATED: weakref.WeakKeyDictionary[Any, dict[int, ShardingGroups]] = weakref.WeakKeyDictionary()
"""Parent group -> {G: the groups created for it}. Weak in the parent: [Note: no group outlives
destroy_process_group] in process_group.py. The values never hold the parent (groups made for
1 < G < N only)."""


@dataclass(frozen=True)
class _Proposal:
    """What one rank brings to the agreement."""

    kind: str  # "size" (None, an int or "node") or "mesh": the two create groups differently
    shard_size: int | None
    problem: str | None
    node: str | None  # GROUP_RANK (torchrun's node index) with "node": a shard group is one node
    cached: bool


def sharding_groups(
    shard_group_size: ShardGroupSize = None,
    *,
    mesh: Any = None,
    group: ProcessGroup | None = None,
    timeout_s: float | None = None,
) -> ShardingGroups:
    """Resolve ``shard_group_size`` (or a 2-D ``mesh`` (replicate, shard)) on the parent
    ``group`` (None: the default group) into this rank's :class:`ShardingGroups`.

    Collective over ``group``: every rank calls it with the same choice. Raises ValueError on
    every rank, naming the ranks, when a rank's choice is invalid or the ranks disagree on G
    ([Note: sharding groups]). ``timeout_s``: of the groups it creates (as ``wrap``'s option;
    None: torch's default)."""
    world_size = get_world_size(group)
    if world_size == 1:
        _local_size(shard_group_size, mesh, [get_rank()], 1)  # still refuse a bad choice
        return ShardingGroups(1, 1, 1, 0, 0, (0,), (0,), None, None, _source(shard_group_size, mesh))
    parent = group if group is not None else dist.group.WORLD
    proposal = _propose(shard_group_size, mesh, parent, world_size)
    proposals: list[_Proposal] = all_gather_objects(proposal, group=group)
    _check_agreement(proposals, shard_group_size)
    shard_size = proposal.shard_size
    assert shard_size is not None  # _check_agreement raised otherwise
    source = _source(shard_group_size, mesh)
    if mesh is not None:
        return _from_mesh(mesh, world_size, source)
    if not 1 < shard_size < world_size:  # no group to create: the parent, or single ranks
        return _trivial(parent, world_size, shard_size, source)
    if not all(p.cached for p in proposals):  # create together, or not at all: see [Note: sharding groups]
        _CREATED.setdefault(parent, {})[shard_size] = _create(parent, world_size, shard_size, timeout_s)
    return replace(_CREATED[parent][shard_size], source=source)


def _source(choice: ShardGroupSize, mesh: Any) -> str:
    if mesh is not None:
        return f"mesh {tuple(mesh.shape)}" + (f" {tuple(mesh.mesh_dim_names)}" if mesh.mesh_dim_names else "")
    if choice == NODE:
        return f"shard_group_size='node', LOCAL_WORLD_SIZE={os.environ.get('LOCAL_WORLD_SIZE')}"
    return "full sharding" if choice is None else f"shard_group_size={choice}"


def _propose(choice: ShardGroupSize, mesh: Any, parent: ProcessGroup, world_size: int) -> _Proposal:
    """This rank's resolved G, or why it has none; never raises (every rank must reach the
    agreement)."""
    kind = "mesh" if mesh is not None else "size"
    try:
        shard_size = _local_size(choice, mesh, dist.get_process_group_ranks(parent), world_size)
        if mesh is None and 1 < shard_size < world_size and parent is not dist.group.WORLD:
            # new_group is collective over the whole job: ranks outside the parent would not take part.
            raise ValueError(
                f"shard_group_size={choice!r} with a process_group that is not the whole job: build a 2-D "
                "DeviceMesh (replicate, shard) over the group's ranks and pass mesh= instead"
            )
    except ValueError as problem:
        return _Proposal(kind, None, str(problem), None, False)
    node = os.environ.get("GROUP_RANK") if choice == NODE else None
    cached = mesh is None and shard_size in _CREATED.get(parent, {})
    return _Proposal(kind, shard_size, None, node, cached)


def _local_size(choice: ShardGroupSize, mesh: Any, parent_ranks: list[int], world_size: int) -> int:
    """G as this rank alone sees it; ValueError naming what is wrong."""
    if choice is not None and mesh is not None:
        raise ValueError("pass shard_group_size or mesh, not both: a mesh's shard dimension is the group size")
    if mesh is not None:
        return _check_mesh(mesh, parent_ranks)
    return resolve_shard_group_size(choice, world_size)


def _check_agreement(proposals: list[_Proposal], choice: ShardGroupSize) -> None:
    """The same ValueError on every rank when any rank's choice is invalid or they differ."""
    problems = [(rank, p.problem) for rank, p in enumerate(proposals) if p.problem is not None]
    if problems:
        first = problems[0][1]
        if all(problem == first for _, problem in problems):
            raise ValueError(f"{first} (on ranks {_ranks([r for r, _ in problems])})")
        raise ValueError("; ".join(f"rank {rank}: {problem}" for rank, problem in problems))
    kinds = _by_value([p.kind for p in proposals])
    if len(kinds) > 1:
        raise ValueError(
            "the ranks disagree on how hybrid sharding is given: "
            + "; ".join(
                f"{'a mesh' if kind == 'mesh' else 'shard_group_size'} on ranks {_ranks(ranks)}"
                for kind, ranks in kinds.items()
            )
        )
    sizes = _by_value([p.shard_size for p in proposals])
    if len(sizes) > 1:
        raise ValueError(
            "the ranks disagree on the shard group size: "
            + "; ".join(f"G={size} on ranks {_ranks(ranks)}" for size, ranks in sizes.items())
            + "; every rank must pass the same shard_group_size (with 'node', every node "
            "the same number of ranks)"
        )
    shard_size = proposals[0].shard_size
    assert shard_size is not None  # a proposal without a size has a problem, raised above
    if choice == NODE and all(p.node is not None for p in proposals):
        for start in range(0, len(proposals), shard_size):
            nodes = _by_value([p.node for p in proposals[start : start + shard_size]])
            if len(nodes) > 1:
                raise ValueError(
                    f"shard_group_size='node': ranks {start}..{start + shard_size - 1} form one shard group "
                    "but run on different nodes (GROUP_RANK "
                    + ", ".join(
                        f"{node} on ranks {_ranks([start + r for r in ranks])}" for node, ranks in nodes.items()
                    )
                    + "); launch with torchrun, which numbers the ranks of a node consecutively"
                )


def _by_value(values: list[Any]) -> dict[Any, list[int]]:
    """value -> the ranks (indices) holding it, in order of first appearance."""
    out: dict[Any, list[int]] = {}
    for rank, value in enumerate(values):
        out.setdefault(value, []).append(rank)
    return out


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks))


def _check_mesh(mesh: Any, parent_ranks: list[int]) -> int:
    """G of a (replicate, shard) mesh over exactly the parent's ranks; ValueError otherwise."""
    if getattr(mesh, "ndim", None) != 2:
        raise ValueError(
            "mesh must be a 2-D DeviceMesh with dims (replicate, shard), as FSDP2's HSDP takes it; got "
            + (f"a {mesh.ndim}-D mesh of shape {tuple(mesh.shape)}" if hasattr(mesh, "ndim") else type(mesh).__name__)
        )
    names = mesh.mesh_dim_names
    if names is not None and ("shard" in names[0].lower() or "replica" in names[1].lower()):
        raise ValueError(
            f"mesh dims are named {tuple(names)}; the first must be the replicate dim and the "
            "second the shard dim, as FSDP2's HSDP takes them: (replicate, shard)"
        )
    ranks = sorted(mesh.mesh.flatten().tolist())
    if ranks != sorted(parent_ranks):
        raise ValueError(
            f"the mesh of shape {tuple(mesh.shape)} holds ranks {ranks}, but the process group has "
            f"{len(parent_ranks)} ranks {sorted(parent_ranks)}: the mesh must cover exactly the "
            "group's ranks"
        )
    return int(mesh.size(1))


def _from_mesh(mesh: Any, world_size: int, source: str) -> ShardingGroups:
    shard_size, replica_size = int(mesh.size(1)), int(mesh.size(0))
    shard_group = mesh.get_group(1) if shard_size > 1 else None
    replica_group = mesh.get_group(0) if replica_size > 1 else None
    return ShardingGroups(
        world_size,
        shard_size,
        replica_size,
        dist.get_rank(shard_group) if shard_group is not None else 0,
        dist.get_rank(replica_group) if replica_group is not None else 0,
        tuple(dist.get_process_group_ranks(shard_group)) if shard_group is not None else (dist.get_rank(),),
        tuple(dist.get_process_group_ranks(replica_group)) if replica_group is not None else (dist.get_rank(),),
        shard_group,
        replica_group,
        source,
    )


def _trivial(parent: ProcessGroup, world_size: int, shard_size: int, source: str) -> ShardingGroups:
    """G = N (the parent is the shard group) or G = 1 (the parent is the replica group)."""
    if shard_size == world_size:
        return replace(ShardingGroups.whole(parent), source=source)
    rank, ranks = dist.get_rank(parent), tuple(dist.get_process_group_ranks(parent))
    return ShardingGroups(world_size, 1, world_size, 0, rank, (ranks[rank],), ranks, None, parent, source)


def _create(parent: ProcessGroup, world_size: int, shard_size: int, timeout_s: float | None) -> ShardingGroups:
    """Every shard group, then every replica group, on every rank in the same order; keep ours."""
    parent_ranks = dist.get_process_group_ranks(parent)
    me = dist.get_rank(parent)
    timeout = backend_timeout(timeout_s, dist.get_backend(parent)) if timeout_s is not None else None
    shard_lists, replica_lists = consecutive_groups(world_size, shard_size)
    mine: dict[str, tuple[tuple[int, ...], ProcessGroup]] = {}
    for name, lists in (("shard", shard_lists), ("replica", replica_lists)):
        for members in lists:
            ranks = [parent_ranks[i] for i in members]
            created = dist.new_group(ranks=ranks, timeout=timeout)
            if me in members:
                mine[name] = (tuple(ranks), created)
    (shard_ranks, shard_group), (replica_ranks, replica_group) = mine["shard"], mine["replica"]
    return ShardingGroups(
        world_size,
        shard_size,
        world_size // shard_size,
        me % shard_size,
        me // shard_size,
        shard_ranks,
        replica_ranks,
        shard_group,
        replica_group,
    )


__all__ = [
    "NODE",
    "ShardGroupSize",
    "ShardingGroups",
    "consecutive_groups",
    "resolve_shard_group_size",
    "sharding_groups",
]
