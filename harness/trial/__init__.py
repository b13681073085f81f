"""The trial layer's entry: run ONE trial from a plain JSON config, return a plain JSON result.

Imports only torch, torchvision and the standard library, so it runs on any box with PyTorch.
"""

from harness.trial.config import TrialConfig
from harness.trial.outcome import Status

__all__ = ["Status", "TrialConfig"]
