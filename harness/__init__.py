"""harness: measure the memory / speed / accuracy trade-offs of training PyTorch models.

The package has two layers (see the design notes): the *trial layer* (``harness.trial``,
``harness.workloads``, ``harness.strategies``, ``harness.meters``) runs one trial with only torch,
torchvision and the standard library, and the *sweep layer* (``spec``, ``search``, ``launch``,
``tracking``, ``results``, ``cli``) plans, launches and records trials.
"""

__version__ = "0.1.0"
