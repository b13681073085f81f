"""The results table's columns, written down once: what a trial's MLflow run records as params
and tags, and the type each is read back as (MLflow keeps params and tags as text).

``tracking.trial_params`` writes exactly ``PARAMS`` (it checks), ``tracking`` writes the tags,
and ``results.tidy`` casts both back from these types: a new column is one entry here.
Metrics are ``harness.metrics.METRICS`` (all floats).
"""

from __future__ import annotations

# The trial's configuration, as params.
PARAMS: dict[str, type] = {
    "model": str,
    "model_size": str,
    "batch_size": int,
    "dtype": str,
    "strategy": str,
    "optimizer": str,
    "lr": float,
    "weight_decay": float,
    "momentum": float,
    "foreach": bool,
    "dataset": str,
    "device": str,
    "world_size": int,
    "seed": int,
    "budget": str,
    "warmup_steps": int,
    "memory_steps": int,
    "timed_steps": int,
    "device_memory_bytes": int,
}
# A model knob ``k`` is the param ``knob_k``: a number where every value is one, else text.
KNOB_PREFIX = "knob_"

# Tags every trial run may carry that the table shows as columns.
TAGS: dict[str, type] = {
    "torch_threads": int,
    "trial_key": str,
    "status": str,
    "failure_reason": str,
    "device_name": str,
    "torch_version": str,
    "throughput_unit": str,
    "git_commit": str,
    "attempts": int,
    # When the measured peak happened (forward, backward, recompute, optimizer): the worst
    # rank's; what strategies can lower it depends on it (harness.analyse.peak_phase).
    "peak_phase": str,
    # What a strategy chose or did: checkpoint:auto / sac:auto's blocks recomputed in full,
    # every checkpointed block, the plan and why; chunked_ce's chunks.
    "checkpoint_full_blocks": int,
    "checkpoint_segments": int,
    "checkpoint_policy": str,
    "recomputation": str,
    "loss_chunks": int,
    # Multi-rank trials: every rank's peak, breakdown and prediction (JSON); pp:N's blocks
    # per stage.
    "rank_memory": str,
    "pp_blocks": str,
    # What energy_j was read from, or why a trial has none.
    "energy_counter": str,
}

# The table's fixed leading columns (the grid's axes and the trial's identity), in order;
# every metric of METRICS follows, then the rest alphabetically.
ID_COLUMNS = [
    "trial_key",
    "status",
    "failure_reason",
    "model",
    "model_size",
    "batch_size",
    "dtype",
    "strategy",
    "optimizer",
    "dataset",
    "device",
    "world_size",
    "seed",
]


def typed(kind: type) -> set[str]:
    """The params and tags read back as ``kind``."""
    return {name for name, of in (PARAMS | TAGS).items() if of is kind}
