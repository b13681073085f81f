"""Memory timelines: recorded by every trial, drawn, compared, and shown in the report, which a
real headless Chromium opens over HTTP."""

from __future__ import annotations

import functools
import http.server
import json
import re
import threading

import pytest
from mlflow.tracking import MlflowClient

from harness.results import load
from tests.conftest import SHORT_TEXT, expect_exit, headless_chromium, run_cli, write_spec

pytestmark = pytest.mark.slow

SPEC = {
    "name": "timelines",
    "model": {
        "family": "gpt",
        "sizes": {"t": {"n_layer": 4, "d_model": 32, "n_head": 2, "seq_len": 32}},
    },
    "data": dict(SHORT_TEXT),
    "grid": {"batch_size": [8], "dtype": ["fp32"], "strategy": ["none", "checkpoint"]},
    "train": {"optimizer": {"name": "adam", "lr": 1.0e-3}, "budget": {"steps": 6}, "seed": 0},
    "measure": {"warmup_steps": 1, "memory_steps": 2, "timed_steps": 2},
    "device": "cpu",
}


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    folder = tmp_path_factory.mktemp("timelines")
    done = run_cli("sweep", str(write_spec(folder, SPEC)), cwd=folder)
    expect_exit(done)
    uri = f"sqlite:///{folder}/results/mlflow.db"
    return folder, uri, load("timelines", uri)


def artifact_json(uri: str, run_id: str, folder) -> dict:
    path = MlflowClient(tracking_uri=uri).download_artifacts(run_id, "trial/timeline.json", folder)
    return json.loads(open(path).read())


def test_every_ok_trial_logs_a_timeline_whose_peak_is_the_trials(swept, tmp_path):
    _, uri, frame = swept
    client = MlflowClient(tracking_uri=uri)
    assert (frame["status"] == "ok").all() and len(frame) == 2
    for _, row in frame.iterrows():
        names = {a.path for a in client.list_artifacts(row["run_id"], "trial")}
        assert {"trial/timeline.json", "trial/timeline.png"} <= names
        data = artifact_json(uri, row["run_id"], tmp_path / row["trial_key"])
        samples = data["samples"]
        assert max(samples["total"]) == data["peak_total"]
        assert abs(data["peak_total"] / row["peak_allocated_bytes"] - 1) <= 0.01
        assert set(data["phases"][p] for p in samples["phase"]) >= {
            "forward",
            "backward",
            "optimizer",
        }
        assert max(samples["micro_batch"]) >= 1  # two steps, both in the window


def test_timeline_overlays_checkpoint_on_its_none_twin(swept, tmp_path):
    folder, uri, frame = swept
    keys = dict(zip(frame["strategy"], frame["trial_key"], strict=True))
    out = tmp_path / "overlay.png"
    done = run_cli(
        "timeline", keys["checkpoint"], "--compare", keys["none"], "--out", str(out),
        "--tracking-uri", uri, cwd=folder,
    )  # fmt: skip
    expect_exit(done)
    assert out.stat().st_size > 10_000 and out.read_bytes()[:4] == b"\x89PNG"
    by_strategy = {
        row["strategy"]: artifact_json(uri, row["run_id"], tmp_path / row["strategy"])
        for _, row in frame.iterrows()
    }
    checkpoint, none = by_strategy["checkpoint"], by_strategy["none"]
    assert max(checkpoint["samples"]["activation"]) < max(none["samples"]["activation"])
    recomputed = {checkpoint["phases"][p] for p in checkpoint["samples"]["phase"]}
    assert "recompute" in recomputed  # the saw-tooth: forward re-run inside backward
    assert "recompute" not in {none["phases"][p] for p in none["samples"]["phase"]}


def test_timeline_of_an_unknown_trial_is_one_clear_line(swept):
    folder, uri, _ = swept
    done = run_cli("timeline", "feedfacefeedface", "--tracking-uri", uri, cwd=folder)
    expect_exit(done, 1)
    assert "no trial with run id or trial key 'feedfacefeedface'" in done.stderr
    assert "Traceback" not in done.stderr


def test_the_report_renders_in_headless_chromium(swept, tmp_path):
    """Served on 127.0.0.1, opened by Debian's Chromium: plots drawn, no console errors."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    folder, uri, _ = swept
    page = tmp_path / "site" / "report.html"
    done = run_cli("report", "--tracking-uri", uri, "--out", str(page), cwd=folder)
    expect_exit(done)

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

    handler = functools.partial(Quiet, directory=str(page.parent))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with headless_chromium("1400,2400", console_log=True) as browser:
            browser.get(f"http://127.0.0.1:{server.server_address[1]}/report.html")
            plots = ["#pareto", "#breakdown", "#timeline-0"]
            WebDriverWait(browser, 60).until(
                lambda b: all(b.find_elements(By.CSS_SELECTOR, f"{p} .main-svg") for p in plots)
            )
            traces = browser.find_elements(By.CSS_SELECTOR, "#timeline-0 .scatterlayer .trace")
            assert len(traces) == 5  # one stacked area per category
            screenshot = tmp_path / "report.png"  # kept with the test's files for a look
            assert browser.save_screenshot(str(screenshot))
            assert screenshot.stat().st_size > 20_000
            errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
            assert not errors, errors
    finally:
        server.shutdown()


# --- the pictures' look (issue 18): shared palette, peak markers, units; the report's answer --


def test_timeline_png_and_html_share_colours_units_and_the_peak(swept, tmp_path):
    from matplotlib.colors import to_hex

    from harness.analyse import style, timelines

    _, uri, frame = swept
    row = frame[frame["strategy"] == "checkpoint"].iloc[0]
    data = artifact_json(uri, row["run_id"], tmp_path)
    figure = timelines.timeline_matplotlib([("checkpoint", data)], "timeline")
    try:
        figure.canvas.draw()
        axis = figure.axes[0]
        areas = {
            c.get_label(): to_hex(c.get_facecolor()[0])
            for c in axis.collections
            if c.get_label() in style.BREAKDOWN_LABELS.values()
        }
        bands = {to_hex(p.get_facecolor()) for p in axis.patches}
        ticks = [t.get_text() for t in axis.get_yticklabels() if t.get_text()]
        peak_lines = [line for line in axis.lines if line.get_label().startswith("peak ")]
        legend_box = axis.get_legend().get_window_extent()
        assert legend_box.x0 >= axis.get_window_extent().x1  # the legend is outside the data
    finally:
        import matplotlib.pyplot as plt

        plt.close(figure)
    page = timelines.timeline_figure("checkpoint", data)
    expected = {style.BREAKDOWN_LABELS[c]: h.lower() for c, h in style.BREAKDOWN_COLOURS.items()}
    assert areas == {t.name: t.fillcolor.lower() for t in page.data} == expected
    html_bands = {s.fillcolor.lower() for s in page.layout.shapes if s.fillcolor}
    assert bands == html_bands and style.PHASE_COLOURS["recompute"].lower() in bands
    assert all(re.match(r"^(0|\d+(\.\d+)? (B|KiB|MiB|GiB))$", t) for t in ticks), ticks
    assert all(
        re.match(r"^(0|\d+(\.\d+)? (B|KiB|MiB|GiB))$", t) for t in page.layout.yaxis.ticktext
    )
    peak_op = data["samples"]["op"][data["peak_index"]]
    assert len(peak_lines) == 1 and list(peak_lines[0].get_xdata()) == [peak_op, peak_op]
    assert any(s.x0 == s.x1 == peak_op and s.line.color == style.PEAK for s in page.layout.shapes)


def test_the_report_in_chromium_opens_with_the_recommendation_in_units(swept, tmp_path):
    """The page as a reader sees it: the answer first, sizes and rates with units, every trial
    a link to its MLflow run."""
    from selenium.webdriver.common.by import By

    folder, uri, frame = swept
    page = tmp_path / "answer" / "report.html"
    done = run_cli("report", "--tracking-uri", uri, "--out", str(page), cwd=folder)
    expect_exit(done)
    with headless_chromium("1400,2400") as browser:
        browser.get(page.as_uri())
        text = browser.find_element(By.TAG_NAME, "body").text
        headings = [h.text for h in browser.find_elements(By.TAG_NAME, "h2")]
        answer = browser.find_element(By.ID, "recommendation")
        assert headings[0] == "Recommendation" and answer.is_displayed()
        assert answer.location["y"] < 400  # at the top of the page, above every table
        # "the fastest configuration measured", or, when the two throughputs are within noise
        # (a busy CI host), "the most accurate configuration measured among those ...".
        assert "run model_size t" in answer.text and "configuration measured" in answer.text
        assert all(role in answer.text for role in ("fastest", "most accurate", "least memory"))
        unit = frame["throughput_unit"].dropna().iloc[0]
        assert re.search(r"\d (KiB|MiB|GiB)", answer.text) and f" {unit}" in answer.text
        assert re.search(rf"\d+(\.\d+)?k? {re.escape(unit)}", text)
        assert not re.search(r"\b\d{5,}\.\d+\b", text)  # no bare float byte counts
        links = [a.get_attribute("href") for a in browser.find_elements(By.CSS_SELECTOR, "a.run")]
        for run_id in frame["run_id"]:
            assert any(h.startswith("http://127.0.0.1:5000/#/experiments/") and h.endswith(
                f"/runs/{run_id}") for h in links), run_id  # fmt: skip
        assert browser.save_screenshot(str(tmp_path / "answer.png"))
