"""The standard library's private API the toolkit reaches into: argparse's list of a parser's actions (the explorer
builds its form from the verbs' own parsers; validation reads `accelerate launch`'s flags from its parser), and
pickle's table of Python 2 names (the restricted unpickler judges a global by the name pickle will import)."""

from __future__ import annotations

import argparse

from toolkit.compat import Seam

SEAMS = [
    Seam("python", "argparse.ArgumentParser._actions", kind="in_source",
         why="every action of a parser, in order: argparse has no public list of a parser's arguments"),
    Seam("python", "argparse._HelpAction", "the -h action, which the explorer's form leaves out"),
    Seam("python", "argparse._VersionAction", "the --version action, which the explorer's form leaves out"),
    Seam("python", "_compat_pickle.NAME_MAPPING",
         "the Python 3 (module, name) pickle's Unpickler imports for a Python 2 global (protocol 2, torch.save's): "
         "checkpoint/safe_load.py allows or refuses the name pickle will really import; pickle has no public table"),
    Seam("python", "_compat_pickle.IMPORT_MAPPING", "the same table for module names"),
    Seam("python", "tempfile.tempdir",
         "set for the moment `import wandb` runs (tempfile's documented default directory): wandb creates its media "
         "and artifact temp dirs at import, in the default directory, and removes them only at interpreter exit, "
         "which a rank ending by os._exit never reaches; pointed into the run's directory they are removed with it",
         used_in="toolkit/runtime/metrics.py: configure_wandb's import of wandb"),
]


def python3_name(module: str, name: str) -> tuple[str, str]:
    """The (module, name) a protocol 2 pickle's global becomes in Python 3, as pickle's Unpickler maps it."""
    import _compat_pickle

    module, name = _compat_pickle.NAME_MAPPING.get((module, name), (module, name))
    return _compat_pickle.IMPORT_MAPPING.get(module, module), name


def parser_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return list(parser._actions)


def is_help_or_version(action: argparse.Action) -> bool:
    return isinstance(action, (argparse._HelpAction, argparse._VersionAction))
