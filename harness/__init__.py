"""harness: measure the memory / speed / accuracy trade-offs of training PyTorch models.

The code follows the data, one folder per step (docs/architecture.md is the map): ``spec``
(the YAML contract) -> ``sweep`` (plan, claim, launch) -> ``trial`` (one trial, with
``workloads``, ``strategies`` and ``meters``) -> ``record`` (MLflow) -> ``analyse`` (fronts,
plots, report), with ``cli`` on top and ``harness.results`` as the notebook API. The trial
layer imports only torch, torchvision and the standard library; the sweep layer owns the rest.
"""

__version__ = "0.1.0"
