"""Deciding from a recorded sweep: no trial runs here.

- ``pareto``: fronts, hypervolume, dominance, the best config within a budget;
- ``plots``: Pareto projections and memory breakdowns (PNG and interactive HTML);
- ``timelines``: a trial's memory over its memory window (PNG and HTML);
- ``report``: one self-contained HTML page for a sweep.
"""
