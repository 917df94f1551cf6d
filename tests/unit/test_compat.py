"""Every private-API seam and patch of a library lives in toolkit/compat, is listed there, exists in the installed
version of its library, and that library has an upper bound in pyproject.toml.

The registry check imports each seam by its dotted name (or, for an instance attribute or a conditionally defined
global, finds it in its owner's source), so a library upgrade that renames one fails here, naming the seam and the
installed version, not in the middle of a launch. The completeness check reads toolkit/ outside toolkit/compat with
`ast` and flags: private names reached through an imported foreign module or class; private modules or names
imported from a foreign package; an `._name` attribute (or getattr/hasattr/setattr with a "_name" string) that the
toolkit itself never defines; assignments to attributes of imported foreign modules or classes; `unittest.mock`; a
private method (one underscore) defined by a class whose base is a library's, and `super()._name` in it; any
assignment to a `forward`. Inside toolkit/compat the last two must be named by the module's own SEAMS.

Where the toolkit calls or overrides a seam positionally, its parameters are checked against the installed signature;
where it copies a library's code, the digest of that code (toolkit.compat.source_digest) against the one recorded.
"""

import ast
import importlib
import importlib.metadata
import importlib.util
import inspect
import re
import sys
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement

from helpers import ROOT
from toolkit.compat import Seam, all_seams, source_digest

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


@pytest.mark.parametrize("seam", [s for s in SEAMS if s.parameters], ids=lambda seam: seam.name)
def test_a_seam_called_positionally_has_the_parameters_the_toolkit_is_written_for(seam: Seam):
    installed = tuple(inspect.signature(_resolve(seam.name)).parameters)
    assert installed == seam.parameters, (
        f"{seam.name} takes {installed} in the installed {seam.library} {_version(seam.library)}; the toolkit is "
        f"written for {seam.parameters} ({seam.why}). Adapt its use in toolkit/compat, then the seam's parameters")


@pytest.mark.parametrize("seam", [s for s in SEAMS if s.source_sha256], ids=lambda seam: seam.name)
def test_library_code_the_toolkit_replicates_is_unchanged(seam: Seam):
    digest = source_digest(_resolve(seam.name))
    assert digest == seam.source_sha256, (
        f"the code of {seam.name} changed in the installed {seam.library} {_version(seam.library)} (digest "
        f"{digest}); the toolkit replicates it: {seam.why}. Compare the replica with it, then record the new digest")


def _function_from(path: Path, source: str):
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.step


def test_the_digest_sees_code_not_layout(tmp_path):
    step = _function_from(tmp_path / "a.py", 'def step(self):\n    """One doc."""\n    found = self.prepare()  # why\n'
                                              '    return found\n')
    reformatted = _function_from(tmp_path / "b.py", "def step(self):\n    found = self.prepare(\n    )\n\n"
                                                    "    return (found)\n")
    changed = _function_from(tmp_path / "c.py", "def step(self):\n    found = self.prepare()\n    return not found\n")
    assert source_digest(step) == source_digest(reformatted)
    assert source_digest(step) != source_digest(changed)


def test_every_private_torch_name_the_pickle_allow_lists_let_through_is_a_seam():
    from toolkit.checkpoint.allow_lists import FORMATS

    names = {seam.name for seam in SEAMS}
    allowed = {name for allow_list in FORMATS for name in allow_list
               if name.split(".")[0] == "torch" and any(_private(part) for part in name.split("."))}
    assert allowed and allowed <= names, sorted(allowed - names)


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


def _foreign_bindings(tree: ast.AST) -> dict[str, str]:
    """Each name bound to an imported module or object of another package than toolkit, and what it is (dotted)."""
    bound = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            bound |= {a.asname or a.name.split(".")[0]: a.name if a.asname else a.name.split(".")[0]
                      for a in node.names if a.name.split(".")[0] != "toolkit"}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                and node.module.split(".")[0] not in ("toolkit", "__future__"):
            bound |= {a.asname or a.name: f"{node.module}.{a.name}" for a in node.names}
    return bound


def _library_has(dotted: str, name: str) -> bool:
    """Whether the library object `dotted` (a base class) has `name`; True where it cannot be imported here (the
    finding then stands, for a person to judge)."""
    try:
        return hasattr(_resolve(dotted), name)
    except (ImportError, AttributeError):
        return True


def overrides_and_forwards(tree: ast.AST) -> list[tuple[int, str, str, str | None]]:
    """(line, name, what, the library base class's name or None) of each private method of a library base class that
    a class overrides, each `super()._name` it calls, and each assignment to a `forward` (or setattr of one). A private
    method the base does not have is the toolkit's own (a pydantic validator), not an override."""
    bound, found = _foreign_bindings(tree), []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for base in (b for b in node.bases if _root(b) in bound):
                dotted = ".".join([bound[_root(base)], *_chain(base)])
                name = dotted.rsplit(".", 1)[-1]
                found += [(item.lineno, item.name, f"{node.name} overrides the private {dotted}.{item.name}", name)
                          for item in node.body if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))
                          and _private(item.name) and _library_has(dotted, item.name)]
                found += [(inner.lineno, inner.attr, f"{node.name} calls the private super().{inner.attr} of {dotted}",
                           name) for inner in ast.walk(node)
                          if isinstance(inner, ast.Attribute) and _private(inner.attr)
                          and isinstance(inner.value, ast.Call) and isinstance(inner.value.func, ast.Name)
                          and inner.value.func.id == "super"]
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            found += [(node.lineno, "forward", f"assigns {'.'.join([_root(t) or '?', *_chain(t)])}", None)
                      for t in targets if isinstance(t, ast.Attribute) and t.attr == "forward"]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr" \
                and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and node.args[1].value == "forward":
            found.append((node.lineno, "forward", "setattr of a forward", None))
    return found


def seams_outside_compat(path: Path, own: set[str]) -> list[tuple[int, str, str]]:
    """(line, private name or patched attribute, what was found) of every seam in one file."""
    tree = ast.parse(path.read_text())
    foreign = set(_foreign_bindings(tree))
    found = [(line, name, what) for line, name, what, _ in overrides_and_forwards(tree)]
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


def test_compat_names_its_own_overrides_and_forward_patches():
    """Inside toolkit/compat reaching in is the point, but each private override and forward patch is one of the
    module's SEAMS: `Base._method` for an override, a seam ending in `forward` for a forward assigned."""
    missing = []
    for path in sorted(COMPAT.glob("*.py")):
        tree = ast.parse(path.read_text())
        found = overrides_and_forwards(tree)
        if not found:
            continue
        names = [seam.name for seam in getattr(importlib.import_module(f"toolkit.compat.{path.stem}"), "SEAMS", [])]
        missing += [f"{path.relative_to(ROOT)}:{line}: {what}" for line, name, what, base in found
                    if not any(n.endswith(f"{base}.{name}" if base else f".{name}") for n in names)]
    assert not missing, "list these in the module's SEAMS:\n" + "\n".join(missing)


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
        "def g(model, mlp):\n"
        "    from transformers import Trainer\n"
        "    class Mine2(Trainer):\n"
        "        def _get_train_sampler(self, *args):\n"
        "            return super()._get_eval_sampler(*args)\n"
        "        def _own_helper(self):  # Trainer has none: the toolkit's own, not an override\n"
        "            return 0\n"
        "    class Ours(Mine):\n"
        "        def _not_a_library_method(self):\n"
        "            return 0\n"
        "    model.forward = lambda x: x\n"
        "    setattr(mlp, 'forward', None)\n"
    )
    found = seams_outside_compat(planted, {"_mine", "_get_train_sampler", "_get_eval_sampler", "_own_helper"})
    names = {name for _, name, _ in found}
    assert names == {"unittest.mock", "_y", "_c", "_run_exitfuncs", "current_device", "synchronize",
                     "_load_from_checkpoint", "_is_overflow", "_get_train_sampler", "_get_eval_sampler", "forward"}
    lines = {(line, name) for line, name, _ in found}
    assert {(21, "_get_train_sampler"), (22, "_get_eval_sampler"), (28, "forward"), (29, "forward")} <= lines


def test_te_version_assumed_answers_megatrons_te_checks_without_te():
    """Without Transformer Engine, TransformerConfig's MoE fp8 check compares None with a Version (TypeError, not a
    verdict); under te_version_assumed it answers for the stated version, refusing one older than Megatron-Core asks
    for, and restores the library's function afterwards."""
    from megatron.core import utils
    from megatron.core.transformer import transformer_config
    from megatron.core.transformer.transformer_config import TransformerConfig

    from toolkit.compat.megatron_seams import te_version_assumed

    if utils.get_te_version() is not None:
        pytest.skip("Transformer Engine is installed: its own version answers")
    moe_fp8 = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_moe_experts=4, fp8="hybrid")
    with pytest.raises(TypeError):
        TransformerConfig(**moe_fp8)
    original = transformer_config.is_te_min_version
    with te_version_assumed("2.1.0"):
        assert TransformerConfig(**moe_fp8).fp8 == "hybrid"
    with te_version_assumed("1.6.0"), pytest.raises(ValueError, match="transformer-engine>=1.7.0 supports MoE FP8"):
        TransformerConfig(**moe_fp8)
    assert transformer_config.is_te_min_version is original


def test_the_local_spec_gets_torch_norms_that_sum_their_gradients_over_tp_under_sequence_parallelism():
    """Without Transformer Engine and Apex the local spec's norm is WrappedTorchNorm, which asserts
    `not sequence_parallel`; sequence_parallel_spec puts in its place torch's same norm with its weights marked
    `sequence_parallel` (what finalize_model_grads sums over TP), in every layer's norms, the q/k norms and the
    block's final norm, and leaves every other module of the spec as it was."""
    import torch
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_config import TransformerConfig

    from toolkit.compat.megatron_seams import SequenceParallelTorchNorm, sequence_parallel_spec

    config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, tensor_model_parallel_size=2,
                               sequence_parallel=True, normalization="RMSNorm")
    with pytest.raises(AssertionError, match="sequence parallel"):
        WrappedTorchNorm(config, 64)
    norm = SequenceParallelTorchNorm(config, 64, eps=1e-6)
    assert isinstance(norm, torch.nn.RMSNorm) and norm.eps == 1e-6
    assert [param.sequence_parallel for param in norm.parameters()] == [True]
    spec = get_gpt_layer_local_spec(num_experts=4, qk_layernorm=True, normalization="RMSNorm")
    if spec.submodules.input_layernorm is not WrappedTorchNorm:
        pytest.skip("Apex is installed: its FusedLayerNorm handles sequence parallelism")
    block = sequence_parallel_spec(spec, 2)
    layer = block.layer_specs[0].submodules
    attention = layer.self_attention.submodules
    assert len(block.layer_specs) == 2 and block.layer_norm is SequenceParallelTorchNorm
    assert {layer.input_layernorm, layer.pre_mlp_layernorm, attention.q_layernorm, attention.k_layernorm} == \
           {SequenceParallelTorchNorm}
    assert (attention.linear_qkv, layer.mlp.submodules.experts) == \
           (spec.submodules.self_attention.submodules.linear_qkv, spec.submodules.mlp.submodules.experts)
