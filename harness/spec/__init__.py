"""The experiment spec: what a user writes (YAML), checked before anything runs, and expanded
into one ``TrialConfig`` per grid point.

- ``schema``: the pydantic models, one per section, with their defaults and checks;
- ``errors``: ``SpecError`` and the helpers that make every complaint one line;
- ``load``: YAML file -> ``Spec``, pydantic's errors turned into those lines;
- ``grid``: points, trial configs and the grid hash (``SweepPlan``: a spec's grid as a sweep on
  one host resolves it, computed once).
"""

from harness.spec.errors import SpecError
from harness.spec.grid import (
    SweepPlan,
    grid_hash,
    points,
    trial_config,
    trial_configs,
    with_card,
)
from harness.spec.load import load_spec, parse_spec
from harness.spec.schema import Spec

__all__ = [
    "Spec",
    "SpecError",
    "SweepPlan",
    "grid_hash",
    "load_spec",
    "parse_spec",
    "points",
    "trial_config",
    "trial_configs",
    "with_card",
]
