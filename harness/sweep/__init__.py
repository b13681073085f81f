"""Running a sweep: plan the grid's trials, claim each point, launch its trial in a process of
its own, record what it measured.

- ``run``: a sweep (or one worker of it) from start to recorded results, with progress;
- ``workers``: ``--workers N`` on one host, one GPU per worker;
- ``plan``: the Optuna study, what it proposes next, what it is told;
- ``claim``: several workers on one study (claims, heartbeats, dead workers);
- ``launch``: one trial in its own process (warm fork, fresh interpreter or torchrun);
- ``preflight``: the stores checked before any trial runs;
- ``estimate``: the grid's peaks predicted without running (``harness estimate``).
"""
