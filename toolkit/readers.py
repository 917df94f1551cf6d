"""The one reading path per file format: any read, decode or shape error becomes one UserInputError line naming the
file and what was expected, never a traceback."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from toolkit.errors import UserInputError


def one_line(exc: BaseException) -> str:
    """An exception's message on one line (YAML and validation errors span several, with carets)."""
    return " ".join(line.strip() for line in str(exc).splitlines() if line.strip()) or type(exc).__name__


def problem(path: Path, key: str | None, message: str) -> UserInputError:
    """One line naming the file: `KEY: PATH <message>`, or `PATH: <message>` when no flag names it."""
    return UserInputError(key, f"{path} {message}") if key else UserInputError(str(path), message)


def read_text(path: Path, key: str | None = None, what: str = "a text file") -> str:
    """UTF-8 text; `key` names the flag or setting that gave the path (the path itself names it otherwise)."""
    path = Path(path)
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise problem(path, key, f"does not exist; expected {what}") from None
    except IsADirectoryError:
        raise problem(path, key, f"is a directory; expected {what}") from None
    except UnicodeDecodeError:
        raise problem(path, key, f"is not UTF-8 text; expected {what}") from None
    except OSError as exc:
        raise problem(path, key, f"cannot be read ({exc.strerror or one_line(exc)})") from None


def _shape(data: Any, path: Path, key: str | None, expect: type | None, what: str) -> Any:
    if expect is not None and not isinstance(data, expect):
        found = "nothing" if data is None else f"a {type(data).__name__}"
        raise problem(path, key, f"holds {found} at the top level; expected {what}")
    return data


def read_json(path: Path, key: str | None = None, expect: type | None = dict, what: str = "a JSON object") -> Any:
    """A JSON document whose top level is `expect` (dict by default; None: anything)."""
    path = Path(path)
    text = read_text(path, key, what)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise problem(path, key, f"is not valid JSON ({exc.msg} at line {exc.lineno}); expected {what}") from None
    return _shape(data, path, key, expect, what)


def read_yaml(path: Path, key: str | None = None, expect: type | None = dict, what: str = "a YAML mapping") -> Any:
    """A YAML document whose top level is `expect` (dict by default; None: anything)."""
    import yaml

    path = Path(path)
    text = read_text(path, key, what)
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise problem(path, key, f"is not valid YAML ({one_line(exc)}); expected {what}") from None
    return _shape(data, path, key, expect, what)
