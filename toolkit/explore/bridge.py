"""Answers an API request with what `dmt estimate` / `dmt plan` compute: the typed record their `--json` prints, or
their one error line with the option at fault.

The answer is the command's, not a re-implementation of it: the request becomes the verb's arguments (form.py, read
by the verb's own parser), and the function the verb itself calls (`result(args)` of toolkit.cli.<verb>) makes the
record. Each request has its own temp dir, written as `.` in what comes back (an uploaded calibration is
`./calibration.yaml`).
"""

from __future__ import annotations

import importlib
import json
import logging
import tempfile
import threading
from pathlib import Path

from toolkit.cli.main import VERBS
from toolkit.errors import UserInputError, error_line
from toolkit.explore.form import parse_request, request_key
from toolkit.numeric import json_text
from toolkit.outputs import command_inputs

logger = logging.getLogger(__name__)
# The path flags register a command's inputs in one process-wide list as they are parsed (toolkit.outputs): a
# request is parsed and answered alone, inside its own toolkit.outputs.command_inputs()
_ONE_AT_A_TIME = threading.Lock()


def error_payload(verb: str, exc: UserInputError, workdir: Path | None = None) -> dict:
    """{"error": the CLI's line, "key": the request key of the option at fault (null when none)}."""
    line = error_line(f"dmt {verb}", exc)
    return {"error": as_dot(line, workdir) if workdir is not None else line, "key": request_key(exc.key)}


def as_dot(text: str, workdir: Path) -> str:
    """`text` with the request's temp dir written as `.`, as if its files sat in the user's working directory."""
    for name in sorted({str(workdir.resolve()), str(workdir)}, key=len, reverse=True):
        text = text.replace(name, ".")
    return text


def run_verb(verb: str, request: dict) -> tuple[int, object]:
    """(HTTP status, JSON body): 200 and what `dmt <verb> --json` prints, 400 and its error line."""
    with tempfile.TemporaryDirectory(prefix="dmt-explore-") as workdir:
        try:
            with _ONE_AT_A_TIME, command_inputs():
                args = parse_request(verb, request, Path(workdir))
                record = importlib.import_module(VERBS[verb][0]).result(args)
        except UserInputError as exc:
            return 400, error_payload(verb, exc, Path(workdir))
        except Exception as exc:  # a bug, not bad input: logged whole, answered in one line
            logger.exception("dmt %s failed on %s", verb, request)
            return 500, {"error": f"dmt {verb}: internal error: {type(exc).__name__}: {exc}".splitlines()[0],
                         "key": None}
        # the JSON the command prints (json_text: its rules for numbers), with the temp dir written as `.`
        return 200, json.loads(as_dot(json_text(record.as_json()), Path(workdir)))
