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
    ("outputs",),  # reads the record of `dmt generate` through the one reader of its format
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


def _package(module: str) -> str:
    """The layer name of a dotted module of toolkit: its top-level package (or module; toolkit/__init__.py is
    `toolkit`). A backend's modules all sit in `backends`: the layers below reach them only through the registry's
    typed attributes (toolkit/spec/backend.py)."""
    parts = module.split(".")
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


# Libraries whose import costs a command's start (`dmt --help`, the planner) or needs a machine's extras: a module of
# the toolkit that loads one of them when imported may be imported lazily, inside the function that needs it.
HEAVY = frozenset({"torch", "transformers", "deepspeed", "megatron", "accelerate", "datasets", "peft", "trl",
                   "bitsandbytes", "matplotlib", "wandb", "starlette", "uvicorn", "selenium", "pyarrow", "numpy",
                   "safetensors", "tokenizers", "huggingface_hub", "jsonschema", "celpy", "gigatoken",
                   "nvidia_resiliency_ext", "hta"})


def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def _top_level_imports(path: Path) -> set[str]:
    """What importing the module imports: its module-level imports (not under `if TYPE_CHECKING:`), as toolkit module
    names or the roots of other libraries, and the packages above it."""
    names = {_module_name(p) for p in _modules()}
    found = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        for inner in ast.walk(node) if isinstance(node, (ast.If, ast.Try, ast.Import, ast.ImportFrom)) else ():
            targets = [a.name for a in inner.names] if isinstance(inner, ast.Import) else \
                [inner.module, *(f"{inner.module}.{a.name}" for a in inner.names)] \
                if isinstance(inner, ast.ImportFrom) and inner.module and not inner.level else []
            for target in targets:
                while "." in target and target.split(".")[0] == "toolkit" and target not in names:
                    target = target.rpartition(".")[0]
                found.add(target if target.split(".")[0] == "toolkit" else target.split(".")[0])
    module = _module_name(path).split(".")
    found |= {".".join(module[:i]) for i in range(1, len(module))}
    return found - {_module_name(path)}


def _module_graph() -> dict[str, set[str]]:
    return {_module_name(p): _top_level_imports(p) for p in _modules()}


def _reaches(graph: dict[str, set[str]], start: str, goal) -> bool:
    """Whether importing `start` imports something `goal` accepts (a module name, or a test on names)."""
    seen, todo = set(), [start]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        if (goal(name) if callable(goal) else name == goal) and name != start:
            return True
        todo += graph.get(name, ())
    return False


def _function_local_toolkit_imports(path: Path) -> list[tuple[int, str]]:
    lines = path.read_text().splitlines()
    found = []
    for function in ast.walk(ast.parse(path.read_text())):
        if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found += [(node.lineno, node.module) for node in ast.walk(function)
                      if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "toolkit"]
    return sorted({(line, module) for line, module in found if not lines[line - 1].strip().startswith("#")})


def test_the_toolkits_own_modules_are_imported_at_module_level():
    """A toolkit module imports the toolkit's own modules at module level, except a module that loads a heavy library
    when imported (HEAVY: `dmt --help` and the planner must not pay for torch) or one whose import would close a
    circle; such a lazy import says why in a comment on its line or the line above (`# lazy: torch`)."""
    graph = _module_graph()
    wrong = []
    for path in _modules():
        source = path.read_text().splitlines()
        for line, target in _function_local_toolkit_imports(path):
            while target not in graph and "." in target:
                target = target.rpartition(".")[0]
            heavy = _reaches(graph, target, lambda name: name in HEAVY)
            circle = _reaches(graph, target, _module_name(path))
            said = "# lazy" in source[line - 1] or source[line - 2].strip().startswith("# lazy")
            if not (heavy or circle):
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports {target} inside a function: import it at "
                             "module level (it loads no heavy library and closes no circle)")
            elif not said:
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports {target} lazily without saying why "
                             "(`# lazy: <library>` or `# lazy: circle`)")
    assert not wrong, "\n".join(wrong)


def test_the_lazy_import_check_sees_a_light_module_imported_in_a_function(tmp_path):
    """The walk above finds a function-local import of a toolkit module, and knows a heavy one from a light one."""
    planted = tmp_path / "planted.py"
    planted.write_text("def f():\n    from toolkit.numeric import GiB\n    # lazy: torch\n"
                       "    from toolkit.estimate.device_peak import measure\n")
    assert _function_local_toolkit_imports(planted) == [(2, "toolkit.numeric"), (4, "toolkit.estimate.device_peak")]
    graph = _module_graph()
    assert not _reaches(graph, "toolkit.numeric", lambda name: name in HEAVY)
    assert _reaches(graph, "toolkit.compat.megatron_cpu", lambda name: name in HEAVY)
