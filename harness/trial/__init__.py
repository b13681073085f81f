"""The trial layer's entry: run ONE trial from a plain JSON config, return a plain JSON result.

Imports only torch, torchvision and the standard library, so it runs on any box with PyTorch.
What this package itself exports (the config and the result) is standard library only: the
sweep layer builds and reads them without importing torch.
"""

from harness.trial.config import TrialConfig
from harness.trial.result import Status, TrialResult

__all__ = ["Status", "TrialConfig", "TrialResult"]
