"""Runs `dmt estimate` / `dmt plan` in-process for an API request: their `--json` output, or their one error line.

The answer is what the command prints, not a re-implementation of it: the request becomes the command line
(form.request_argv), `toolkit.cli.main.main` runs it, and its stdout is the JSON. Commands run one at a time
(standard streams are process-wide), each in its own temp dir, written as `.` in what comes back (an uploaded
calibration is `./calibration.yaml`).
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import re
import tempfile
import threading
from pathlib import Path

from toolkit.errors import UserInputError

logger = logging.getLogger(__name__)
_ONE_AT_A_TIME = threading.Lock()
_FLAG = re.compile(r"(--[a-z0-9][a-z0-9-]*)")


def error_payload(verb: str, line: str) -> dict:
    """{"error": the CLI's line, "key": the request key of the first flag it names (null when none)}."""
    message = line.split(": error: ", 1)[-1]
    match = _FLAG.search(message)
    return {"error": line, "key": match.group(1)[2:].replace("-", "_") if match else None}


def as_dot(text: str, workdir: Path) -> str:
    """`text` with the request's temp dir written as `.`, as if its files sat in the user's working directory."""
    for name in sorted({str(workdir.resolve()), str(workdir)}, key=len, reverse=True):
        text = text.replace(name, ".")
    return text


def run_verb(verb: str, request: dict) -> tuple[int, object]:
    """(HTTP status, JSON body): 200 and what `dmt <verb> --json` prints, 400 and its error line."""
    from toolkit.cli.main import main
    from toolkit.explore.form import request_argv

    with tempfile.TemporaryDirectory(prefix="dmt-explore-") as workdir:
        try:
            argv = request_argv(verb, request, Path(workdir))
        except UserInputError as exc:
            return 400, error_payload(verb, f"dmt {verb}: error: {exc}")
        out, err = io.StringIO(), io.StringIO()
        with _ONE_AT_A_TIME, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(argv)
            except Exception as exc:  # a bug, not bad input: logged whole, answered in one line
                logger.exception("dmt %s failed on %s", verb, argv)
                return 500, {"error": f"dmt {verb}: internal error: {type(exc).__name__}: {exc}".splitlines()[0],
                             "key": None}
        printed, complaints = (as_dot(text, Path(workdir)) for text in (out.getvalue(), err.getvalue()))
    if code in (0, 1):  # dmt plan exits 1 with an empty list when no plan fits
        try:
            return 200, json.loads(printed)
        except json.JSONDecodeError:
            pass
    lines = [line for line in complaints.splitlines() if line.startswith(f"dmt {verb}")]
    return 400, error_payload(verb, lines[-1] if lines else f"dmt {verb}: error: exit code {code}")
