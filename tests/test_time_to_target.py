"""Quality during training and time to a target (``train.budget.eval_every``, ``target``):
the trials that reach a target and the ones that do not, the eval curve, perplexity, the spec's
errors, ranking by time to target, and one sweep recording it all in MLflow."""

from __future__ import annotations

import copy
import math
from typing import Any

import pandas as pd
import pytest
import yaml

from harness.analyse.pareto import rank_fits
from harness.spec import SpecError, parse_spec, trial_configs
from harness.trial.config import Budget
from harness.trial.result import Status, TrialResult
from harness.trial.run import run_trial
from tests.conftest import BASE_SPEC, SHORT_TEXT, run_cli, write_spec

# BASE_SPEC's measured phases: 1 warm-up + 2 memory + 3 timed steps.
MEASURED = 6
GPT = {"n_layer": 1, "d_model": 32, "n_head": 2, "seq_len": 32}


def spec_with(budget: dict[str, Any], **changes: Any) -> dict[str, Any]:
    data = copy.deepcopy(BASE_SPEC)
    data["train"]["budget"] = budget
    data["train"]["optimizer"]["lr"] = 0.01  # digits/mlp passes 0.5 accuracy in ~10 steps
    data.update(changes)
    return data


def trial(data: dict[str, Any]) -> TrialResult:
    result = run_trial(trial_configs(parse_spec(data))[0])
    assert result.status == "ok", result.failure_reason
    return result


def steps(result: TrialResult) -> list[int]:
    return [int(point["step"]) for point in result.eval_history]


def test_a_reached_target_stops_training_at_that_evaluation():
    target = {"metric": "accuracy", "above": 0.5}
    result = trial(spec_with({"target": target, "max_steps": 200, "eval_every": 5}))
    metrics, curve = result.metrics, result.eval_history
    assert metrics["reached_target"] == 1.0
    reached = int(metrics["steps_to_target"])
    # The first evaluation above 0.5, none before it; a multiple of eval_every or the end of
    # the timed window (an evaluation due inside it waits for its end).
    assert reached % 5 == 0 or reached == MEASURED
    assert steps(result)[-1] == reached and curve[-1]["accuracy"] > 0.5
    assert all(point["accuracy"] <= 0.5 for point in curve[:-1])
    assert metrics["train_steps"] == max(reached, MEASURED) < 200  # stopped there
    assert metrics["accuracy"] == curve[-1]["accuracy"]  # the final quality is that point
    # Training time only: evaluation time is kept out of both.
    assert 0 < metrics["time_to_target_s"] <= metrics["train_time_s"]
    assert metrics["eval_time_s"] > 0
    assert "perplexity" not in metrics  # a classifier has none


def test_an_unreached_target_records_no_steps_or_time():
    target = {"metric": "eval_loss", "below": 1e-4}
    result = trial(spec_with({"target": target, "max_steps": 30, "eval_every": 10}))
    metrics = result.metrics
    assert metrics["reached_target"] == 0.0
    assert "steps_to_target" not in metrics and "time_to_target_s" not in metrics
    assert metrics["train_steps"] == 30
    assert steps(result) == [0, 10, 20, 30]  # step 0 included, the last step's too
    assert metrics["eval_loss"] == result.eval_history[-1]["eval_loss"] > 1e-4


def test_eval_every_with_a_step_budget_records_the_curve_only():
    result = trial(spec_with({"steps": 20, "eval_every": 4}))
    # 4 falls inside the timed window (steps 4-6): evaluated at its end, then every 4 again.
    assert steps(result) == [0, 6, 8, 12, 16, 20]
    assert all({"eval_loss", "accuracy"} <= point.keys() for point in result.eval_history)
    assert not {"reached_target", "steps_to_target"} & result.metrics.keys()
    assert result.metrics["train_steps"] == 20


def test_perplexity_is_exp_eval_loss_for_a_language_model():
    data = spec_with(
        {"steps": 8, "eval_every": 4},
        model={"family": "gpt", "sizes": {"tiny": GPT}},
        data=dict(SHORT_TEXT),
    )
    data["grid"]["batch_size"] = [4]
    metrics = trial(data).metrics
    assert metrics["perplexity"] == pytest.approx(math.exp(metrics["eval_loss"]))


def test_a_budget_without_the_new_keys_writes_and_keys_as_before():
    assert Budget(steps=20).to_dict() == {"steps": 20}
    plain = trial_configs(parse_spec(spec_with({"steps": 20})))[0]
    curve = trial_configs(parse_spec(spec_with({"steps": 20, "eval_every": 5})))[0]
    assert plain.to_dict()["budget"] == {"steps": 20}
    assert plain.trial_key != curve.trial_key
    again = Budget.from_dict(curve.to_dict()["budget"])
    assert again == curve.budget and again.text == "steps=20,eval_every=5"


TARGET = {"metric": "accuracy", "above": 0.9}
BAD_BUDGETS = [
    ({"target": {"metric": "bleu", "below": 1}, "max_steps": 9, "eval_every": 1}, "target.metric", "must be one of"),
    ({"target": {"metric": "eval_loss", "above": 2}, "max_steps": 9, "eval_every": 1}, "target.above", "takes below"),
    ({"target": {"metric": "accuracy", "below": 0.5}, "max_steps": 9, "eval_every": 1}, "target.below", "takes above"),
    ({"target": {"metric": "eval_loss"}, "max_steps": 9, "eval_every": 1}, "target.below", "required"),
    ({"target": TARGET, "eval_every": 5}, "max_steps", "required with a target"),
    ({"target": TARGET, "max_steps": 9}, "eval_every", "required with a target"),
    ({"target": TARGET, "steps": 9, "max_steps": 9, "eval_every": 1}, "steps", "not with a target"),
    ({"max_steps": 9}, "max_steps", "only applies with a target"),
    ({"steps": 9, "eval_every": 0}, "eval_every", "greater than 0"),
    ({"target": {"metric": "perplexity", "below": 9}, "max_steps": 9, "eval_every": 1}, "target.metric", "language models"),
]  # fmt: skip


@pytest.mark.parametrize(("budget", "field", "words"), BAD_BUDGETS)
def test_bad_budget_gives_one_line_naming_the_field(budget, field, words):
    with pytest.raises(SpecError) as caught:
        parse_spec(spec_with(budget), "exp.yaml")
    message = str(caught.value)
    assert "\n" not in message, message
    assert message.startswith(f"exp.yaml: train.budget.{field}"), message
    assert words in message, message


@pytest.mark.parametrize(
    ("metric", "words"),
    [("time_to_target_s", "needs train.budget.target"), ("perplexity", "language models")],
)
def test_objectives_that_every_trial_would_miss_are_refused(metric, words):
    search = {"objectives": [{"metric": metric, "direction": "minimize"}]}
    with pytest.raises(SpecError, match=f"search.objectives\\[0\\].metric: .*{words}"):
        parse_spec(spec_with({"steps": 5}, search=search), "exp.yaml")


def test_the_step_forms_of_the_budget_are_unchanged():
    for budget in ({"steps": 5}, {"epochs": 2}):
        assert parse_spec(spec_with(budget)).train.budget.as_dict() == budget
    with pytest.raises(SpecError, match="exactly one of epochs or steps"):
        parse_spec(spec_with({"steps": 5, "epochs": 1}))


def test_ranking_by_time_to_target_puts_the_fastest_first_and_leaves_misses_out():
    frame = pd.DataFrame(
        {
            "status": ["ok", "ok", "ok"],
            "peak_allocated_bytes": [1.0, 1.0, 1.0],
            "time_to_target_s": [3.0, float("nan"), 1.0],
            "strategy": ["slow", "missed", "fast"],
        }
    )
    ranked = rank_fits(frame, 2.0, "time_to_target_s").trials
    assert ranked["strategy"].tolist() == ["fast", "slow"]


def test_optuna_is_told_a_missed_target_failed_and_a_reached_one_its_time():
    from harness.sweep.plan import objective_values

    objectives = [
        {"metric": "time_to_target_s", "direction": "minimize"},
        {"metric": "reached_target", "direction": "maximize"},
    ]
    budget = {"target": {"metric": "accuracy", "above": 0.9}, "max_steps": 9, "eval_every": 3}
    spec = parse_spec(spec_with(budget, search={"objectives": objectives}))
    reached = {"reached_target": 1.0, "steps_to_target": 6.0, "time_to_target_s": 0.5}
    assert objective_values(spec, TrialResult("k", Status.OK, metrics=reached)) == [0.5, 1.0]
    missed = TrialResult("k", Status.OK, metrics={"reached_target": 0.0})
    assert objective_values(spec, missed) is None  # no time reached it: FAIL, not a number


@pytest.mark.slow
def test_a_sweep_records_time_to_target_and_the_curve_in_mlflow(tmp_path):
    from mlflow.tracking import MlflowClient

    from harness.results import load

    data = spec_with({"target": {"metric": "accuracy", "above": 0.5}, "max_steps": 60,
                      "eval_every": 5})  # fmt: skip
    data["name"] = "target"
    data["search"] = {"objectives": [{"metric": "time_to_target_s", "direction": "minimize"}]}
    done = run_cli("sweep", str(write_spec(tmp_path, data)), cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    uri = f"sqlite:///{tmp_path}/results/mlflow.db"
    frame = load("target", uri)
    row = frame.iloc[0]
    assert row["status"] == "ok" and row["reached_target"] == 1.0
    assert row["time_to_target_s"] > 0 and row["steps_to_target"] > 0
    assert "eval_loss_step" not in frame  # a history, not a column
    assert row["budget"] == "max_steps=60,eval_every=5,target=accuracy>0.5"
    client = MlflowClient(tracking_uri=uri)
    for name in ("eval_loss_step", "accuracy_step"):
        history = sorted(client.get_metric_history(row["run_id"], name), key=lambda m: m.step)
        assert history[0].step == 0
        assert history[-1].step == row["steps_to_target"]
    recommended = run_cli(
        "recommend", "--budget", "1GiB", "--objective", "time_to_target_s", cwd=tmp_path
    )
    assert recommended.returncode == 0, recommended.stdout + recommended.stderr
    assert "Recommended:" in recommended.stdout and "time_to_target_s" in recommended.stdout


@pytest.mark.slow
def test_the_shipped_fine_tuning_experiment_starts_from_real_weights_and_reaches_its_target():
    """experiments/finetune_quality.yaml, its chunked-loss row: the pre-trained model scores
    far below a random byte model's ln 256 = 5.55 on the other text before any step,
    fine-tuning reaches the spec's target within its max_steps, and perplexity is recorded
    (chunked_ce's task says it is a language model)."""
    pytest.importorskip("transformers")
    from tests.conftest import REPO, ensure_base_model

    ensure_base_model()
    path = REPO / "experiments" / "finetune_quality.yaml"
    data = yaml.safe_load(path.read_text())
    data["model"]["sizes"]["base"]["config"] = str(REPO / "results" / "base-model")
    data["grid"]["strategy"] = ["chunked_ce"]
    target = data["train"]["budget"]["target"]["below"]
    result = run_trial(trial_configs(parse_spec(data))[0])
    assert result.status == "ok", result.failure_reason
    first = result.eval_history[0]
    assert first["step"] == 0 and target < first["eval_loss"] < 2.0
    assert result.metrics["reached_target"] == 1.0
    assert result.metrics["steps_to_target"] <= data["train"]["budget"]["max_steps"]
    assert result.metrics["eval_loss"] < target
    assert result.metrics["perplexity"] == pytest.approx(math.exp(result.metrics["eval_loss"]))
