"""Every rank's figures for one model into one summary per configuration: a step is as long
as its slowest rank, each figure the median over the timed steps, compared with the peer, the
ZeRO formula and the planner's bytes (``shardpar.estimate_communication``)."""

from __future__ import annotations

import statistics
from typing import Any

import shardpar

from .measure import WAIT_PHASES
from .models import ModelSpec
from .optimizers import optimizer_state_bytes
from .runners import CANDIDATE, full_sharding_of, peer_of, shard_group_size_of, stage_of, zero_formula


def quantiles(values: list[float]) -> dict[str, float]:
    values = sorted(values)
    q = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else [values[0]] * 3
    return {"median": q[1], "p25": q[0], "p75": q[2], "min": values[0], "max": values[-1]}


def exposure(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Exposed seconds per phase and per step (each rank's median over the timed steps, the
    slowest rank's), the collectives alone, and the hidden fraction; what is known of them."""
    out: dict[str, Any] = {}
    if all(m["exposed"] for m in per_rank):
        out["exposed_s"] = {
            phase: max(statistics.median(step.get(phase, 0.0) for step in m["exposed"]) for m in per_rank)
            for phase in WAIT_PHASES
        }
        out["exposed_total_s"] = max(statistics.median(sum(step.values()) for step in m["exposed"]) for m in per_rank)
    if all(m["grad_alone_s"] is not None for m in per_rank):
        out["grad_alone_s"] = max(m["grad_alone_s"] for m in per_rank)
    if all(m["gather_alone_s"] is not None for m in per_rank):
        out["gather_alone_s"] = max(m["gather_alone_s"] for m in per_rank)
    if "grad_alone_s" in out and "gather_alone_s" in out:
        out["comm_alone_s"] = out["grad_alone_s"] + out["gather_alone_s"]
        if "exposed_total_s" in out and out["comm_alone_s"] > 0:
            out["hidden"] = min(1.0, max(0.0, 1 - out["exposed_total_s"] / out["comm_alone_s"]))
    return out


def bytes_by_group(per_rank: list[dict[str, Any]], closed: dict[str, dict[str, dict[str, float]]]) -> dict[str, Any]:
    """Hybrid sharding's bytes per step per group ("shard_group", "replica_group", "all_ranks"):
    every rank's (``comm_stats()["by_group"]``), and the closed form's (``by_group`` of
    ``estimate_communication``), each ``{"sent_bytes", "padding_sent_bytes"}``."""
    groups = list(dict.fromkeys([*closed, *(g for m in per_rank for g in m["sent_by_group"])]))
    keys = ("sent_bytes", "padding_sent_bytes")
    return {
        "by_group": {
            g: {k: [m["sent_by_group"].get(g, {}).get(k, 0.0) for m in per_rank] for k in keys} for g in groups
        },
        "closed_form_by_group": {g: {k: closed.get(g, {}).get("total", {}).get(k, 0.0) for k in keys} for g in groups},
    }


def summarize(spec: ModelSpec, psi: int, tensors: int, configs: list[str], ranks: list[dict], args) -> dict[str, Any]:
    """``tensors``: the model's parameter tensors, what the calls per tensor count by."""
    world = len(ranks)
    state_bytes = optimizer_state_bytes(spec.optimizers, spec.build())  # k·Ψ of the ZeRO formula
    per_config: dict[str, Any] = {}
    for config in configs:
        per_rank = [r[config] for r in ranks]
        # A step takes as long as its slowest rank.
        steps = [max(times) for times in zip(*(m["steps"] for m in per_rank))]
        phases = [[max(p[i] for p in ps) for i in range(3)] for ps in zip(*(m["phases"] for m in per_rank))]
        row: dict[str, Any] = {
            "step_s": quantiles(steps),
            "phase_s": {k: statistics.median(p[i] for p in phases) for i, k in enumerate(("fwd_bwd", "opt", "zero"))},
            "cpu_s": max(statistics.median(m["cpu"]) for m in per_rank),
            "cpu_other_s": max(statistics.median(m["cpu_other"]) for m in per_rank),
            "minor_faults": max(statistics.median(m["minor_faults"]) for m in per_rank),
            # The main thread's CPU over a step's phases ([Note: host columns] in measure.py).
            "host_s": max(statistics.median(sum(p) for p in m["phase_cpu_main"]) for m in per_rank),
            "phase_cpu_main_s": {
                k: max(statistics.median(p[i] for p in m["phase_cpu_main"]) for m in per_rank)
                for i, k in enumerate(("fwd_bwd", "opt", "zero"))
            },
            "state": [m["state"] for m in per_rank],
            "model_state": [
                sum(m["state"].get(k, 0) for k in ("params", "grads", "optimizer_state")) for m in per_rank
            ],
            # Optimizer state per rank: the ShardedOptimizers' (memory_stats()), the peers' tensors.
            "optimizer_state": [m["state"].get("optimizer_state", 0) for m in per_rank],
            "formula": zero_formula(config, psi, world, state_bytes),
            "rss_increase": [m["rss_increase"] for m in per_rank],
            "rss_peak": [m["rss_peak"] for m in per_rank],
            "rss_exact": all(m["rss_exact"] for m in per_rank),
            "final_loss": per_rank[0]["final_loss"],
        }
        if all(m["shardpar_calls"] is not None for m in per_rank):
            row["shardpar_calls"] = [m["shardpar_calls"] for m in per_rank]
        if per_rank[0]["sent_bytes"] is not None:
            stage = stage_of(config)
            options = {**args.wrap_options, **(args.candidate_options if config.endswith(CANDIDATE) else {})}
            closed = shardpar.estimate_communication(
                spec.build(),
                world,
                stage,
                bucket_cap_mb=options.get("bucket_cap_mb", shardpar.ShardConfig.bucket_cap_mb),
                wrap_policy=[spec.unit_class] if stage == 3 else None,
                align_for_bandwidth=options.get("align_for_bandwidth"),
                shard_group_size=shard_group_size_of(config),
            )
            row["sent_bytes"] = [m["sent_bytes"] for m in per_rank]
            row["padding_bytes"] = [m["padding_bytes"] for m in per_rank]
            row["closed_form_bytes"] = closed.sent_bytes
            row["closed_form_padding_bytes"] = closed.padding_sent_bytes
            if shard_group_size_of(config) is not None:
                row.update(bytes_by_group(per_rank, closed.by_group))
            row.update(exposure(per_rank))
        per_config[config] = row
    for config, row in per_config.items():
        full = full_sharding_of(config)
        if full != config and full in per_config:
            row["vs_full"] = row["step_s"]["median"] / per_config[full]["step_s"]["median"]
        if stage_of(config) is None:
            continue
        peer = peer_of(config, per_config)
        if peer in per_config:
            row["peer"] = peer
            row["vs_peer"] = row["step_s"]["median"] / per_config[peer]["step_s"]["median"]
        base = config.removesuffix(CANDIDATE)
        if base != config and base in per_config:
            row["vs_base"] = row["step_s"]["median"] / per_config[base]["step_s"]["median"]
    return {
        "model": spec.name,
        "description": spec.describe(),
        "params": psi,
        "tensors": tensors,
        "optimizers": spec.optimizers,
        "world": world,
        "configs": per_config,
    }
