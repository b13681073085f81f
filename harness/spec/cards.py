"""Your own cards: a YAML file of card entries, named by the spec's ``cards`` or ``--cards``.

::

    my-a6000:
      device_name: NVIDIA RTX A6000
      memory: 48GiB               # total_memory as torch reports it
      compute_capability: "8.6"
      sms: 84
      peak_tflops: {bf16: 154.8, fp16: 154.8, fp32: 38.7}
      bandwidth_tbs: 0.768
      interconnect: PCIe Gen4 x16
      context: 420MiB             # optional: a measured CUDA context

A name already in the catalogue (``harness.cuda.cards.CATALOGUE``) replaces that entry.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from harness.cuda.cards import Card, card_from_mapping
from harness.spec.errors import SpecError


def load_cards(path: Path) -> dict[str, Card]:
    """Every card in the file by its lower-case name; ``SpecError`` with one line naming the
    file and the entry on anything wrong."""
    if not path.is_file():
        raise SpecError(f"{path}: no such cards file")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise SpecError(f"{where}: invalid YAML: {problem}") from None
    except (OSError, UnicodeDecodeError) as error:
        raise SpecError(f"{path}: cannot read: {error}") from None
    if not isinstance(data, dict) or not data:
        raise SpecError(f"{path}: a cards file maps card names to their entries")
    cards = {}
    for name, entry in data.items():
        try:
            cards[str(name).lower()] = card_from_mapping(str(name).lower(), entry, str(name))
        except ValueError as error:
            raise SpecError(f"{path}: {error}") from None
    return cards
