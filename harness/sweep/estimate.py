"""``harness estimate``: every grid point's predicted peak and breakdown, nothing run.

The prediction itself is the trial layer's (``python -m harness.trial.estimate``, fake
tensors, the trial's own code); it runs in a child process so this one never imports model
code. Its progress lines stream to stderr as it goes.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pandas as pd

from harness.spec import Spec, trial_configs

COLUMNS = [
    "model_size",
    "batch_size",
    "dtype",
    "strategy",
    "predicted_peak_bytes",
    "predicted_mem_param_bytes",
    "predicted_mem_grad_bytes",
    "predicted_mem_optim_bytes",
    "predicted_mem_activation_bytes",
    "predicted_mem_other_bytes",
    "predicted_model_state_bytes",
    "closed_form_model_state_bytes",
    "korthikanti_activation_bytes",
    "num_params",
    "fits",
    "device",
    "trial_key",
    "estimate_seconds",
    "refused",
    "unpredictable",
    "note",
]


class EstimateError(Exception):
    """The estimator process failed; the message is its last line."""


def run_trial_tool(module: str, request: dict[str, Any], what: str) -> Any:
    """``python -m MODULE IN.json OUT.json`` of the trial layer, in a child process (this one
    never imports model code): its answer; its progress lines go to our stderr as they come,
    its failure is ``EstimateError`` with its last line."""
    return run_trial_tools(module, [request], what)[0]


def run_trial_tools(module: str, requests: list[dict[str, Any]], what: str) -> list[Any]:
    """``run_trial_tool`` for several requests at once, one child process each (predictions
    are single-threaded Python: N cores answer N requests in the time of one); the answers
    in request order."""
    with tempfile.TemporaryDirectory() as folder, contextlib.ExitStack() as files:
        children = []
        for index, request in enumerate(requests):
            given, answer = Path(folder) / f"in{index}.json", Path(folder) / f"out{index}.json"
            given.write_text(json.dumps(request))
            errors = files.enter_context((Path(folder) / f"err{index}.txt").open("w+"))
            child = subprocess.Popen(
                [sys.executable, "-m", module, str(given), str(answer)],
                stdout=sys.stderr,
                stderr=errors,
                text=True,
            )
            children.append((child, answer, errors))
        try:
            codes = [child.wait() for child, _, _ in children]
        except BaseException:  # Ctrl-C: no prediction outlives the command
            for child, _, _ in children:
                child.kill()
            raise
        for code, (_, _, errors) in zip(codes, children, strict=True):
            if code != 0:
                errors.seek(0)
                lines = errors.read().strip().splitlines()
                raise EstimateError(f"{what} failed: {lines[-1] if lines else 'no output'}")
        return [json.loads(answer.read_text()) for _, answer, _ in children]


def estimate_grid(spec: Spec, target: str) -> pd.DataFrame:
    """One row per grid point, in grid order: the prediction for ``target`` (cpu | cuda),
    whether it ``fits`` in ``device_memory``, and the closed-form cross-checks."""
    configs = trial_configs(spec)
    print(f"estimating {len(configs)} trials for {target} ...", file=sys.stderr, flush=True)
    request = {"device": target, "configs": [c.to_dict() for c in configs]}
    frame = pd.DataFrame(run_trial_tool("harness.trial.estimate", request, "the estimator"))
    frame["model_size"] = [c.model_size for c in configs]
    frame["batch_size"] = [c.batch_size for c in configs]
    frame["dtype"] = [c.dtype for c in configs]
    frame["strategy"] = [c.strategy_text for c in configs]
    frame["device"] = target
    if spec.device_memory and "predicted_peak_bytes" in frame:
        predicted = frame["predicted_peak_bytes"]
        frame["fits"] = (predicted <= spec.device_memory).astype("boolean").where(predicted.notna())
    return frame.reindex(columns=[c for c in COLUMNS if c in frame.columns])
