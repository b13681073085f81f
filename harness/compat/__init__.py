"""The one boundary between harness and PyTorch's private internals.

PyTorch's private modules change between releases without notice; harness needs some of them
(fake tensors, dispatch modes, MemTracker's internals, the dispatcher's registry). They are
named here and nowhere else (an import-linter contract holds it, ``pyproject.toml``):

- ``internals``: every private name outside tensor accounting, as data (``Private``: where it
  lives, which feature it enables), looked up once; a missing one costs only its feature
  (``Missing`` at use, an ``unpredictable`` prediction with the reason), never an import.
- ``memtracker``: which tensor-accounting engine this torch can run (``memtracker_fast`` on
  MemTracker's private parts, ``memtracker_public`` on its public methods), checked piece by
  piece (``memtracker.Piece``); ``snapshot_keys``: the names a snapshot files bytes under.
- ``lint``: the import-linter contract forbidding private torch anywhere else.

``harness doctor`` prints what the installed torch supports. Importing this package itself
loads nothing (``snapshot_keys`` is read without torch).
"""
