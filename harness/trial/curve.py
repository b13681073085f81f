"""Evaluation during training (``train.budget.eval_every``): the held-out quality curve, and the
step and training time at which a ``target`` was first met.

Evaluations run between training steps, never inside the memory or timed window (they would
change what those measure): one due inside a window runs at the window's end. Their time is
kept apart, so that training time (``train_time_s``, ``time_to_target_s``) excludes it, as
MLPerf's time to train excludes evaluation.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from harness.meters.timing import synchronize
from harness.trial.config import Target


@dataclass(frozen=True)
class Point:
    """One evaluation: after ``step`` optimizer steps, ``train_s`` seconds of training."""

    step: int
    train_s: float
    metrics: dict[str, float]


def is_language_model(family: str, task: object) -> bool:
    """Whether a trial predicts the next token (perplexity means something): the gpt family,
    or a Hugging Face model built as a causal LM."""
    return family == "gpt" or bool(getattr(task, "causal", False))


def with_perplexity(metrics: dict[str, float], language_model: bool) -> dict[str, float]:
    """``perplexity`` beside ``eval_loss`` for a language model (the loss is per token, so its
    exponential is the per-token perplexity); a classifier has none."""
    if language_model and "eval_loss" in metrics:
        loss = metrics["eval_loss"]
        metrics["perplexity"] = math.exp(loss) if loss < 700 else math.inf  # exp overflows
    return metrics


@dataclass
class Curve:
    """The evaluations every ``every`` steps (step 0 included) and the ``target``, if any.

    ``evaluate`` scores the model on the held-out split; ``clock`` reads the training time so
    far (its caller subtracts ``spent_s``, the evaluations' own time).
    """

    every: int
    evaluate: Callable[[], dict[str, float]]
    device: torch.device
    target: Target | None = None
    points: list[Point] = field(default_factory=list)
    reached: Point | None = None
    spent_s: float = 0.0
    next_due: int = 0

    def due(self, step: int) -> bool:
        """Whether an evaluation is owed at ``step``: a multiple of ``every`` was reached (or
        passed inside a measured window) since the last one."""
        return step >= self.next_due

    def run(self, step: int, train_s: float) -> Point:
        """Evaluate now, after ``step`` steps and ``train_s`` seconds of training."""
        synchronize(self.device)
        start = time.perf_counter()
        point = Point(step, train_s, self.evaluate())
        synchronize(self.device)
        self.spent_s += time.perf_counter() - start
        self.points.append(point)
        self.next_due = (step // self.every + 1) * self.every
        if self.reached is None and self.target is not None and self.target.met(point.metrics):
            self.reached = point
        return point

    @property
    def done(self) -> bool:
        """The target was met: training may stop (once the measured phases have run)."""
        return self.reached is not None

    def metrics(self) -> dict[str, float]:
        """``reached_target`` (with a target), and where it was reached ``steps_to_target`` and
        ``time_to_target_s``; absent when it was not (no step or time reached it)."""
        if self.target is None:
            return {}
        if self.reached is None:
            return {"reached_target": 0.0}
        return {
            "reached_target": 1.0,
            "steps_to_target": float(self.reached.step),
            "time_to_target_s": self.reached.train_s,
        }

    def history(self) -> list[dict[str, float]]:
        """The curve as plain rows (``TrialResult.eval_history``): step, then each metric."""
        return [{"step": float(p.step), **p.metrics} for p in self.points]
