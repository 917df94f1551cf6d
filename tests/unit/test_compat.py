"""Every private-API seam and patch of a library lives in toolkit/compat, is listed there, exists in the installed
version of its library, and that library has an upper bound in pyproject.toml.

The registry check imports each seam by its dotted name (or, for an instance attribute or a conditionally defined
global, finds it in its owner's source), so a library upgrade that renames one fails here, naming the seam and the
installed version, not in the middle of a launch. The completeness check reads toolkit/ outside toolkit/compat with
`ast` and flags: private names reached through an imported foreign module or class; private modules or names
imported from a foreign package; an `._name` attribute (or getattr/hasattr/setattr with a "_name" string) that the
toolkit itself never defines; assignments to attributes of imported foreign modules or classes; `unittest.mock`.
"""

import ast
import importlib
import importlib.metadata
import inspect
import re
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from helpers import ROOT
from toolkit.compat import Seam, all_seams

PACKAGE = ROOT / "toolkit"
COMPAT = PACKAGE / "compat"
# underscore names the libraries document as public API
PUBLIC_UNDERSCORE = {("os", "_exit")}
SEAMS = all_seams()


def _version(library: str) -> str:
    return sys.version.split()[0] if library == "python" else importlib.metadata.version(library)


def _resolve(dotted: str):
    """The object a dotted name names: the longest importable module prefix, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            found = getattr(found, attr)
        return found
    raise ImportError(dotted)


def _in_source(dotted: str) -> bool:
    """The last name appears in the source of its owner (a module, or a class and its bases)."""
    owner_name, attr = dotted.rsplit(".", 1)
    owner = _resolve(owner_name)
    owners = [c for c in owner.__mro__ if c is not object] if inspect.isclass(owner) else [owner]
    return any(re.search(rf"\b{re.escape(attr)}\b", inspect.getsource(o)) for o in owners)


def _applies(seam: Seam) -> bool:
    if seam.only_with == "nccl":
        import torch.distributed as dist

        return dist.is_available() and dist.is_nccl_available()
    return seam.only_with is None


@pytest.mark.parametrize("seam", SEAMS, ids=[seam.name for seam in SEAMS])
def test_seam_exists_in_the_installed_version(seam: Seam):
    if not _applies(seam):
        pytest.skip(f"{seam.name} exists only with {seam.only_with}, which this build of {seam.library} lacks")
    version = _version(seam.library)
    try:
        present = _in_source(seam.name) if seam.kind == "in_source" else (_resolve(seam.name), True)[1]
    except (ImportError, AttributeError, OSError, TypeError) as exc:
        present, detail = False, f" ({type(exc).__name__}: {exc})"
    else:
        detail = ""
    assert present, (f"seam {seam.name} is missing from the installed {seam.library} {version}{detail}; the toolkit "
                     f"needs it for: {seam.why}. Adapt toolkit/compat to this version or bound {seam.library} below "
                     f"it in pyproject.toml")


def test_every_seam_library_is_bounded_and_installed_within_the_bounds():
    dependencies = {Requirement(text).name: Requirement(text)
                    for text in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]}
    for library in sorted({seam.library for seam in SEAMS} - {"python"}):
        requirement = dependencies.get(library)
        assert requirement is not None, f"{library} has seams in toolkit/compat but is not a dependency"
        assert any(spec.operator in ("<", "<=", "==", "~=") for spec in requirement.specifier), \
            f"{library} has seams in toolkit/compat but no upper bound in pyproject.toml ({requirement})"
        version = _version(library)
        assert requirement.specifier.contains(version, prereleases=True), \
            f"installed {library} {version} is outside pyproject.toml's {requirement}"


def test_every_seam_is_listed_once_with_a_reason():
    names = [seam.name for seam in SEAMS]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    assert all(seam.why.strip() for seam in SEAMS)


# ---- completeness: nothing outside toolkit/compat reaches into a library --------------------------------------


def _foreign_names(tree: ast.AST) -> set[str]:
    """Names bound to an imported module or object of another package than toolkit."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names if a.name.split(".")[0] != "toolkit"}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                and node.module.split(".")[0] not in ("toolkit", "__future__"):
            names |= {a.asname or a.name for a in node.names}
    return names


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _own_private_names(paths: list[Path]) -> set[str]:
    """Every underscore name the toolkit defines: functions, classes, module and class attributes, fields,
    parameters, and attributes it sets on self/cls."""
    own = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(node.name)
            elif isinstance(node, ast.arg):
                own.add(node.arg)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                own.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) \
                    and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                own.add(node.attr)
    return {name for name in own if _private(name)}


def _root(node: ast.AST) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Call, ast.Subscript)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def _chain(node: ast.Attribute) -> list[str]:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return parts[::-1]


def seams_outside_compat(path: Path, own: set[str]) -> list[tuple[int, str, str]]:
    """(line, private name or patched attribute, what was found) of every seam in one file."""
    tree = ast.parse(path.read_text())
    foreign = _foreign_names(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                and node.module.split(".")[0] not in ("toolkit", "__future__"):
            if node.module in ("unittest.mock", "mock") or (node.module == "unittest"
                                                            and any(a.name == "mock" for a in node.names)):
                found.append((node.lineno, "unittest.mock", "imports mock"))
            found += [(node.lineno, part, f"imports from the private module {node.module}")
                      for part in node.module.split(".") if _private(part)]
            found += [(node.lineno, a.name, f"imports the private {node.module}.{a.name}")
                      for a in node.names if _private(a.name)]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] != "toolkit":
                    found += [(node.lineno, part, f"imports the private module {alias.name}")
                              for part in alias.name.split(".") if _private(part)]
                    if alias.name in ("unittest.mock", "mock"):
                        found.append((node.lineno, "unittest.mock", "imports mock"))
        elif isinstance(node, ast.Attribute) and _private(node.attr) \
                and (_root(node), node.attr) not in PUBLIC_UNDERSCORE:
            root = _root(node)
            if root in foreign:
                found.append((node.lineno, node.attr, f"reaches into {root}.{'.'.join(_chain(node)[:1])}..."))
            elif node.attr not in own and root not in ("self", "cls"):
                found.append((node.lineno, node.attr, "reads a private attribute the toolkit never defines"))
            elif node.attr not in own:
                found.append((node.lineno, node.attr, "reads a private attribute of a library base class"))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id in ("getattr", "hasattr", "setattr", "delattr") and len(node.args) >= 2:
            name = node.args[1]
            if isinstance(name, ast.Constant) and isinstance(name.value, str) and _private(name.value) \
                    and name.value not in own:
                found.append((node.lineno, name.value, f"{node.func.id} of a private library attribute"))
            if node.func.id in ("setattr", "delattr") and _root(node.args[0]) in foreign:
                found.append((node.lineno, str(getattr(name, "value", "?")), f"patches {_root(node.args[0])}"))
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
            for target in targets:
                if isinstance(target, ast.Attribute) and _root(target) in foreign:
                    found.append((node.lineno, target.attr, f"patches {'.'.join([_root(target), *_chain(target)])}"))
    return found


def _toolkit_files() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _allowed_in_place(path: Path, name: str) -> bool:
    """A seam the registry says is still used in place (and by whom)."""
    relative = str(path.relative_to(ROOT))
    return any(seam.used_in and seam.used_in.split(":")[0] == relative and seam.name.rsplit(".", 1)[1] == name
               for seam in SEAMS)


def test_no_seam_outside_toolkit_compat():
    files = _toolkit_files()
    own = _own_private_names([p for p in files if COMPAT not in p.parents])
    found = [f"{path.relative_to(ROOT)}:{line}: {name}: {what}"
             for path in files if COMPAT not in path.parents
             for line, name, what in seams_outside_compat(path, own) if not _allowed_in_place(path, name)]
    assert not found, "move these into toolkit/compat (and list them in its SEAMS):\n" + "\n".join(found)


def test_every_in_place_seam_is_still_there():
    """A seam listed as used outside toolkit/compat is really there (else the entry is stale)."""
    files = _toolkit_files()
    own = _own_private_names([p for p in files if COMPAT not in p.parents])
    for seam in (s for s in SEAMS if s.used_in):
        path = ROOT / seam.used_in.split(":")[0]
        names = {name for _, name, _ in seams_outside_compat(path, own)}
        assert seam.name.rsplit(".", 1)[1] in names, f"{seam.name} is no longer used in {path}: drop used_in"


def test_the_checker_finds_planted_seams(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text(
        "import atexit\nimport torch\nfrom unittest import mock\nfrom torch.x._y import z\nfrom a.b import _c\n"
        "import os\n"
        "class Mine:\n    def __init__(self):\n        self._mine = 1\n"
        "def f(engine, trainer):\n"
        "    atexit._run_exitfuncs()\n"
        "    torch.cuda.current_device = lambda: 0\n"
        "    setattr(torch.cuda, 'synchronize', None)\n"
        "    trainer._load_from_checkpoint('x')\n"
        "    getattr(engine, '_is_overflow', None)\n"
        "    Mine()._mine\n"
        "    os._exit(0)\n"
    )
    names = {name for _, name, _ in seams_outside_compat(planted, {"_mine"})}
    assert names == {"unittest.mock", "_y", "_c", "_run_exitfuncs", "current_device", "synchronize",
                     "_load_from_checkpoint", "_is_overflow"}
