"""How a multi-rank trial's ranks are arranged: the device mesh's dimensions and sizes.

Plain data (standard library only): the spec's combinations (``combination.py``) make a layout,
the strategies' context carries it (``base.TrialContext``) and ``mesh.py`` builds the torch
``DeviceMesh`` from it.
"""

from __future__ import annotations

from dataclasses import dataclass

# The mesh's dimensions, outermost first (torchtitan's order): pipeline stages, data-parallel
# replicas or shards, context (sequence) shards, tensor shards; neighbouring ranks share the
# innermost dimension, whose collectives are the most frequent.
MESH_DIMS = ("pp", "dp", "cp", "tp")


@dataclass(frozen=True)
class Layout:
    """How a trial's ranks are arranged: each mesh dimension's size (1 where absent)."""

    sizes: tuple[tuple[str, int], ...] = ()  # (dimension, size), in MESH_DIMS order

    def size(self, dim: str) -> int:
        return dict(self.sizes).get(dim, 1)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(dim for dim, _ in self.sizes)

    @property
    def world_size(self) -> int:
        total = 1
        for _, size in self.sizes:
            total *= size
        return total

    def coordinates(self, rank: int) -> dict[str, int]:
        """Where ``rank`` sits on each dimension (row-major: the last dimension varies fastest)."""
        out: dict[str, int] = {}
        for dim, size in reversed(self.sizes):
            rank, out[dim] = divmod(rank, size)
        return out

    def pipelines(self) -> list[list[int]]:
        """The ranks of each pipeline, first stage first: ranks that differ only on ``pp``."""
        by_rest: dict[tuple[tuple[str, int], ...], list[int]] = {}
        for rank in range(self.world_size):
            where = self.coordinates(rank)
            rest = tuple(sorted((d, i) for d, i in where.items() if d != "pp"))
            by_rest.setdefault(rest, []).append(rank)
        return [
            sorted(ranks, key=lambda r: self.coordinates(r).get("pp", 0))
            for ranks in by_rest.values()
        ]

    def roles(self) -> list[int]:
        """One rank per distinct memory role, lowest first: a pipeline's stages differ (what
        they hold, how many micro-batches' activations); ranks that differ on any other
        dimension hold the same bytes."""
        stages = self.size("pp")
        per_stage = self.world_size // stages
        return [stage * per_stage for stage in range(stages)]
