"""The page's form and the API's request keys, both read off the argparse parsers the CLI verbs build.

A request key is a long flag with dashes as underscores (`--seq-len` -> `seq_len`). Nothing here lists option
names: a flag added to `dmt estimate` or `dmt plan` becomes a form field and a request key by itself. Options that
name a file (argparse type Path) are refused, as the page must not read or write outside a temp directory; the
few files the page may give (UPLOADS) come as their content, checked here and written into the request's temp dir.
"""

from __future__ import annotations

import argparse
import importlib
import json
from functools import lru_cache
from pathlib import Path

from toolkit.cli.main import VERBS, OneLineParser, parse_arguments
from toolkit.cli.paths import output_arg, path_arg
from toolkit.compat.stdlib_seams import is_help_or_version, parser_actions
from toolkit.errors import UsageError, UserInputError
from toolkit.numeric import FLOAT_FLAGS, INT_FLAGS
from toolkit.readers import parse_json
from toolkit.spec.calibration import parse_calibration
from toolkit.spec.model import PRESET_DIR, preset_names

ALWAYS = "json"  # the API answers with what `--json` prints, so it is always on and not a field
PASTED_MODEL_DIR = "pasted-config"  # the model name a pasted config.json gets (its directory's name)


def _check_calibration(text: str, key: str) -> None:
    parse_calibration(text, "the uploaded calibration", key)


# file options the page takes as uploaded content, never as a path: request key -> (the file name it is written
# under in the request's temp dir, the check of its text that the CLI's own reader makes of that file)
UPLOADS = {"calibration": ("calibration.yaml", _check_calibration)}


@lru_cache(maxsize=None)
def verb_parser(verb: str) -> argparse.ArgumentParser:
    """The parser `dmt <verb>` builds (toolkit.cli.<verb>.add_arguments), on its own, raising its errors (a request's
    bad value is a UsageError naming the option, not an exit)."""
    parser = OneLineParser(prog=f"dmt {verb}", exit_on_error=False)
    importlib.import_module(VERBS[verb][0]).add_arguments(parser)
    return parser


def _key(action: argparse.Action) -> str | None:
    long_flags = [s for s in action.option_strings if s.startswith("--")]
    return long_flags[0][2:].replace("-", "_") if long_flags else None


def _reads_files(action: argparse.Action) -> bool:
    return action.type in (Path, path_arg, output_arg) or isinstance(action.type, argparse.FileType)


def options(verb: str) -> dict[str, argparse.Action]:
    """Request key -> argparse action, for every option of the verb the page may set."""
    found = {}
    for action in parser_actions(verb_parser(verb)):
        key = _key(action)
        if key is None or key == ALWAYS or is_help_or_version(action):
            continue
        if key in UPLOADS or not _reads_files(action):
            found[key] = action
    return found


SWITCH_CHOICES = ["true", "false"]  # a switch with a --no- form (its default depends on other options): unset, on, off


def _kind(action: argparse.Action) -> str:
    if _reads_files(action):  # one of UPLOADS
        return "file"
    if action.nargs == 0 and action.const is True:  # store_true
        return "checkbox"
    if action.choices is not None or isinstance(action, argparse.BooleanOptionalAction):
        return "select"
    if action.type in (int, float, *INT_FLAGS, *FLOAT_FLAGS):
        return "number"
    return "text"


def _help(action: argparse.Action) -> str:
    text = action.help or ""
    return text.replace("%(default)s", str(action.default)).replace("%%", "%")


def form_fields(verb: str) -> list[dict]:
    """One field per option, in the parser's order: choices -> select, store_true -> checkbox, int -> number."""
    fields = []
    for key, action in options(verb).items():
        kind = _kind(action)
        fields.append({
            "key": key,
            "flag": "--" + key.replace("_", "-"),
            "kind": kind,
            "choices": list(action.choices) if action.choices is not None else
            SWITCH_CHOICES if isinstance(action, argparse.BooleanOptionalAction) else None,
            "step": 1 if action.type in (int, *INT_FLAGS) else "any" if action.type in (float, *FLOAT_FLAGS) else None,
            "default": action.default if kind == "checkbox" or action.default is None
            or isinstance(action.default, (int, float, str)) else str(action.default),
            "required": bool(action.required),
            "help": _help(action),
            "metavar": action.metavar if isinstance(action.metavar, str) else None,
        })
    return fields


def request_key(key: str | None) -> str | None:
    """The request key an error's key names: a flag's (`--seq-len`, argparse's `--x/--no-x`) with dashes as
    underscores; another key (`plan.tp`, `model`) as it is."""
    if key is None:
        return None
    return key.split("/")[0].removeprefix("--").replace("-", "_")


def request_argv(verb: str, request: dict, workdir: Path) -> list[str]:
    """The options of `dmt <verb>` that a request stands for, as a command line. A pasted config.json and uploaded
    files are written under `workdir` (a temp dir); presets are passed by their packaged path, so no other file is
    read. Values are passed as `--flag=value`, so that a value is never read as an option (`"--help"`, say)."""
    if not isinstance(request, dict):
        raise UserInputError("request", "expected a JSON object of options, e.g. {\"model\": \"llama-3.1-8b\"}")
    accepted = options(verb)
    argv = []
    for key, value in request.items():
        action = accepted.get(key)
        if action is None:
            raise UserInputError(f"--{key.replace('_', '-')}", f"not an option of dmt {verb} the page can set; "
                                                               f"valid: {', '.join(accepted)}")
        flag = action.option_strings[-1] if action.option_strings[-1].startswith("--") else action.option_strings[0]
        if value is None or value == "":
            continue
        if isinstance(action, argparse.BooleanOptionalAction):
            if str(value).lower() not in SWITCH_CHOICES:
                raise UserInputError(action.option_strings[0], f"expects true or false, got {value!r}")
            argv += [action.option_strings[0] if str(value).lower() == "true" else action.option_strings[1]]
        elif _kind(action) == "checkbox":
            if not isinstance(value, bool):
                raise UserInputError(flag, f"expects true or false, got {value!r}")
            argv += [flag] if value else []
        elif key == "model":
            argv += [f"{flag}={model_argument(value, workdir)}"]
        elif key in UPLOADS:
            argv += [f"{flag}={uploaded_file(key, value, workdir)}"]
        else:
            text = ",".join(map(str, value)) if isinstance(value, list) else str(value)
            argv += [f"{flag}={text}"]
    return argv


def parse_request(verb: str, request: dict, workdir: Path) -> argparse.Namespace:
    """The arguments `dmt <verb>` would parse from the command line a request stands for."""
    argv = request_argv(verb, request, workdir)
    # argparse names the options a command line lacks only in its message: the request's own, as its key
    missing = [action.option_strings[0] for key, action in options(verb).items()
               if action.required and request.get(key) in (None, "")]
    if missing:
        raise UsageError(missing[0], f"the following arguments are required: {', '.join(missing)}")
    return parse_arguments(verb_parser(verb), argv)


def model_argument(value, workdir: Path) -> str:
    """--model for the CLI: a preset's packaged config, or the pasted config.json written into workdir."""
    if isinstance(value, str) and value.strip().startswith("{"):
        value = parse_json(value, "the pasted config.json", "--model", dict, "an HF config.json object")
    if isinstance(value, dict):
        directory = workdir / PASTED_MODEL_DIR
        directory.mkdir(exist_ok=True)
        (directory / "config.json").write_text(json.dumps(value))
        return str(directory)
    if isinstance(value, str) and value in preset_names():
        return str(PRESET_DIR / f"{value}.json")
    raise UserInputError("--model", f"the page takes a preset or a pasted HF config.json (files and hub ids: "
                                    f"`dmt estimate` on the command line), got {value!r}; presets: "
                                    f"{', '.join(preset_names())}")


def uploaded_file(key: str, text, workdir: Path) -> Path:
    """The content of an uploaded file (one of UPLOADS), checked, then written into workdir for the CLI to read."""
    name, check = UPLOADS[key]
    flag = "--" + key.replace("_", "-")
    if not isinstance(text, str):
        raise UserInputError(flag, f"expects the text of the file (the page uploads it), got a "
                                   f"{type(text).__name__}")
    check(text, flag)
    path = workdir / name
    path.write_text(text, encoding="utf-8")
    return path
