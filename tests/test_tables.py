"""Terminal tables never cut a number: at 80, 100 and 150 columns text folds or is left out
(said in one line), numbers are printed whole; ``--columns`` takes the headings it shows.

Fast: real rich consoles writing to a StringIO, fed results frames shaped like a big sweep's.
The command tests at the end (slow) record a one-trial sweep once for the module, and run
``harness estimate`` as 60- and 80-column terminals run it."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys

import pandas as pd
import pytest
from click.testing import CliRunner
from rich import box
from rich.console import Console

from harness.analyse.noise import NOISY_MARK
from harness.cli.common import (
    BREAKDOWN,
    HEADINGS,
    breakdown_cell,
    cell,
    fold,
    print_table,
    table_text,
)
from harness.cli.results import DEFAULT_COLUMNS, readable_table
from tests.conftest import BASE_SPEC, REPO, expect_exit, run_cli, write_spec
from tests.test_terminal import digits_row

STRATEGIES = ("none", "activation_checkpointing", "fsdp_full_shard+cpu_offload", "lora_r16+8bit")
WIDTHS = (80, 100, 150)


def big_frame() -> pd.DataFrame:
    """Four trials of an 8B model: long names, bytes in GiB, throughputs in the 100 thousands."""
    rows = [
        digits_row(
            model_size="llama-3.1-8b-instruct",
            strategy=strategy,
            batch_size=2048,
            trial_key=f"ab{i:014x}",
            peak_allocated_bytes=85.3e9 + i * 7.1e9,
            mem_param_bytes=16.1e9,
            mem_grad_bytes=16.1e9,
            mem_optim_bytes=32.2e9,
            mem_activation_bytes=15.0e9 + i * 7.1e9,
            mem_other_bytes=5.9e9,
            throughput=123456.7 * (i + 1),
            throughput_unit="tokens/s",
            num_params=8.03e9,
        )
        for i, strategy in enumerate(STRATEGIES)
    ]
    rows[2] |= {"status": "infeasible", "failure_reason": "predicted peak 99 GiB > 80 GiB"}
    return pd.DataFrame(rows)


def numeric_cells(frame: pd.DataFrame, columns: list[str]) -> list[str]:
    """Every number of ``columns`` as the one rule of every table prints it."""
    found = []
    for _, row in frame.iterrows():
        for column in columns:
            if column == BREAKDOWN:
                found.append(breakdown_cell(row))
            elif pd.api.types.is_numeric_dtype(frame[column]):
                found.append(cell(column, row[column], row))
    return found


def shown_headings(text: str) -> list[str]:
    """The headings of a ``table_text`` table: the words above its rule."""
    lines = text.splitlines()
    rule = next(i for i, line in enumerate(lines) if set(line.strip()) == {"─"})
    return " ".join(lines[:rule]).split()


@pytest.mark.parametrize("width", WIDTHS)
def test_the_results_table_folds_or_leaves_out_text_and_never_cuts_a_number(width):
    frame = big_frame()
    text = readable_table(frame, None, width)
    lines = text.splitlines()
    assert "…" not in text
    table = [line for line in lines if not line.startswith(("left out", "["))]
    assert max(map(len, table)) <= width, text
    headings = shown_headings(text)
    left_out = [line for line in lines if line.startswith("left out")]
    kept = [c for c in DEFAULT_COLUMNS if HEADINGS.get(c, c) in headings]
    if BREAKDOWN not in kept and "%" in headings:
        kept.append(BREAKDOWN)
    for number in numeric_cells(frame, kept):  # 79.4 GiB, 123k tokens/s, 2,048, 0.987 ...
        assert any(number in line for line in lines), (number, text)
    # a strategy's name folds only where the caller's spare columns do not make room for it
    # (the results table spares none of these): a status or a dtype matters more
    assert "fsdp_full_shard+cpu_offload" in text or width < 150
    if width == 150:
        assert not left_out and "trial" in headings
    else:
        (line,) = left_out  # one line: what is missing and how to see it
        assert line.startswith(f"left out to fit {width} columns: trial")
        assert line.endswith("(--columns picks columns; --wide or --format csv shows every one)")
        assert "trial" not in headings
    assert "infeasib" in text and lines[-1] == "[1] predicted peak 99 GiB > 80 GiB"


def test_without_a_width_the_table_is_as_wide_as_its_cells():
    text = readable_table(big_frame(), None)
    assert "activation_checkpointing" in text and "fsdp_full_shard+cpu_offload" in text
    assert "left out" not in text and "…" not in text


def test_numbers_wider_than_the_terminal_are_shown_whole_not_cut():
    frame = big_frame()
    columns = ["model_size", *(f"mem_{p}_bytes" for p in ("param", "grad", "optim", "other"))]
    text = table_text(frame, [*columns, "peak_allocated_bytes", "throughput"], width=40)
    assert "…" not in text and "left out" not in text  # leaving text out would not help
    for number in numeric_cells(frame, [*columns[1:], "peak_allocated_bytes", "throughput"]):
        assert number in text
    assert max(map(len, text.splitlines())) > 40


def render(width: int, rows: list[list[str]], spare: list[int] | None = None) -> str:
    console = Console(file=io.StringIO(), width=width, color_system=None)
    headings = ["size", "strategy", "allocated", "reserved", "device", "params", "link", "fits"]
    numeric = [False, False, True, True, True, True, False, True]
    print_table(
        console,
        headings,
        numeric,
        rows,
        "--format csv shows every column",
        spare or (),
        title="gpt: peak memory of 2 trials predicted for cuda (h100-80gb)",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
    )
    return console.file.getvalue()  # type: ignore[attr-defined]


ROWS = [
    ["gpt2-xl", "activation_checkpointing [1]", "22.7 MiB", "1.76 GiB", "81.3 GiB", "1,557.6 M",
     "NVLink 4 (900 GB/s)", "NO"],
    ["gpt2-xl", "none", "122 KiB", "2.00 MiB", "537 MiB", "1,557.6 M", "PCIe 5", "yes"],
]  # fmt: skip


@pytest.mark.parametrize("width", WIDTHS)
def test_a_rich_table_keeps_every_number_whole_at_any_width(width):
    text = render(width, ROWS)
    assert "…" not in text
    for row in ROWS:
        for number in row[2:6] + row[7:]:
            assert number in text, (number, text)
    table = text.split("left out")[0].splitlines()
    assert max(map(len, table)) <= width, text
    if width == 80:  # folding strategy is not enough: the last text column goes
        assert text.splitlines()[-1] == (
            "left out to fit 80 columns: link (--format csv shows every column)"
        )
        assert "NVLink" not in text
        assert "activation_ " in text and "checkpointing [1]" not in text  # folded after the _
    else:
        assert "left out" not in text and "NVLink 4 (900" in text


def test_the_caller_says_which_numbers_a_narrow_terminal_can_spare():
    text = render(80, ROWS, spare=[5])  # params first, then text from the right
    assert "left out to fit 80 columns: params" in " ".join(text.split())
    assert "1,557.6 M" not in text and "81.3 GiB" in text and "activation" in text


def test_text_folds_at_spaces_then_after_separators_never_inside_a_short_word():
    assert fold("activation_checkpointing [1]", 15) == "activation_\ncheckpointing\n[1]"
    assert fold("NVLink 4 (900 GB/s)", 10) == "NVLink 4\n(900 GB/s)"
    assert fold("% param/grad/optim/act/other", 12) == "% param/\ngrad/optim/\nact/other"
    assert fold("none", 4) == "none"


# -- the commands ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tables")
    done = run_cli("sweep", str(write_spec(folder, BASE_SPEC)), cwd=folder)
    expect_exit(done)
    return folder


def results_cli(folder, *args: str, columns: int | None = None):
    from harness.cli import main

    env = {"COLUMNS": str(columns)} if columns else {}
    tracking = f"sqlite:///{folder}/results/mlflow.db"
    return CliRunner().invoke(main, ["results", "--tracking-uri", tracking, *args], env=env)


@pytest.mark.slow
def test_columns_takes_the_headings_the_table_shows_in_any_case(recorded):
    by_heading = results_cli(
        recorded, "--columns", "Size,strategy,PEAK,% param/grad/optim/act/other"
    )
    assert by_heading.exit_code == 0, by_heading.output
    by_name = results_cli(
        recorded, "--columns", "model_size,strategy,peak_allocated_bytes,breakdown"
    )
    assert by_heading.output == by_name.output
    assert by_name.output.splitlines()[0].split()[:3] == ["size", "strategy", "peak"]
    assert "KiB" in by_name.output
    bad = results_cli(recorded, "--columns", "size,peek")
    assert bad.exit_code == 2
    (line,) = bad.output.strip().splitlines()
    assert line.startswith("Error: --columns: no results column 'peek'; did you mean peak")
    assert "allowed: trial_key" in line and "peak_allocated_bytes" in line
    assert line.endswith("or the headings size, batch, trial, peak, % param/grad/optim/act/other)")


@pytest.mark.slow
def test_results_fits_an_80_column_terminal_and_a_pipe_gets_whole_lines(recorded):
    narrow = results_cli(recorded, columns=80)
    assert narrow.exit_code == 0, narrow.output
    notes = ("left out", "[", NOISY_MARK)  # the lines under the table: words, soft-wrapped
    table = [line for line in narrow.output.splitlines() if not line.startswith(notes)]
    assert max(map(len, table)) <= 80 and "…" not in narrow.output
    piped = run_cli("results", cwd=recorded)  # no terminal: as wide as the cells
    expect_exit(piped)
    assert "left out" not in piped.stdout
    assert piped.stdout.splitlines()[0].split()[:6] == [
        "size", "batch", "dtype", "strategy", "status", "trial",
    ]  # fmt: skip


def harness_at(columns: int, *args: str, cwd) -> subprocess.CompletedProcess[str]:
    """``python -m harness ARGS`` as a terminal of ``columns`` columns runs it (COLUMNS)."""
    env = os.environ | {"COLUMNS": str(columns), "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "harness", *args]
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, env=env, timeout=600)


# The cross-checks first, then the breakdown's parts from the right, then MFU: throughput stays.
LEFT_OUT_AT_60 = "params, grads, optim, activ., other, model state, closed form, trainable, MFU"


@pytest.mark.slow
def test_estimate_titles_what_was_predicted_and_keeps_numbers_whole(tmp_path):
    grid = BASE_SPEC["grid"] | {"batch_size": [32, 64], "strategy": ["none", "checkpoint"]}
    spec = str(write_spec(tmp_path, BASE_SPEC | {"grid": grid}))
    csv = run_cli("estimate", spec, "--format", "csv", cwd=tmp_path)
    expect_exit(csv)
    frame = pd.read_csv(io.StringIO(csv.stdout))
    for width in (60, 80):
        done = harness_at(width, "estimate", spec, cwd=tmp_path)
        expect_exit(done)
        title = " ".join(re.split(r"\n\s*\n", done.stdout)[0].split())  # above the table
        assert title == (
            "unit: peak memory and step time of 4 trials predicted for cpu on fake tensors, nothing "
            "run; "
            "every row: size tiny, dtype fp32"
        )
        assert "()" not in done.stdout and "…" not in done.stdout
        table = re.split(r"\n(?:left out|allocated =)", done.stdout)[0].splitlines()
        assert max(map(len, table)) <= width, done.stdout
        for value in frame["predicted_peak_bytes"]:
            assert cell("predicted_peak_bytes", value) in done.stdout
        words = " ".join(done.stdout.split())
        if width == 60:
            assert f"left out to fit 60 columns: {LEFT_OUT_AT_60} (--format csv or json" in words
            assert "samples/s" in "\n".join(table)  # the throughput column, kept
