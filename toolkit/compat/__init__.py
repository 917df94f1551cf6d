"""Every place the toolkit reaches into a library's private API or patches a library, one module per library, and
the registry of those seams that tests/unit/test_compat.py checks against the installed versions.

Code outside this package calls the functions here; it never reads a library's `_private` name, imports a private
module, or assigns to a library's module or class. Each module declares its seams in `SEAMS`, next to the code that
uses them. Importing this package imports no library; `all_seams()` imports the seam modules (not the libraries).

A seam is checked against the installed library (tests/unit/test_compat.py): it exists; where the toolkit calls or
overrides it positionally, its parameters are the ones the toolkit is written for (`parameters`); where the toolkit
copies its code (a replica of a library function with a hook added), that code is unchanged (`source_sha256`, the
digest of `source_digest`).
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import inspect
import textwrap
from dataclasses import dataclass
from typing import Literal

# the seam modules, by library (named so that none shadows the library it wraps)
MODULES = ("torch_seams", "transformers_seams", "accelerate_seams", "megatron_seams", "megatron_cpu", "megatron_async",
           "megatron_datasets_seams", "stdlib_seams", "dcp_async", "megatron_schedule_trace", "deepspeed_seams")


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
    # the names of its parameters, in order, in the version the toolkit's call or override is written for
    parameters: tuple[str, ...] | None = None
    # source_digest() of the library code the toolkit copies (with the version it was taken from, in `why`)
    source_sha256: str | None = None


def all_seams() -> list[Seam]:
    return [seam for module in MODULES for seam in importlib.import_module(f"{__name__}.{module}").SEAMS]


def source_digest(function) -> str:
    """sha256 of a function's code as Python reads it: its syntax tree without docstrings, comments, line numbers or
    layout, so that a reformatting of the library leaves it unchanged and any change of what the code does does not."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.body \
                and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant) \
                and isinstance(node.body[0].value.value, str):
            node.body = node.body[1:] or [ast.Pass()]
    return hashlib.sha256(ast.dump(tree, annotate_fields=False, include_attributes=False).encode()).hexdigest()
