"""The user's pages: the README's captured blocks print what they show, links resolve, the layout names toolkit/.

A captured block is a `console` fence right after a `<!-- captured -->` line: its first line is `$ dmt ...`, the rest is
that command's standard output. Refresh them after a change of the output with
`python tests/unit/test_readme.py --update` (CONTRIBUTING.md).
"""

import os
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
ARCHITECTURE = DOCS / "architecture.md"

CAPTURED = re.compile(r"^<!-- captured -->\n```console\n\$ (?P<command>[^\n]+)\n(?P<output>.*?)^```$", re.M | re.S)
# The one thing that legitimately varies: where the command ran. Captured commands run in a temporary directory
# (with the checkout's recipes/ linked into it) and print absolute paths under it; the README shows them under this.
CHECKOUT = "/home/you/dm-toolkit"
# Top-level pages a user is sent to from the README: one per area.
AREAS = ("planning", "generating-and-launching", "training", "checkpoints", "faults", "data", "long-context",
         "kubernetes", "benchmarks", "architecture")
LINK = re.compile(r"\]\(([^)\s]+)\)")


def captured_blocks(text: str) -> list[re.Match]:
    return list(CAPTURED.finditer(text))


def run_captured(command: str) -> str:
    """`command` (a `dmt ...` line) run as a user runs it from the checkout, its stdout with the temp dir named
    CHECKOUT; the checkout's own toolkit is imported (not an installed one)."""
    argv = shlex.split(command)
    assert argv[0] == "dmt", f"a captured block runs dmt only: {command}"
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", WANDB_MODE="offline")
    for name in ("FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE", "COLUMNS"):  # rich's terminal overrides
        env.pop(name, None)
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        (workdir / "recipes").symlink_to(ROOT / "recipes")
        result = subprocess.run([sys.executable, "-m", "toolkit", *argv[1:]], cwd=workdir, env=env,
                                capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, (command, result.returncode, result.stderr[-3000:])
        out = result.stdout
        for path in {str(workdir.resolve()), str(workdir)}:
            out = out.replace(path, CHECKOUT)
    return out


BLOCKS = captured_blocks(README.read_text())


def test_the_readme_shows_three_commands_with_their_output_on_its_first_screen():
    # the first screen: the one sentence, the install, then the section holding the three captured commands
    headings = [heading.start() for heading in re.finditer(r"^## ", README.read_text(), re.M)] + [len(README.read_text())]
    assert README.read_text()[headings[0]:].startswith("## Install")
    assert len(BLOCKS) >= 3 and all(headings[1] < block.start() < block.end() < headings[2] for block in BLOCKS[:3])


@pytest.mark.parametrize("block", BLOCKS, ids=[block["command"].split()[1] for block in BLOCKS])
def test_a_captured_command_prints_what_the_readme_shows(block):
    assert run_captured(block["command"]) == block["output"], (
        f"`{block['command']}` prints something else now: python tests/unit/test_readme.py --update")


def test_the_readme_links_one_page_per_area_and_every_page():
    linked = set(LINK.findall(README.read_text()))
    pages = {f"docs/{path.name}" for path in DOCS.glob("*.md")}
    assert {f"docs/{area}.md" for area in AREAS} <= linked
    assert pages <= linked, f"pages the README does not link: {sorted(pages - linked)}"


def anchors(page: Path) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation but `-` and `_` dropped, spaces as `-`."""
    headings = re.findall(r"^#+ (.+)$", page.read_text(), re.M)
    return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in headings}


@pytest.mark.parametrize("page", [README, ROOT / "CONTRIBUTING.md", *sorted(DOCS.glob("*.md"))],
                         ids=lambda path: path.relative_to(ROOT).as_posix())
def test_every_relative_link_of_a_page_resolves(page):
    for target in LINK.findall(page.read_text()):
        if "://" in target:
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path) if path else page
        assert linked.exists(), f"{page.name} links to a missing {target}"
        if anchor:
            assert anchor in anchors(linked), f"{page.name} links to {target}, a heading {linked.name} does not have"


def toolkit_layout() -> str:
    """The toolkit/ entry of docs/architecture.md's Layout block: from its line to the next top-level entry."""
    text = ARCHITECTURE.read_text()
    block = text[text.index("```", text.index("## Layout")) + 3:]
    block = block[:block.index("```")]
    lines = block.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("toolkit/"))
    end = next((i for i in range(start + 1, len(lines)) if lines[i][:1] not in ("", " ")), len(lines))
    return "\n".join(lines[start:end])


def test_the_layout_names_every_top_level_module_and_package_of_toolkit():
    layout = toolkit_layout()
    entries = [f"{path.name}/" if path.is_dir() else path.name for path in (ROOT / "toolkit").iterdir()
               if path.name not in ("__init__.py", "__pycache__") and not path.name.startswith(".")]
    missing = [name for name in entries if not re.search(rf"(?<![\w/.]){re.escape(name)}(?![\w])", layout)]
    assert not missing, f"docs/architecture.md's Layout leaves out toolkit/ entries: {missing}"


def update() -> None:
    """Rewrite every captured block's output with what its command prints now."""
    text = README.read_text()
    for block in reversed(captured_blocks(text)):
        start, end = block.span("output")
        text = text[:start] + run_captured(block["command"]) + text[end:]
    README.write_text(text)
    print(f"updated {len(captured_blocks(text))} captured blocks in {README}")


if __name__ == "__main__":
    if sys.argv[1:] != ["--update"]:
        sys.exit("usage: python tests/unit/test_readme.py --update   (rewrites the README's captured outputs)")
    update()
