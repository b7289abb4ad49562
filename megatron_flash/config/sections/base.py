"""What every config section shares: ``_Section``, whose checks raise ValueError naming the full dotted
key and the offending value (``parallel.tensor_model_parallel_size must be >= 1, got 0``)."""

from __future__ import annotations

from typing import ClassVar, Sequence


class _Section:
    """Checks shared by the section dataclasses; ``_section`` is the section's key in RunConfig."""

    _section: ClassVar[str] = ""

    def _key(self, name: str) -> str:
        return f"{self._section}.{name}"

    def _require(self, ok: bool, name: str, requirement: str) -> None:
        if not ok:
            raise ValueError(f"{self._key(name)} {requirement}, got {getattr(self, name)!r}")

    def _at_least(self, name: str, minimum: float) -> None:
        self._require(getattr(self, name) >= minimum, name, f"must be >= {minimum}")

    def _positive(self, name: str) -> None:
        self._require(getattr(self, name) > 0, name, "must be > 0")

    def _one_of(self, name: str, choices: Sequence[str]) -> None:
        self._require(getattr(self, name) in choices, name, f"must be one of {'|'.join(choices)}")

    def validate(self) -> None:
        raise NotImplementedError
