"""A backend is one package (toolkit/backends/<name>/) and one registry line: the rest of the toolkit walks the
registry and never compares a backend's name."""

import re

import pytest

from helpers import ROOT
from toolkit.backends import BACKENDS, NAMES
from toolkit.spec.options import option_backends

PACKAGE = ROOT / "toolkit"
# the modules every backend package has, under the same names (toolkit/backends/backend.py)
PARTS = ("rules", "search", "generate", "validate", "train")
# a comparison of a backend's name: `== "fsdp"`, `!= 'megatron'`, `in ("deepspeed", ...)`, `backend == NAME`
_NAMES = "|".join(NAMES)
COMPARISON = re.compile(rf"""(==|!=)\s*["']({_NAMES})["']|["']({_NAMES})["']\s*(==|!=)|\bin\s*[(\[{{]\s*["']({_NAMES})["']""")


def _backend_packages() -> set:
    return {PACKAGE / "backends" / name for name in NAMES}


def comparisons(root=PACKAGE) -> list[str]:
    """Every line outside the backends' own packages that compares a backend's name."""
    found = []
    for path in sorted(root.rglob("*.py")):
        if any(package in path.parents for package in _backend_packages()):
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if COMPARISON.search(code) and "backend" in code:
                found.append(f"{path.relative_to(root.parent)}:{number}: {line.strip()}")
    return found


def test_every_backend_has_every_part():
    for name, backend in BACKENDS.items():
        assert backend.name == name
        for part in PARTS:
            assert (PACKAGE / "backends" / name / f"{part}.py").is_file(), f"{name} has no {part}.py"
            backend.part(part)  # imports


def test_the_rule_finds_a_planted_comparison(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text('if plan.backend == "fsdp":\n    pass\nok = backend in ("megatron", "x")\n')
    assert len(comparisons(tmp_path)) == 2


PACKAGES_CLEARED = ("spec", "planner", "generate", "validate", "cli", "train.py", "checkpoint", "runtime", "report",
                    "health", "explore")


@pytest.mark.parametrize("package", PACKAGES_CLEARED)
def test_no_backend_name_is_compared_outside_the_backend_packages(package):
    found = [line for line in comparisons() if line.startswith(f"toolkit/{package}")]
    assert not found, "\n".join(found)


def test_each_backends_options_name_registered_backends():
    from toolkit.spec.options import OPTION_NAMES

    assert {b for name in OPTION_NAMES for b in option_backends(name)} <= set(NAMES)
