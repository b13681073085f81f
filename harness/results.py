"""The notebook API: a recorded sweep as a pandas table, and its Pareto analysis.

``harness.results.load()`` is what ``harness results`` prints; ``analyse`` is what
``harness pareto`` computes. Both live in their own step of the code (``harness.record.results``,
``harness.analyse.pareto``); this module is the one short name for them::

    from harness.results import load, analyse
    frame = load("digits-cnn")
    analysis = analyse(frame, by="dtype", budget=16 * 2**30)
"""

from harness.analyse.pareto import ParetoAnalysis, analyse
from harness.metrics import Objective
from harness.record.results import ResultsError, Sweep, load, load_sweep

__all__ = ["Objective", "ParetoAnalysis", "ResultsError", "Sweep", "analyse", "load", "load_sweep"]
