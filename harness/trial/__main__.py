"""Trial worker: ``python -m harness.trial CONFIG.json RESULT.json``.

Runs one trial in this process and writes its result JSON. An exception becomes a ``crash``
result (the traceback goes to stderr, which the launcher keeps as the trial's log); a process
killed by a signal writes nothing, and the launcher records that as ``crash`` too. A multi-rank
trial that failed (``GroupFailure``) is written by the rank that failed first, which then exits
with an error so torchrun stops any rank still waiting in a collective; the others exit quietly.
The process first ties itself to the sweep that launched it (``harness.lifeline.hold``: it exits
when that sweep, or its own parent, is gone), before anything imports torch: that is why this
module imports the trial's code (torch with it) only inside its functions.
"""

from __future__ import annotations

import gc
import os
import sys
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from harness import lifeline
from harness.trial.config import TrialConfig
from harness.trial.result import Status, TrialResult

if TYPE_CHECKING:
    from harness.trial.distributed import GroupFailure


def write_result(path: Path, result: TrialResult) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(result.to_json())
    tmp.replace(path)  # atomic: the launcher never reads half a file


def end_failed_rank(failure: GroupFailure, result_path: Path) -> NoReturn:
    """End this rank of a failed multi-rank trial: write the result if it failed first.

    ``os._exit``, not a return: leaving the group or shutting the interpreter down normally
    may wait on a collective that a stuck peer never finishes. The writer exits with an error
    when some rank did not report (torchrun stops the others only when a rank fails), and
    only after writing, so that it is not stopped first; the others exit 0 for the same reason.
    """
    from harness.trial.distributed import Ranks

    verdict, result, ranks = failure.verdict, failure.result, Ranks.from_env()
    line = f"trial {result.trial_key}: {verdict.status} {verdict.reason}"
    if verdict.writes:
        write_result(result_path, result)
        ranks.announce_written()
    else:  # this rank's own ending was a consequence of the first failure, or came after it
        mine = verdict.mine
        waited = "" if ranks.await_written() else " (its result never came)"
        line = f"rank {mine.rank} ({mine.status} {mine.reason}) deferred to: {line}{waited}"
    print(line)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1 if verdict.writes and not verdict.everyone else 0)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m harness.trial CONFIG.json RESULT.json", file=sys.stderr)
        return 2
    config_path, result_path = Path(argv[0]), Path(argv[1])
    lifeline.hold()  # before torch: a trial whose sweep is gone stops here, not after its imports
    from harness.trial.distributed import GroupFailure, Ranks

    config = TrialConfig.from_json(config_path.read_text())
    try:
        from harness.trial.run import run_trial

        result = run_trial(config, result_path.parent)
    except GroupFailure as failure:
        end_failed_rank(failure, result_path)
    except Exception as error:  # any bug or bad user code: recorded, never fatal to the sweep
        traceback.print_exc()
        reason = f"{type(error).__name__}: {error}".strip().splitlines()[0]
        result = TrialResult.failure(config.trial_key, Status.CRASH, reason)
        if Ranks.from_env().is_writer:
            write_result(result_path, result)
        return 1
    if Ranks.from_env().is_writer:  # one result per trial, however many ranks ran it
        write_result(result_path, result)
    print(f"trial {config.trial_key}: {result.status} {result.failure_reason}".rstrip())
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    # The trial's objects live until the exit: kept out of the collector, the interpreter's
    # last collection skips them (about a second with torch loaded); atexit handlers still run.
    gc.freeze()
    sys.exit(code)
