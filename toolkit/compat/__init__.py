"""Every place the toolkit reaches into a library's private API or patches a library, one module per library, and
the registry of those seams that tests/unit/test_compat.py checks against the installed versions.

Code outside this package calls the functions here; it never reads a library's `_private` name, imports a private
module, or assigns to a library's module or class. Each module declares its seams in `SEAMS`, next to the code that
uses them. Importing this package imports no library; `all_seams()` imports the seam modules (not the libraries).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Literal

# the seam modules, by library (named so that none shadows the library it wraps)
MODULES = ("torch_seams", "transformers_seams", "accelerate_seams", "megatron_seams", "megatron_cpu", "megatron_async",
           "megatron_datasets_seams", "stdlib_seams", "dcp_async", "megatron_schedule_trace")


@dataclass(frozen=True)
class Seam:
    """One private name (or patched public one) the toolkit depends on."""

    library: str  # the distribution whose version decides whether it exists ("python" for the standard library)
    name: str  # dotted: package.module.attribute or package.module.Class.attribute
    why: str  # what the toolkit needs it for, and why no public API serves
    # attribute: importable by its dotted name; in_source: a name the owner's source assigns or reads (an instance
    # attribute such as self._x, or a global a module only defines under a condition)
    kind: Literal["attribute", "in_source"] = "attribute"
    only_with: str | None = None  # a build feature it exists only with ("nccl"): not checked where that is missing
    used_in: str | None = None  # a module outside toolkit/compat that still reaches it in place (and why)


def all_seams() -> list[Seam]:
    return [seam for module in MODULES for seam in importlib.import_module(f"{__name__}.{module}").SEAMS]
