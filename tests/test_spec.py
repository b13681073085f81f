"""Spec validation: good specs expand to the grid; each bad one fails with one clear line."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.spec import SpecError, load_spec, parse_spec, points, trial_configs
from tests.conftest import REPO, ensure_base_model, run_cli, write_spec


def test_default_spec_plans_at_least_twelve_trials():
    spec = load_spec(REPO / "experiments" / "default.yaml")
    trials = trial_configs(spec)
    assert len(trials) >= 12
    assert len({t.trial_key for t in trials}) == len(trials)
    assert {t.dtype for t in trials} == {"fp32", "bf16"}


def test_seed_cifar10_spec_is_the_article_setup():
    spec = load_spec(REPO / "experiments" / "seed_cifar10.yaml")
    assert spec.data.dataset == "cifar10"
    assert spec.grid.batch_size == [32]
    assert set(spec.grid.dtype) == {"fp32", "fp16"}
    assert spec.train.optimizer.name == "adam" and spec.train.optimizer.lr == 1e-3
    assert spec.train.budget.epochs == 10


def test_grid_is_the_product_of_axes(base_spec):
    base_spec["model"]["sizes"]["wide"] = {"width": 64, "depth": 1}
    base_spec["grid"].update(batch_size=[8, 16, 32], dtype=["fp32", "bf16"])
    spec = parse_spec(base_spec)
    assert len(points(spec)) == 2 * 3 * 2 * 1
    assert points(spec)[0] == {
        "model_size": "tiny",
        "batch_size": 8,
        "dtype": "fp32",
        "strategy": "none",
    }


def test_trial_key_is_stable_and_sensitive(base_spec):
    first = trial_configs(parse_spec(base_spec))[0].trial_key
    assert trial_configs(parse_spec(base_spec))[0].trial_key == first
    base_spec["train"]["seed"] = 1
    assert trial_configs(parse_spec(base_spec))[0].trial_key != first


def test_defaults_fill_optional_sections():
    spec = parse_spec(
        {
            "name": "x",
            "model": {"family": "cnn", "sizes": {"s": {"width": 4}}},
            "grid": {"batch_size": [8]},
        }
    )
    assert spec.grid.dtype == ["fp32"] and spec.axes()["strategy"] == ["none"]
    assert spec.tracking.mlflow_uri == "sqlite:///results/mlflow.db"
    assert spec.device == "auto" and spec.device_memory is None
    assert spec.train.budget.epochs == 1


def test_memory_sizes_and_durations_parse(base_spec):
    base_spec["device_memory"] = "16GiB"
    base_spec["limits"] = {"trial_timeout": "10m"}
    spec = parse_spec(base_spec)
    assert spec.device_memory == 16 * 2**30
    assert spec.limits.trial_timeout == 600


def test_user_model_family_passes_knobs_through(base_spec):
    base_spec["model"] = {
        "family": "mypkg.models:build",
        "sizes": {"a": {"mode": "fast", "layers": 3}},
    }
    spec = parse_spec(base_spec)
    assert trial_configs(spec)[0].model_knobs == {"mode": "fast", "layers": 3}


BAD_SPECS = [
    # (mutation, field path that must be named, a word the message must contain)
    (lambda d: d.update(unknown_key=1), "unknown_key", "unknown key"),
    (
        lambda d: d["train"].update(optimzer={"name": "adam"}),
        "train.optimzer",
        "did you mean 'optimizer'",
    ),
    (
        lambda d: d["model"].update(family="transformerr"),
        "model.family",
        "allowed: cnn, mlp, resnet",
    ),
    (lambda d: d["grid"].update(batch_size=[32, -4]), "grid.batch_size[1]", "-4"),
    (lambda d: d["grid"].update(dtype=[]), "grid.dtype", "at least one"),
    (lambda d: d["grid"].update(strategy=[]), "grid.strategy", "at least one"),
    (lambda d: d.update(device_memory="16 gigs"), "device_memory", "16GiB"),
    (lambda d: d["grid"].update(dtype=["fp23"]), "grid.dtype[0]", "did you mean 'fp32'"),
    (
        lambda d: d["grid"].update(strategy=["none", "chekpoint"]),
        "grid.strategy[1]",
        "unknown strategy",
    ),
    (
        lambda d: d["model"]["sizes"]["tiny"].update(widht=3),
        "model.sizes.tiny.widht",
        "did you mean 'width'",
    ),
    (
        lambda d: d["model"]["sizes"]["tiny"].update(width=0),
        "model.sizes.tiny.width",
        "positive integer",
    ),
    (lambda d: d["data"].update(dataset="mnist"), "data.dataset", "allowed: digits"),
    (lambda d: d["train"].update(budget={"epochs": 1, "steps": 3}), "train.budget", "exactly one"),
    (lambda d: d.pop("name"), "name", "required"),
    (lambda d: d.update(device="tpu"), "device", "auto, cpu, cuda"),
    (lambda d: d["grid"].update(batch_size=[32, 32]), "grid.batch_size[1]", "duplicate"),
    (lambda d: d["train"]["optimizer"].update(lr=0), "train.optimizer.lr", "greater than 0"),
    (
        lambda d: d.update(search={"objectives": [{"metric": "thruput", "direction": "maximize"}]}),
        "search.objectives[0].metric",
        "did you mean 'throughput'",
    ),
    (lambda d: d.update(search={"method": "bayes"}), "search.method", "grid"),
    (lambda d: d.update(search={"method": "optuna"}), "search.n_trials", "required"),
    (
        lambda d: d.update(search={"method": "optuna", "n_trials": 2, "sampler": "tpee"}),
        "search.sampler",
        "did you mean 'tpe'",
    ),
    (lambda d: d.update(search={"sampler": "tpe"}), "search.sampler", "only applies"),
    (
        lambda d: d.update(search={"method": "optuna", "n_trials": 5}),
        "search.n_trials",
        "exceeds the grid's 1 points",
    ),
    (
        lambda d: d.update(
            search={
                "objectives": [
                    {"metric": "throughput", "direction": "maximize"},
                    {"metric": "throughput", "direction": "minimize"},
                ]
            }
        ),
        "search.objectives[1].metric",
        "listed twice",
    ),
    (lambda d: d["measure"].update(warmup_steps=0), "measure.warmup_steps", "at least 1"),
    (lambda d: d.update(limits={"trial_timeout": "soon"}), "limits.trial_timeout", "duration"),
    (lambda d: d["grid"].update(batch_size="32"), "grid.batch_size", "must be a list"),
    (lambda d: d["model"].update(sizes={}), "model.sizes", "at least one"),
    (lambda d: d["data"].update(shape=[1, 8, 8]), "data.shape", "synthetic"),
    (lambda d: d["data"].update(download=True), "data.download", "cifar10"),
    (lambda d: d["train"]["optimizer"].update(momentum=0.9), "train.optimizer.momentum", "sgd"),
]


@pytest.mark.parametrize(("mutate", "path", "words"), BAD_SPECS)
def test_bad_spec_gives_one_line_naming_the_field(base_spec, mutate, path, words):
    mutate(base_spec)
    with pytest.raises(SpecError) as caught:
        parse_spec(base_spec, "exp.yaml")
    message = str(caught.value)
    assert "\n" not in message, message
    assert message.startswith(f"exp.yaml: {path}: "), message
    assert words in message, message


def test_several_problems_are_reported_one_per_line(base_spec):
    base_spec["grid"]["batch_size"] = [-1]
    base_spec["device"] = "tpu"
    with pytest.raises(SpecError) as caught:
        parse_spec(base_spec, "exp.yaml")
    lines = str(caught.value).splitlines()
    assert len(lines) == 2 and all(line.startswith("exp.yaml: ") for line in lines)


def test_yaml_syntax_error_names_file_and_line(tmp_path: Path):
    path = tmp_path / "broken.yaml"
    path.write_text("name: x\nmodel: {family: cnn\ngrid: [\n")
    with pytest.raises(SpecError, match=r"broken.yaml:\d+:\d+: invalid YAML"):
        load_spec(path)


def test_missing_and_empty_files(tmp_path: Path):
    with pytest.raises(SpecError, match="no such spec file"):
        load_spec(tmp_path / "nope.yaml")
    (tmp_path / "empty.yaml").write_text("")
    with pytest.raises(SpecError, match="the spec is empty"):
        load_spec(tmp_path / "empty.yaml")
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    with pytest.raises(SpecError, match="must be a YAML mapping"):
        load_spec(tmp_path / "list.yaml")


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda d: d["train"].update(optimzer={}), "train.optimzer"),
        (lambda d: d["model"].update(family="cnnn"), "model.family"),
        (lambda d: d["grid"].update(batch_size=[-4]), "grid.batch_size[0]"),
        (lambda d: d["grid"].update(batch_size=[]), "grid.batch_size"),
        (lambda d: d.update(device_memory="12 gigabytes please"), "device_memory"),
    ],
)
def test_validate_cli_exits_2_with_one_line_and_no_traceback(tmp_path, base_spec, mutate, field):
    mutate(base_spec)
    path = write_spec(tmp_path, base_spec, "bad.yaml")
    done = run_cli("validate", str(path), cwd=tmp_path)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"{path}: {field}: ")
    assert "Traceback" not in done.stderr + done.stdout


def test_validate_cli_accepts_good_specs(tmp_path):
    done = run_cli("validate", str(REPO / "experiments" / "default.yaml"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "ok (16 trials" in done.stdout


def test_sweep_with_bad_spec_runs_and_records_nothing(tmp_path, base_spec):
    base_spec["grid"]["batch_size"] = [0]
    path = write_spec(tmp_path, base_spec, "bad.yaml")
    done = run_cli("sweep", str(path), cwd=tmp_path)
    assert done.returncode == 2
    assert "grid.batch_size[0]" in done.stderr
    assert not (tmp_path / "results").exists()


def test_every_malformed_spec_is_exit_2_and_one_line_from_the_cli(tmp_path, base_spec):
    """The command itself (in process), on every malformed spec above plus broken files."""
    import copy

    from click.testing import CliRunner

    from harness.cli import main

    paths = []
    for index, (mutate, _, _) in enumerate(BAD_SPECS):
        data = copy.deepcopy(base_spec)
        mutate(data)
        paths.append(write_spec(tmp_path, data, f"bad{index}.yaml"))
    (tmp_path / "syntax.yaml").write_text("name: x\ngrid: [1, 2\n")
    (tmp_path / "list.yaml").write_text("- just\n- a list\n")
    (tmp_path / "empty.yaml").write_text("")
    paths += [tmp_path / n for n in ("syntax.yaml", "list.yaml", "empty.yaml", "missing.yaml")]
    assert len(paths) >= 25
    runner = CliRunner()
    for path in paths:
        done = runner.invoke(main, ["validate", str(path)])
        assert done.exit_code == 2, (path, done.output)
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(str(path)), (path, done.stderr)
        assert "Traceback" not in done.output


@pytest.mark.parametrize(
    "path", sorted((REPO / "experiments").glob("*.yaml")), ids=lambda p: p.name
)
def test_every_shipped_experiment_validates(path):
    from harness.spec import load_spec, points

    if path.name == "finetune_quality.yaml":
        pytest.importorskip("transformers")
        ensure_base_model()  # what it loads, made as `make base-model` makes it
    assert points(load_spec(path))


def test_validate_finds_user_code_without_running_it(tmp_path, base_spec):
    """A user module is looked up (spec folder, working directory, installed packages), not
    imported: a missing one is one line and exit 2; a present one is not executed."""
    (tmp_path / "mine.py").write_text("raise SystemExit('validate ran the user code')\n")
    base_spec["model"] = {"family": "mine:build", "sizes": {"s": {}}}
    done = run_cli("validate", str(write_spec(tmp_path, base_spec, "ok.yaml")), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "validate ran the user code" not in done.stdout + done.stderr
    base_spec["model"]["family"] = "nothere.models:build"
    done = run_cli("validate", str(write_spec(tmp_path, base_spec, "bad.yaml")), cwd=tmp_path)
    assert done.returncode == 2
    line = done.stderr.strip()
    assert "\n" not in line and line.startswith(f"{tmp_path / 'bad.yaml'}: model.family: ")
    assert "module 'nothere.models' not found" in line


def test_a_cuda_spec_on_a_host_without_cuda_is_refused_by_sweep_and_flagged_by_validate(
    tmp_path, base_spec
):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this host has CUDA: the refusal is for hosts without it")
    base_spec["device"] = "cuda"
    path = write_spec(tmp_path, base_spec)
    done = run_cli("sweep", str(path), cwd=tmp_path)
    assert done.returncode == 2
    line = done.stderr.strip()
    assert "\n" not in line and line.startswith(
        f"{path}: device: cuda, but this host has no usable CUDA device"
    )
    assert not (tmp_path / "results" / "mlflow.db").exists()  # nothing recorded, nothing ran
    checked = run_cli("validate", str(path), cwd=tmp_path)
    assert checked.returncode == 0 and "ok (1 trials" in checked.stdout
    assert "warning: device: cuda, but this host has no usable CUDA device" in checked.stderr


DUPLICATED = """\
name: x
model:
  family: mlp
  sizes:
    tiny: {width: 16, depth: 1}
grid:
  batch_size: [32]
  dtype: [fp32]
  batch_size: [8]
device: cpu
"""


@pytest.mark.parametrize(
    ("text", "where", "key", "first"),
    [
        (DUPLICATED, "9:3", "batch_size", 7),  # nested: the second batch_size under grid
        (
            DUPLICATED.replace("grid:\n  batch_size: [32]\n", "grid:\n") + "name: y\n",
            "10:1",
            "name",
            1,
        ),
        (  # flow style, on one line
            DUPLICATED.replace("depth: 1", "depth: 1, width: 8").replace("  batch_size: [8]\n", ""),
            "5:33",
            "width",
            5,
        ),
    ],
    ids=["nested", "top-level", "flow-mapping"],
)
def test_a_key_given_twice_is_one_line_naming_both(tmp_path, text, where, key, first):
    """PyYAML keeps the last of two equal keys without a word: the spec said ok and the sweep
    ran a grid nobody wrote. Both places are named."""
    path = tmp_path / "spec.yaml"
    path.write_text(text)
    with pytest.raises(SpecError) as caught:
        load_spec(path)
    assert (
        str(caught.value)
        == f"{path}:{where}: duplicate key {key!r} (first at line {first}); keep one"
    )


def test_merge_keys_may_still_override_and_cards_refuse_duplicates(tmp_path, base_spec):
    """``<<: *anchor`` then a key of its own is YAML's override, not a duplicate."""
    path = tmp_path / "spec.yaml"
    path.write_text(
        DUPLICATED.replace("  batch_size: [8]\n", "").replace(
            "tiny: {width: 16, depth: 1}",
            "tiny: &tiny {width: 16, depth: 1}\n    wide: {<<: *tiny, width: 32}",
        )
    )
    assert load_spec(path).model.sizes == {
        "tiny": {"width": 16, "depth": 1},
        "wide": {"width": 32, "depth": 1},
    }
    cards = tmp_path / "cards.yaml"
    cards.write_text("mine:\n  memory: 80GB\n  compute_capability: '9.0'\n  sms: 132\n  sms: 4\n")
    base_spec.update(cards=str(cards), card="mine")
    with pytest.raises(SpecError) as caught:
        parse_spec(base_spec, str(tmp_path / "spec.yaml"))
    assert str(caught.value) == f"{cards}:5:3: duplicate key 'sms' (first at line 4); keep one"


TOO_LARGE = 10**19  # int64 holds at most 2**63 - 1 = 9223372036854775807


@pytest.mark.parametrize(
    ("mutate", "field", "value"),
    [
        (lambda d: d["measure"].update(timed_steps=TOO_LARGE), "measure.timed_steps", TOO_LARGE),
        (lambda d: d["train"].update(seed=TOO_LARGE), "train.seed", TOO_LARGE),
        (
            lambda d: d["model"]["sizes"]["tiny"].update(width=TOO_LARGE),
            "model.sizes.tiny.width",
            TOO_LARGE,
        ),
        # Given as text: the schema makes the integer (100,000,000 TiB in bytes).
        (lambda d: d.update(device_memory="100000000TiB"), "device_memory", 100000000 * 2**40),
        (
            lambda d: d["measure"].update(timed_steps=str(TOO_LARGE)),
            "measure.timed_steps",
            TOO_LARGE,
        ),
    ],
    ids=["timed_steps", "seed", "knob", "bytes", "digits-as-text"],
)
def test_an_integer_no_results_column_holds_is_refused(base_spec, mutate, field, value):
    """It validated, ran, and then broke the summary, results, pareto and report for good
    (``cannot safely cast non-equivalent uint64 to int64``)."""
    mutate(base_spec)
    with pytest.raises(SpecError) as caught:
        parse_spec(base_spec, "exp.yaml")
    assert str(caught.value) == (
        f"exp.yaml: {field}: {value} is too large (at most 9223372036854775807)"
    )


def test_the_largest_int64_still_validates_and_the_smallest_below_is_refused(base_spec):
    base_spec["measure"]["timed_steps"] = 2**63 - 1
    assert parse_spec(base_spec).measure.timed_steps == 2**63 - 1
    base_spec["model"] = {"family": "mine:build", "sizes": {"s": {"shift": -(2**63) - 1}}}
    with pytest.raises(SpecError, match=r"^exp.yaml: model.sizes.s.shift: .* is too small \(at"):
        parse_spec(base_spec, "exp.yaml")


def test_an_infinite_size_is_one_line_not_a_crash(base_spec):
    base_spec["device_memory"] = float("inf")
    with pytest.raises(SpecError, match=r"^exp.yaml: device_memory: must be a finite size"):
        parse_spec(base_spec, "exp.yaml")


@pytest.mark.parametrize(
    ("text", "start"),
    [
        (DUPLICATED, "{path}:9:3: duplicate key 'batch_size'"),
        (
            DUPLICATED.replace(
                "  batch_size: [8]\n", "measure: {timed_steps: 10000000000000000000}\n"
            ),
            "{path}: measure.timed_steps: 10000000000000000000 is too large",
        ),
    ],
    ids=["duplicate", "too-large"],
)
def test_validate_cli_refuses_duplicates_and_huge_integers(tmp_path, text, start):
    path = tmp_path / "spec.yaml"
    path.write_text(text)
    done = run_cli("validate", str(path), cwd=tmp_path)
    assert done.returncode == 2, done.stdout
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(start.format(path=path)), done.stderr
    assert "Traceback" not in done.stderr + done.stdout


def hub_cache_with(folder: Path, repo_id: str) -> Path:
    """A Hugging Face hub cache holding ``repo_id``'s config.json, laid out as huggingface_hub
    writes it (models--ORG--NAME/refs/main naming the snapshot that holds the file)."""
    pytest.importorskip("huggingface_hub")
    repo = folder / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0123abcd")
    (repo / "snapshots" / "0123abcd").mkdir(parents=True)
    (repo / "snapshots" / "0123abcd" / "config.json").write_text('{"model_type": "llama"}')
    return folder


def test_a_model_id_is_checked_offline_against_folders_and_the_hub_cache(tmp_path):
    from harness.sweep.preflight import model_id_problem

    cache = hub_cache_with(tmp_path / "hub", "some-org/tiny-llama")
    assert model_id_problem("some-org/tiny-llama", str(cache)) is None
    assert model_id_problem(str(tmp_path), str(cache)) is None  # a save_pretrained folder
    missing = model_id_problem("some-org/tiny-lama", str(cache))
    assert missing is not None and "nor in the local Hugging Face cache" in missing
    assert str(cache) in missing and "fail offline" in missing
    invalid = model_id_problem("no//such id", str(cache))
    assert invalid is not None and "nor a Hugging Face repo id" in invalid


def test_validate_warns_in_one_line_about_a_model_id_it_cannot_find_offline(tmp_path, base_spec):
    pytest.importorskip("huggingface_hub")
    base_spec["model"] = {
        "family": "hf",
        "sizes": {"x": {"model_id": "nobody/no-such-model-xyz", "seq_len": 32}},
    }
    base_spec["data"] = {"dataset": "text"}
    done = run_cli("validate", str(write_spec(tmp_path, base_spec)), cwd=tmp_path)
    assert done.returncode == 0, done.stderr  # with the network a trial may still fetch it
    (line,) = done.stderr.strip().splitlines()
    assert line.endswith("fail offline")
    assert "warning: model.sizes.x.model_id: 'nobody/no-such-model-xyz' is neither a folder" in line
