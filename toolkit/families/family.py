"""A model family as data (how its HF config dict reads into ModelSpec fields, and its Megatron-Core mapping where it
has one) and the typed config view its reader reads through, without transformers unless a default is missing."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from toolkit.errors import UserInputError
from toolkit.families.mapping import MegatronMapping


class _Absent(Exception):
    """A key the reader needs is not in the config: transformers' default decides it, so the library's filled-in
    config is read instead."""


class HFConfig:
    """Typed read access to an HF config dict, typed as the family's transformers config class types the keys.

    A key the reader needs but the dict lacks raises `_Absent`, so that `Family.spec_fields` reads the config the
    library filled in; in a config filled in already, it is a UserInputError naming the key. The family's `derived`
    keys read as None when absent or null, its `nullable` keys when null."""

    def __init__(self, data: dict, source: str, family: Family, filled: bool):
        self.data, self.source, self.family, self.filled = data, source, family, filled

    def __contains__(self, key: str) -> bool:
        return key in self.data

    def _typed(self, key: str, types: tuple[type, ...], what: str) -> Any:
        if key not in self.data:
            if key in self.family.derived:
                return None
            if self.filled:
                raise UserInputError(f"{self.source}: {key}", f"config of family '{self.family.model_type}' lacks "
                                                              f"this field")
            raise _Absent(key)
        value = self.data[key]
        if value is None and key in self.family.derived | self.family.nullable:
            return None
        if not isinstance(value, types) or (bool not in types and isinstance(value, bool)):
            raise UserInputError(f"{self.source}: {key}", f"must be {what}, got {value!r}")
        return value

    def integer(self, key: str) -> int | None:
        return self._typed(key, (int,), "an integer")

    def integers(self, key: str) -> list[int]:
        values = self._typed(key, (list,), "a list of integers") or []
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            raise UserInputError(f"{self.source}: {key}", f"must be a list of integers, got {values!r}")
        return values

    def number(self, key: str) -> float | None:
        value = self._typed(key, (int, float), "a number")
        return None if value is None else float(value)

    def flag(self, key: str) -> bool:
        return self._typed(key, (bool,), "true or false")

    def text(self, key: str) -> str:
        return self._typed(key, (str,), "a string")

    def heads_divide_hidden(self, hidden: int, heads: int) -> None:
        """The check transformers' config makes for families whose attention splits hidden_size into heads."""
        if hidden % heads:
            raise UserInputError(f"{self.source}: num_attention_heads",
                                 f"the hidden size ({hidden}) is not a multiple of the {heads} attention heads")


@dataclass(frozen=True)
class Family:
    """One HF model family: `read` turns its config into ModelSpec fields (parameter counting); `megatron` maps it
    to Megatron-Core's GPTModel, where the family has a mapping. `derived` and `nullable` mirror the types of
    transformers' config class: keys whose default is None (or that it has no field for; the value is derived from
    others) and keys that may be null."""

    model_type: str
    read: Callable[[HFConfig], dict]
    megatron: MegatronMapping | None = None
    derived: frozenset[str] = frozenset()
    nullable: frozenset[str] = frozenset()

    def spec_fields(self, data: dict, source: str, library_config: Callable[[], dict] | None = None) -> dict:
        """ModelSpec fields of an HF config dict. A key the reader needs but `data` lacks is left to the library:
        `library_config()` gives the config with transformers' defaults filled in, read the same way. Without it,
        `data` is taken as filled in already (a transformers config's `to_dict()`)."""
        try:
            return self.read(HFConfig(data, source, self, filled=library_config is None))
        except _Absent:
            return self.read(HFConfig(library_config(), source, self, filled=True))
