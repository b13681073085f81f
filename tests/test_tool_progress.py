"""The progress of a long estimate, plan or fit: answers counted in the order they come, with
the time left, whatever order the children answer their configurations in."""

from __future__ import annotations

import io
import subprocess
import sys

from harness.sweep.tool_progress import ProgressLines, clock, relay


def test_answers_are_counted_in_the_order_they_come_with_the_time_left():
    progress = ProgressLines(total=3)
    first = progress.say("planned 3/3: 8b bf16 qlora:16, traced once for 2 cards: a, b (12.5 s)")
    second = progress.say("planned 1/3: 8b bf16 none (4.0 s)")
    third = progress.say("planned 2/3: 8b bf16 lora:16 (6.0 s)")
    assert first.startswith("[1/3] 8b bf16 qlora:16, traced once for 2 cards: a, b: 12.5 s; ")
    assert "left" in first and "left" in second
    assert second.startswith("[2/3] 8b bf16 none: 4.0 s")
    assert third.startswith("[3/3] 8b bf16 lora:16: 6.0 s") and "left" not in third
    assert progress.say("a line of another shape\n") == "a line of another shape"


def test_clock_reads_as_minutes_and_hours():
    assert (clock(5), clock(65.4), clock(3723)) == ("0:05", "1:05", "1:02:03")


def test_relay_counts_the_lines_of_several_children():
    script = "import sys, time; time.sleep(float(sys.argv[1])); print(sys.argv[2], flush=True)"
    children = [
        subprocess.Popen(
            [sys.executable, "-c", script, delay, f"estimated {index}/2: s fp32 none (0.1 s)"],
            stdout=subprocess.PIPE,
            text=True,
        )
        for index, delay in ((1, "0.6"), (2, "0"))
    ]
    out = io.StringIO()
    relay(children, total=2, out=out)
    assert [child.wait() for child in children] == [0, 0]
    lines = out.getvalue().splitlines()
    assert [line.split("]")[0] for line in lines] == ["[1/2", "[2/2"]
