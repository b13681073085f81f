"""A strategy term (``accumulate:4``) and a combination of them (``checkpoint+accumulate:4``),
parsed and checked once against the registry, then asked instead of re-parsed.

The spec validates each ``grid.strategy`` entry into a ``Combination``; a ``TrialConfig``
carries it; everything that needs to know what a trial's strategies do (its world size, how
it splits a batch, whether it runs under torchrun, which registry entries apply) asks it. The
text forms stay exactly as the spec wrote them (stripped): the grid point, the trial JSON, the
MLflow params and the results table hold ``Combination.text`` / ``Combination.texts``, so trial
keys do not move. Standard library only (the registry is plain data): the spec validates
without loading model code.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from harness.strategies import ALIASES, STRATEGIES, USER_FAMILY, StrategyInfo
from harness.strategies.layout import MESH_DIMS, Layout

if TYPE_CHECKING:
    from harness.strategies.base import Strategy


@dataclass(frozen=True)
class Term:
    """One strategy of a combination: a registry name and its argument as written."""

    name: str
    # What followed the colon, as written (" 4" stays " 4"); None: no colon. Empty only for an
    # optional argument left out (``checkpoint:``), which the strategy receives as None.
    arg: str | None = None

    @classmethod
    def parse(cls, written: str) -> Term:
        """``name`` or ``name:arg``, checked against the registry; ``ValueError`` when wrong."""
        name, sep, arg = str(written).strip().partition(":")
        if name in ALIASES:
            raise ValueError(f"{name!r} is not a strategy: {ALIASES[name]}")
        if name not in STRATEGIES:
            raise ValueError(f"unknown strategy {name!r}")
        info = STRATEGIES[name]
        if info.arg is None and sep:
            raise ValueError(f"strategy {name!r} takes no argument (got {written!r})")
        if info.arg is not None and (not sep or not arg) and not info.arg_optional:
            raise ValueError(f"strategy {name!r} needs an argument: {name}:<{info.arg}>")
        if info.auto and arg.strip() == "auto":
            return cls(name, arg)
        if info.words:
            if arg and arg.strip() not in info.words:
                allowed = ", ".join(f"{name}:{word}" for word in info.words)
                raise ValueError(
                    f"strategy {name!r}: unknown {info.arg} {arg!r} (allowed: {allowed})"
                )
            return cls(name, arg.strip() if sep else None)
        arg, _, option = arg.partition(":") if info.options else (arg, "", "")
        if option and option.strip() not in info.options:
            allowed = ", ".join(f"{name}:N:{o}" for o in info.options if o)
            raise ValueError(f"strategy {name!r}: unknown option {option!r} (allowed: {allowed})")
        if info.arg_type is None and arg:
            raise ValueError(f"strategy {name!r}: the argument may only be auto (got {arg!r})")
        if info.arg is not None and arg and info.arg_type is not None:
            try:
                value = info.arg_type(arg)
            except ValueError:
                kind = "an integer" if info.arg_type is int else "a number"
                raise ValueError(
                    f"strategy {name!r}: {info.arg} must be {kind} (got {arg!r})"
                ) from None
            if value <= 0 or (info.arg_max is not None and value >= info.arg_max):
                bound = (
                    f"between 0 and {info.arg_max:g} (exclusive)" if info.arg_max else "positive"
                )
                raise ValueError(f"strategy {name!r}: {info.arg} must be {bound} (got {arg})")
        return cls(name, (f"{arg}:{option}" if option else arg) if sep else None)

    @property
    def text(self) -> str:
        """The term as the spec wrote it (stripped), e.g. ``accumulate:4``."""
        return self.name if self.arg is None else f"{self.name}:{self.arg}"

    @property
    def info(self) -> StrategyInfo:
        return STRATEGIES[self.name]

    @property
    def given(self) -> str | None:
        """The argument the strategy receives: None where none was given."""
        return self.arg or None

    @property
    def auto(self) -> bool:
        """``checkpoint:auto``, ``sac:auto``: chosen for the memory budget before training."""
        return self.info.auto and (self.arg or "").strip() == "auto"

    @property
    def number(self) -> int | None:
        """The argument as an integer (ranks, micro-batches), None where none was given."""
        number = (self.arg or "").partition(":")[0]
        return int(number) if number else None

    @property
    def option(self) -> str:
        """The word after the number (``sp`` of ``tp:2:sp``), else the registry's default."""
        written = (self.arg or "").partition(":")[2].strip()
        return written or (self.info.options[0] if self.info.options else "")

    def build(self) -> Strategy:
        """The strategy object (imports its module, hence torch)."""
        from harness.workloads import resolve

        return resolve(self.info.impl)(self.given)


def recorded_names(written: object) -> list[str]:
    """The strategy names in a recorded one-string form (``checkpoint+accumulate:4`` ->
    ``["checkpoint", "accumulate"]``), unchecked: a results row may hold a combination that an
    older or newer registry judges differently, and reading it must not fail. Not a string
    (a missing value): none."""
    if not isinstance(written, str):
        return []
    return [text.strip().partition(":")[0] for text in written.split("+") if text.strip()]


@dataclass(frozen=True)
class Combination:
    """The strategies of one trial, in the order they apply; valid by construction when made
    by ``parse`` (no clash, nothing twice, what a strategy modifies present)."""

    terms: tuple[Term, ...]

    @classmethod
    def parse(cls, written: str | Sequence[str]) -> Combination:
        """A list of terms, or the one-string form ``a+b:4``; ``ValueError`` naming the term or
        the clashing pair when wrong."""
        texts = written.split("+") if isinstance(written, str) else list(written)
        terms = tuple(Term.parse(text) for text in texts)
        names = [term.name for term in terms]
        if not names:
            raise ValueError("an empty strategy combination; use 'none' for plain training")
        if "none" in names and len(names) > 1:
            raise ValueError("'none' cannot be combined with other strategies")
        for i, first in enumerate(names):
            for second in names[i + 1 :]:
                if first == second:
                    raise ValueError(f"strategy {first!r} appears twice in one combination")
                a, b = STRATEGIES[first], STRATEGIES[second]
                if a.group is not None and a.group == b.group:
                    raise ValueError(
                        f"{first!r} and {second!r} cannot be combined: both choose the {a.group}"
                    )
                if second in a.conflicts or first in b.conflicts:
                    raise ValueError(f"{first!r} and {second!r} cannot be combined")
        for name in names:
            needed = STRATEGIES[name].requires
            if needed is not None and needed not in names:
                raise ValueError(
                    f"{name!r} modifies {needed!r}: combine them, e.g. [{needed}:2, {name}]"
                )
        combination = cls(terms)
        combination.check_layout()
        return combination

    def check_layout(self) -> None:
        """The mixes of model-parallel layouts that cannot run, refused with both names."""
        names = self.names
        if "cp" in names and ("tp" in names or "pp" in names):
            other = "tp" if "tp" in names else "pp"
            raise ValueError(
                f"'cp' and {other!r} cannot be combined yet: context parallelism composes with "
                "fsdp and ddp only"
            )
        if "ddp" in names and "tp" in names:
            raise ValueError(
                "'ddp' and 'tp' cannot be combined: DDP does not take tensor-parallel "
                "(DTensor) parameters; use [fsdp:N, tp:M]"
            )
        pipeline = self.term("pp")
        if pipeline is None:
            return
        for term in self.terms:
            if term.auto:
                raise ValueError(
                    f"{term.text!r} and 'pp' cannot be combined: :auto chooses one plan for "
                    "the whole model, and a pipeline's stages need one each"
                )
        micro = self.pipeline_micro_batches
        stages = pipeline.number or 1
        if pipeline.option == "interleaved" and micro % stages:
            raise ValueError(
                f"{pipeline.text}: the interleaved schedule needs micro-batches (accumulate:K) "
                f"a multiple of the {stages} stages (got {micro})"
            )

    def __iter__(self) -> Iterator[Term]:
        return iter(self.terms)

    @property
    def text(self) -> str:
        """The one-string form, e.g. ``checkpoint+accumulate:4`` (grid points, the results
        table, MLflow's ``strategy`` param)."""
        return "+".join(self.texts)

    @property
    def texts(self) -> list[str]:
        """The terms as written, e.g. ``["checkpoint", "accumulate:4"]`` (the trial JSON)."""
        return [term.text for term in self.terms]

    @property
    def names(self) -> list[str]:
        return [term.name for term in self.terms]

    @property
    def infos(self) -> list[StrategyInfo]:
        return [term.info for term in self.terms]

    def has_group(self, group: str) -> bool:
        """Whether a strategy of ``group`` (``adapters``, ``parallel``, ...) is in it."""
        return any(info.group == group for info in self.infos)

    def term(self, name: str) -> Term | None:
        return next((term for term in self.terms if term.name == name), None)

    @property
    def layout(self) -> Layout:
        """The device mesh its ``ddp``/``fsdp``/``tp``/``pp``/``cp`` terms make."""
        sizes = {
            term.info.mesh_dim: term.number or 1
            for term in self.terms
            if term.info.mesh_dim is not None
        }
        return Layout(tuple((dim, sizes[dim]) for dim in MESH_DIMS if dim in sizes))

    @property
    def world_size(self) -> int:
        """Processes a trial with these strategies runs on: the product of its mesh's
        dimensions (``[fsdp:2, tp:2]``: 4), else 1."""
        return self.layout.world_size

    @property
    def pipeline_micro_batches(self) -> int:
        """Micro-batches a pipeline step runs: ``accumulate:K``'s K, else 2 per stage; 1
        without ``pp``."""
        pipeline, accumulate = self.term("pp"), self.term("accumulate")
        if pipeline is None:
            return 1
        if accumulate is not None and accumulate.number is not None:
            return accumulate.number
        return 2 * (pipeline.number or 1)

    @property
    def batch_step(self) -> int:
        """The batch sizes these strategies allow are the multiples of this: each ``ddp:N``,
        ``fsdp:N`` and ``accumulate:K`` splits the batch that many ways, ``pp:N`` into its
        micro-batches (2N unless ``accumulate:K`` says K)."""
        step = 1
        for term in self.terms:
            if term.info.splits_batch and term.number is not None:
                step *= term.number
        if self.term("pp") is not None and self.term("accumulate") is None:
            step *= self.pipeline_micro_batches
        return step

    @property
    def chooses_for_budget(self) -> bool:
        """Whether a term is ``auto``: the trial needs a memory budget to choose for."""
        return any(term.auto for term in self.terms)

    @property
    def needs_process_group(self) -> bool:
        """Whether a trial runs under torchrun: any ``ddp:N``/``fsdp:N``/``tp:N``/``pp:N``/
        ``cp:N``, ``N = 1`` included."""
        return any(info.mesh_dim is not None for info in self.infos)

    def check_context(self, dtype: str, family: str, device: str, batch_size: int) -> None:
        """Check it against the other axes of a grid point; ``ValueError`` if it clashes."""
        splits = self.batch_step
        if batch_size % splits:
            raise ValueError(
                f"{self.text} splits each batch {splits} ways: batch_size {batch_size} is not a multiple of {splits}"
            )
        for term in self.terms:
            info = term.info
            if dtype in info.bad_dtypes:
                raise ValueError(f"strategy {term.name!r} cannot be combined with dtype {dtype!r}")
            user_ok = ":" in family and USER_FAMILY in (info.families or ())
            if info.families is not None and family not in info.families and not user_ok:
                raise ValueError(
                    f"strategy {term.name!r} only applies to model families {', '.join(info.families)} (not {family!r})"
                )
            if device != "auto" and device.split(":")[0] not in info.devices:
                raise ValueError(
                    f"strategy {term.name!r} needs device {' or '.join(info.devices)}; this trial would run on {device!r}"
                )

    def card_refusal(self, card: str, capability: tuple[int, int] | list[int]) -> str | None:
        """Why this combination cannot run on a card of ``capability`` (one line), else None."""
        refusals = (capability_refusal(info, card, capability) for info in self.infos)
        return next((refusal for refusal in refusals if refusal), None)

    def build(self) -> tuple[Strategy, ...]:
        """The trial's strategy objects, in order (imports their modules, hence torch)."""
        return tuple(term.build() for term in self.terms)


def capability_refusal(
    info: StrategyInfo, card: str, capability: tuple[int, int] | list[int]
) -> str | None:
    """The one-line refusal of ``info``'s strategy on a card older than it needs, else None."""
    if info.min_capability is None or tuple(capability) >= info.min_capability:
        return None
    need = ".".join(map(str, info.min_capability))
    have = ".".join(map(str, capability))
    return f"{info.name} needs compute capability {need}+ ({info.capability_why}); {card} is {have}"
