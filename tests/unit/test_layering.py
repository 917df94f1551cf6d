"""Imports flow one way: spec -> estimate -> planner -> generate/validate -> runtime -> checkpoint -> backends -> cli.

Every `import toolkit.X` / `from toolkit.X import ...` in the package, at module level or inside a function, is read
from the source; a module may import its own package and the layers below it, never one above (nor a sibling of its
own layer). What several layers need lives in the lowest of them.
"""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import ROOT

PACKAGE = ROOT / "toolkit"
# lowest first; a package imports only from its own package and the layers before it (the entry points of the last
# layer also from each other)
LAYERS = (
    ("toolkit", "errors", "presets", "numeric"),  # numeric: not `numbers`, which train.py run as a script would shadow
    ("compat",),  # every private-API seam of a library, used from any layer above
    ("readers",),
    ("outputs",),  # reads the record of `dmt generate` through the one reading path
    ("data",),  # prepared token datasets: read by training (backends) and the CLI, below the spec that names them
    ("families",),
    ("spec",),
    ("estimate",),
    ("planner",),
    ("generate",),
    ("validate",),
    ("runtime",),  # the libraries' objects at run time (Megatron-Core builder, CPU compatibility, metrics.jsonl)
    ("checkpoint",),
    ("backends", "health", "report"),  # report: run directories read back against their predictions
    ("cli", "train", "__main__", "explore"),
)
RANK = {name: rank for rank, names in enumerate(LAYERS) for name in names}


# The Kubernetes package (toolkit/k8s/) is the same kind of slice: what renders manifests beside the generators (dmt
# generate writes one), what checks them against the CRDs beside the validators.
K8S_PARTS = {"__init__": "generate", "names": "generate", "shm": "generate", "vendored": "generate",
             "render": "generate", "schemas": "validate", "versions": "validate", "validate": "validate"}


def _package(module: str) -> str:
    """The layer name of a dotted module of toolkit: its top-level package (or module; toolkit/__init__.py is
    `toolkit`), or for a module of toolkit/k8s/ the layer of its part (K8S_PARTS). A backend's modules all sit in
    `backends`: the layers below reach them only through the registry's typed attributes (toolkit/spec/backend.py)."""
    parts = module.split(".")
    if parts[:2] == ["toolkit", "k8s"]:
        return K8S_PARTS.get(parts[2] if len(parts) > 2 else "__init__", "k8s")
    return parts[1] if len(parts) > 1 and parts[1] != "__init__" else parts[0]


def _imports(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "toolkit":
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names if alias.name.split(".")[0] == "toolkit"]
    return found


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_every_package_has_a_layer():
    packages = {_package(".".join(p.relative_to(ROOT).with_suffix("").parts)) for p in _modules()}
    assert packages <= set(RANK), sorted(packages - set(RANK))


def test_imports_flow_one_way():
    upward = []
    for path in _modules():
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        own = _package(module)
        for line, target in _imports(path):
            other = _package(target)
            entry_points = RANK[own] == len(LAYERS) - 1 == RANK[other]
            if other != own and RANK[other] >= RANK[own] and not entry_points:
                upward.append(f"{path.relative_to(ROOT)}:{line} imports {target} ({own} may not import {other})")
    assert not upward, "\n".join(upward)


def test_the_checker_sees_an_upward_import(tmp_path):
    """The walk above reads imports inside functions too: a planted upward import is found."""
    planted = tmp_path / "planted.py"
    planted.write_text("def f():\n    from toolkit.backends.hf_trainer import train\n")
    assert [target for _, target in _imports(planted)] == ["toolkit.backends.hf_trainer"]
    assert RANK[_package("toolkit.backends.hf_trainer")] > RANK["spec"]


@pytest.mark.parametrize("module", ["toolkit.spec.plan", "toolkit.spec.recipe", "toolkit.spec.model",
                                    "toolkit.spec.cluster"])
def test_importing_the_spec_loads_no_higher_layer(module):
    script = ("import sys, importlib; importlib.import_module(sys.argv[1]); "
              "print(' '.join(m for m in sys.modules if m.startswith('toolkit.')))")
    loaded = subprocess.run([sys.executable, "-c", script, module], capture_output=True, text=True, check=True,
                            cwd=ROOT).stdout.split()
    higher = [m for m in loaded if RANK[_package(m)] > RANK["spec"]]
    assert module in loaded and not higher, higher


def _imported_roots(path: Path) -> set[str]:
    """The top-level names of everything a module imports, at module level or inside a function."""
    roots = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            roots.add(node.module.split(".")[0])
        elif isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
    return roots


def test_the_spec_declares_and_measures_nothing():
    """spec/ holds data and its rules: a measurement (the host's matmul peak) runs in toolkit/estimate/device_peak.py,
    so no spec module imports torch, even inside a function."""
    measuring = [str(p.relative_to(ROOT)) for p in sorted((PACKAGE / "spec").rglob("*.py"))
                 if "torch" in _imported_roots(p)]
    assert not measuring, measuring
    assert "torch" in _imported_roots(PACKAGE / "estimate" / "device_peak.py")  # the checker sees a lazy import


def test_no_package_module_is_named_like_a_test():
    """pytest's default patterns (test_*.py, *_test.py) are for tests; a package module named so reads as one."""
    named = [str(p.relative_to(ROOT)) for p in _modules() if p.name.startswith("test_") or p.stem.endswith("_test")]
    assert not named, named
