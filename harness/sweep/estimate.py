"""``harness estimate``: every grid point's predicted peak and breakdown, nothing run.

The prediction itself is the trial layer's (``python -m harness.trial.estimate``, fake
tensors, the trial's own code); it runs in a child process so this one never imports model
code. Its progress lines stream to stderr as it goes.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pandas as pd

from harness.cuda.margin import CARD_MARGIN
from harness.spec import SweepPlan
from harness.sweep.tool_progress import relay
from harness.trial.prediction import FAILURES, SPEED_COLUMNS

COLUMNS = [
    "model_size",
    "batch_size",
    "dtype",
    "strategy",
    "predicted_peak_bytes",
    "predicted_reserved_bytes",
    "predicted_device_bytes",
    "predicted_mem_param_bytes",
    "predicted_mem_grad_bytes",
    "predicted_mem_optim_bytes",
    "predicted_mem_activation_bytes",
    "predicted_mem_other_bytes",
    "predicted_mem_workspace_bytes",  # CUDA targets: the library workspaces, part of other
    "predicted_model_state_bytes",
    "closed_form_model_state_bytes",
    "korthikanti_activation_bytes",
    "num_params",
    "fits",
    "safety_margin_bytes",  # held back from the budget before fits (harness.cuda.margin)
    *SPEED_COLUMNS,
    "card",
    "predicted_context_bytes",
    "predicted_nccl_bytes",
    "predicted_fragmentation_bytes",
    "device",
    "trial_key",
    "estimate_seconds",
    *(outcome.value for outcome in FAILURES),  # refused, unpredictable: why a row has none
    "recomputation",  # checkpoint:auto / sac:auto: the plan chosen for the budget, and why
    "predicted_stage_peaks",  # pp:N: every stage's peak (the row's figures: the worst's)
    "note",
]


class EstimateError(Exception):
    """The estimator process failed; the message is its last line."""


def run_trial_tool(module: str, request: dict[str, Any], what: str, processes: int = 1) -> Any:
    """``python -m MODULE IN.json OUT.json`` of the trial layer in child processes (this one
    never imports model code): one answer per config of ``request``, in its order; progress
    lines go to our stderr as they come, counted in the order answers come, with the time left
    (``tool_progress``); a failure is ``EstimateError`` with its last line.

    ``processes`` children answer the request together (predictions are single-threaded
    Python: N cores answer in about 1/N of the time), each taking the next config no other
    has claimed (``harness.trial.tool``): a queue rather than fixed shares, so one slow config
    (an 8B QLoRA) does not leave a core idle while another child still holds a backlog."""
    processes = max(1, min(processes, len(request["configs"])))
    with tempfile.TemporaryDirectory() as folder, contextlib.ExitStack() as files:
        given, claims = Path(folder) / "in.json", Path(folder) / "claims"
        claims.mkdir()
        given.write_text(json.dumps({**request, "claims": str(claims)}))
        children = []
        for index in range(processes):
            answer = Path(folder) / f"out{index}.json"
            errors = files.enter_context((Path(folder) / f"err{index}.txt").open("w+"))
            child = subprocess.Popen(
                [sys.executable, "-m", module, str(given), str(answer)],
                stdout=subprocess.PIPE,
                stderr=errors,
                text=True,
            )
            children.append((child, answer, errors))
        try:
            relay([child for child, _, _ in children], len(request["configs"]))
            codes = [child.wait() for child, _, _ in children]
        except BaseException:  # Ctrl-C: no prediction outlives the command
            for child, _, _ in children:
                child.kill()
            raise
        for code, (_, _, errors) in zip(codes, children, strict=True):
            if code != 0:
                errors.seek(0)
                raise EstimateError(failure(what, errors.read()))
        merged: list[Any] = [None] * len(request["configs"])
        for _, answer, _ in children:  # each child answered the configs it claimed
            for index, found in enumerate(json.loads(answer.read_text())):
                if found is not None:
                    merged[index] = found
        return merged


def failure(what: str, stderr: str) -> str:
    """One line for a failed child: its last line, and where its whole output (a crash's
    traceback) was kept, since the folder it was written to goes away."""
    lines = stderr.strip().splitlines()
    message = f"{what} failed: {lines[-1] if lines else 'no output'}"
    if len(lines) > 1:
        handle, path = tempfile.mkstemp(prefix="harness-estimator-", suffix=".log")
        with os.fdopen(handle, "w") as log:
            log.write(stderr)
        message += f" (its output, traceback and all: {path})"
    return message


def estimate_grid(sweep: SweepPlan, target: str) -> pd.DataFrame:
    """One row per grid point, in grid order: the prediction for ``target`` (cpu | cuda),
    whether it ``fits`` the budget (``device_memory``, else the card's memory), and the
    closed-form cross-checks. A CUDA target is judged on ``predicted_device_bytes`` (what the
    card holds: reserved segments + context + NCCL), a CPU one on the allocated peak."""
    spec, configs = sweep.spec, sweep.configs
    print(f"estimating {len(configs)} trials for {target} ...", file=sys.stderr, flush=True)
    request = {"device": target, "configs": [c.to_dict() for c in configs]}
    frame = pd.DataFrame(run_trial_tool("harness.trial.estimate", request, "the estimator"))
    frame["model_size"] = [c.model_size for c in configs]
    frame["batch_size"] = [c.batch_size for c in configs]
    frame["dtype"] = [c.dtype for c in configs]
    frame["strategy"] = [c.strategy_text for c in configs]
    frame["device"] = target
    judged = judged_column(frame)
    budget = spec.memory_budget
    if budget and judged is not None:
        predicted = frame[judged]
        usable = usable_budget(budget, judged)
        frame["fits"] = (predicted <= usable).astype("boolean").where(predicted.notna())
        if usable < budget:
            frame["safety_margin_bytes"] = float(budget - usable)
    return frame.reindex(columns=[c for c in COLUMNS if c in frame.columns])


def usable_budget(budget: float, judged: str) -> float:
    """What a prediction may reach and still fit ``budget``: a card's device figure is held to
    the budget less the safety margin the card runs support (``harness.cuda.margin``); a CPU's
    allocated figure to the budget itself."""
    return CARD_MARGIN.usable(budget) if judged == "predicted_device_bytes" else budget


def judged_column(frame: pd.DataFrame) -> str | None:
    """The prediction a budget is held against: the device figure where there is one (CUDA),
    else the allocated peak."""
    for column in ("predicted_device_bytes", "predicted_peak_bytes"):
        if column in frame:
            return column
    return None
