"""The command line: ``main`` (the group) and one module per step it serves.

- ``plan``: validate, estimate (look at a spec before running it);
- ``run``: sweep, worker (run and record trials);
- ``results``: results (the table);
- ``decide``: pareto, recommend, report, timeline (choose from a recorded sweep);
- ``common``: console, one-line errors, shared options, table printing.
"""

from harness.cli.main import main

__all__ = ["main"]
