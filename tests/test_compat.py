"""The compatibility boundary (``harness.compat``): a private piece of torch that is missing
costs only its feature, said in one line; CUDA autocast's rules register each op in its own
namespace and are undone whatever happens; ``harness doctor`` says what the torch supports."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from harness.compat import internals
from harness.compat.internals import (
    PIECES,
    Missing,
    Private,
    newer_than_installed,
    registered_ops,
    replaced,
    support,
)
from harness.cuda.autocast import cuda_autocast_rules, cuda_ops
from tests.conftest import REPO, expect_exit, run_cli


def test_every_declared_piece_is_in_the_tested_torch():
    """Tested on torch 2.14.1 (and the CI's other versions): a piece that is missing here
    would be a typo in the declaration, not an old torch. Optional pieces may be absent, and
    those of a newer release than this one."""

    def expected(piece: Private) -> bool:
        return not piece.optional and not newer_than_installed(piece.since)

    absent = [str(piece) for item in support() for piece, _ in item.missing if expected(piece)]
    assert absent == []
    assert len({piece.feature for piece in PIECES}) >= 8


def test_a_missing_piece_raises_only_when_its_feature_is_used_naming_both():
    piece = Private("a feature nobody has", "torch.utils", "_no_such_helper")
    with pytest.raises(Missing, match=r"lacks torch\.utils\._no_such_helper .*a feature nobody"):
        piece.load()
    stand_in = internals._missing_class(piece)
    assert not isinstance(torch.zeros(1), stand_in)  # usable in isinstance, never matched
    with pytest.raises(Missing, match="a feature nobody has"):
        stand_in()
    with replaced(piece, lambda original: original) as done:  # nothing to replace: no change
        assert done is False


def test_a_module_that_is_missing_is_named_with_its_import_error():
    piece = Private("old releases", "torch._no_such_module")
    with pytest.raises(Missing, match=r"module torch\._no_such_module \(ModuleNotFoundError"):
        piece.load()


def test_a_torch_without_a_dispatcher_piece_still_predicts_cpu_and_refuses_the_card():
    """A torch lacking the dispatcher dump CUDA autocast's rules read (as a release may): the
    trial layer still imports, a CPU prediction works, and a card's prediction is
    ``unpredictable`` naming the piece, instead of every trial failing at import."""
    script = textwrap.dedent(
        """
        import json, sys
        import torch
        del torch._C._dispatch_dump  # this torch lacks it
        from harness.spec import parse_spec, trial_configs
        from harness.trial.estimate import estimate_peak
        from tests.conftest import BASE_SPEC
        grid = {"batch_size": [8], "dtype": ["bf16"], "strategy": ["none"]}
        config = trial_configs(parse_spec({**BASE_SPEC, "grid": grid}))[0]
        cpu = estimate_peak(config, torch.device("cpu"))
        card = estimate_peak(config, torch.device("cpu"), as_cuda=True)
        print(json.dumps({"cpu": cpu.to_dict(), "card": card.to_dict()}))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=300
    )
    expect_exit(done)
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["cpu"]["predicted_peak_bytes"] > 0
    assert "unpredictable" in found["card"], found["card"]
    assert "torch._C._dispatch_dump" in found["card"]["unpredictable"]
    assert "CUDA-target predictions" in found["card"]["unpredictable"]


def test_cuda_autocast_rules_register_other_libraries_ops_in_their_own_namespace():
    """torchvision's ops are cast by CUDA autocast too; registering them under ``aten`` made a
    second definition that torch 2.11 refused, leaving the rules half registered for the rest
    of the process. Each goes to its own namespace, and everything is undone after."""
    import torchvision  # noqa: F401  (registers torchvision::* ops and their autocast kernels)

    others = [name for name in cuda_ops() if not name.startswith("aten::")]
    assert "torchvision::roi_align" in others
    before = set(registered_ops("AutocastCPU"))
    with cuda_autocast_rules():
        during = set(registered_ops("AutocastCPU"))
        assert set(others) <= during
    assert "aten::roi_align" not in torch._C._dispatch_get_all_op_names()
    assert set(registered_ops("AutocastCPU")) == before


@pytest.mark.slow
def test_doctor_says_what_the_installed_torch_supports(tmp_path):
    done = run_cli("doctor", "--format", "json", "--no-libraries", cwd=tmp_path)
    expect_exit(done)
    found = json.loads(done.stdout)
    assert found["torch"] == torch.__version__
    assert found["torch_in_range"] is True and found["torch_required"].startswith(">=")
    assert {item["feature"] for item in found["features"]} == {p.feature for p in PIECES}
    assert found["tensor_accounting"]["engine"] == "fast"
    table = run_cli("doctor", cwd=tmp_path)
    expect_exit(table)
    assert "Features that need private PyTorch" in table.stdout
    assert "healthy" in table.stdout
