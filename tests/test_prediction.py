"""``Prediction``: the estimator's answer as a type, and the flat mapping it is written out as
(JSON between processes, ``harness estimate|fit`` rows) under the names users have always seen."""

from __future__ import annotations

import copy
import json

import pandas as pd
import torch

from harness.cli.fit import cell
from harness.spec import parse_spec, trial_configs
from harness.trial.estimate import Predictor, estimate_peak
from harness.trial.prediction import SPEED_COLUMNS, CardFigures, Outcome, Prediction
from tests.conftest import BASE_SPEC

CPU = torch.device("cpu")
KEYS = [
    "predicted_peak_bytes",
    "predicted_mem_param_bytes",
    "predicted_mem_grad_bytes",
    "predicted_mem_optim_bytes",
    "predicted_mem_activation_bytes",
    "predicted_mem_other_bytes",
    "num_params",
    "num_params_total",
    "num_params_nf4",
    "predicted_model_state_bytes",
]
CARD_KEYS = [
    "predicted_reserved_bytes",
    "predicted_device_bytes",
    "predicted_context_bytes",
    "predicted_nccl_bytes",
    "predicted_fragmentation_bytes",
    "predicted_mem_workspace_bytes",
    "tracked_peak_bytes",
    "card",
    "note",
]
SPEED_KEYS = list(SPEED_COLUMNS)


def through_json(prediction: Prediction) -> Prediction:
    return Prediction.from_dict(json.loads(json.dumps(prediction.to_dict())))


def config(**top):
    data = copy.deepcopy(BASE_SPEC)
    data.update(top)
    return trial_configs(parse_spec(data))[0]


def test_a_cpu_prediction_is_written_under_its_names_and_read_back_equal():
    prediction = estimate_peak(config(), CPU)
    assert prediction.ok and prediction.on_card is None and prediction.reason == ""
    assert list(prediction.to_dict()) == [*KEYS, *SPEED_KEYS]
    assert through_json(prediction) == prediction
    # The budget is held against the allocated peak, the sum of the breakdown.
    assert prediction.judged_bytes == prediction.peak_bytes == sum(prediction.breakdown.values())


def test_a_cuda_prediction_carries_the_cards_figures_and_its_replay_stays_behind():
    target = config(card="a100-80gb")
    with Predictor(target, CPU, as_cuda=True, steps_run=1, totals=True) as predictor:
        prediction = predictor.predict(target.batch_size)
    assert prediction.on_card is not None and prediction.replay is not None
    assert prediction.totals and max(prediction.totals) == prediction.on_card.tracked_peak_bytes
    assert list(prediction.to_dict()) == [*KEYS, "totals", *CARD_KEYS, *SPEED_KEYS]
    back = through_json(prediction)
    assert back == prediction and back.replay is None  # not JSON: in-process only
    assert prediction.judged_bytes == prediction.on_card.device_bytes > prediction.peak_bytes
    assert prediction.tensor_peak_bytes == prediction.on_card.tracked_peak_bytes
    assert prediction.note == prediction.on_card.note != ""
    # An A100's two cuBLAS workspaces (training loop and autograd threads) and cuBLASLt's.
    assert prediction.on_card.workspace_bytes == 2 * 8_519_680 + 2**20
    assert prediction.breakdown["other"] >= prediction.on_card.workspace_bytes


def test_a_prediction_that_failed_is_its_reason_alone():
    for outcome, made in (
        (Outcome.REFUSED, Prediction.refused("lora: no Linear layer")),
        (Outcome.CANNOT_PREDICT, Prediction.unpredictable("adam8bit: compiled code")),
    ):
        assert made.outcome is outcome and not made.ok
        assert made.to_dict() == {outcome.value: made.reason}
        assert made.peak_bytes is None and made.judged_bytes is None and made.breakdown == {}
        assert through_json(made) == made
    unpredictable = estimate_peak(config(grid={**BASE_SPEC["grid"], "strategy": ["adam8bit"]}), CPU)
    assert unpredictable.outcome is Outcome.CANNOT_PREDICT
    assert unpredictable.reason.startswith("adam8bit: ")


def test_a_table_row_is_read_with_its_other_columns_and_missing_values_left_out():
    """A fit answer's row: the search's columns beside the prediction's, NaN where another
    row of the table had a column this one lacks."""
    on_card = CardFigures(
        reserved_bytes=2048.0,
        device_bytes=4096.0,
        context_bytes=2048.0,
        nccl_bytes=0.0,
        fragmentation_bytes=512.0,
        card="a100-80gb",
        note="",
    )
    rows = pd.DataFrame(
        [
            {"budget_bytes": 8192, "value": 4, "max_tried": 64, "predicted_peak_bytes": 1536.0,
             **on_card.to_dict(), "predictions": 3},
            {"budget_bytes": 8192, "value": None, "max_tried": 64, "unpredictable": "why",
             "predictions": 2},
        ]
    ).to_dict("records")  # fmt: skip
    ok, failed = (Prediction.from_dict(row) for row in rows)
    assert ok.ok and ok.peak_bytes == 1536.0 and ok.on_card == on_card
    assert ok.breakdown == {} and ok.num_params is None  # absent, not NaN
    assert failed.outcome is Outcome.CANNOT_PREDICT and failed.reason == "why"
    # harness fit's matrix: the predicted configuration's cell is its answer, whatever the
    # other configuration's row holds.
    assert [cell(row, "batch_size") for row in rows] == ["4", "not predicted"]
