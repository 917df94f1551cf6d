"""The explorer's web app: the static page, and a JSON API over `dmt estimate`, `dmt plan` and the generator.

A request body is data from anyone who can reach the port (`--host 0.0.0.0`): it is read up to MAX_BODY_BYTES,
must be one JSON object nested at most MAX_BODY_DEPTH deep with finite numbers, and anything else is answered 4xx
with one JSON line {"error", "key"}. Only a bug answers 500, logged whole.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from toolkit.errors import UserInputError
from toolkit.estimate.params import count_params
from toolkit.explore.bridge import error_payload, run_verb
from toolkit.explore.form import form_fields
from toolkit.explore.launch_files import launch_files
from toolkit.readers import DuplicateKey, one_line, unique_keys
from toolkit.spec.cluster import load_catalogue
from toolkit.spec.model import load_model_spec, preset_names

STATIC = Path(__file__).resolve().parent / "static"
logger = logging.getLogger(__name__)
# a request is a form's options, a pasted config.json and an uploaded calibration: tens of KiB; 1 MiB is ample and
# bounds what a request makes the server hold, parse and write
MAX_BODY_BYTES = 2**20
# an HF config.json nests 3-4 levels; deeper structures would recurse in the YAML/pydantic code that handles them
MAX_BODY_DEPTH = 32


def page_setup(initial_model) -> dict:
    """What the page builds its form from: the verbs' fields, presets with their sizes, the GPU catalogue."""
    presets = [{"name": name, "params": count_params(load_model_spec(name)).total} for name in preset_names()]
    gpus = {gpu.name: gpu.memory_bytes for gpu in load_catalogue().values()}
    return {
        "fields": {verb: form_fields(verb) for verb in ("estimate", "plan")},
        "presets": sorted(presets, key=lambda p: p["params"]),
        "gpus": [{"name": name, "memory_bytes": memory} for name, memory in sorted(gpus.items())],
        "initial": {"model": initial_model},
    }


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a number JSON allows")  # Python's json reads NaN and Infinity unless told


def _depth(value) -> int:
    """How deep lists and objects nest in a parsed JSON value (iteratively: no recursion on hostile input)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, (dict, list)):
            deepest = max(deepest, depth)
            if depth > MAX_BODY_DEPTH:
                break
            stack.extend((item, depth + 1) for item in (value.values() if isinstance(value, dict) else value))
    return deepest


async def _body(request: Request) -> dict:
    """The request's JSON object, or an HTTPException (413, 400) saying what a body must be."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise HTTPException(413, f"the request body has {declared} bytes; at most {MAX_BODY_BYTES} are read")
    body = bytearray()
    async for chunk in request.stream():  # without a Content-Length (chunked), counted as it comes
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            raise HTTPException(413, f"the request body is over {MAX_BODY_BYTES} bytes, the most that is read")
    try:
        data = json.loads(body, parse_constant=_refuse_constant, object_pairs_hook=unique_keys)
    except DuplicateKey as exc:
        raise HTTPException(400, f"the request body {exc}; expected a JSON object of options, each once") from None
    except RecursionError:
        raise HTTPException(400, f"the request body nests deeper than {MAX_BODY_DEPTH} levels") from None
    except ValueError as exc:  # json.JSONDecodeError, UnicodeDecodeError, NaN, an integer of over 4300 digits
        raise HTTPException(400, f"the request body is not JSON ({one_line(exc)}); expected a JSON "
                                 f"object of options, e.g. {{\"model\": \"llama-3.1-8b\"}}") from None
    if not isinstance(data, dict):
        raise HTTPException(400, f"the request body is a JSON {type(data).__name__}; expected a JSON object of "
                                 f"options, e.g. {{\"model\": \"llama-3.1-8b\"}}")
    if _depth(data) > MAX_BODY_DEPTH:
        raise HTTPException(400, f"the request body nests deeper than {MAX_BODY_DEPTH} levels")
    try:  # a \ud800 escape is valid JSON but no text: it could be neither written to a file nor answered
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as exc:
        raise HTTPException(400, f"the request body holds {exc.object[exc.start:exc.end]!r}, a lone surrogate "
                                 f"that is not a character; expected UTF-8 text") from None
    return data


async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    """Bad input (and Starlette's own 404 and 405): 4xx with one line."""
    error = one_line(f"{request.url.path}: {exc.detail}")  # the path is percent-decoded: %0A would be a newline
    return JSONResponse({"error": error, "key": None}, status_code=exc.status_code, headers=exc.headers)


async def _bug(request: Request, exc: Exception) -> JSONResponse:
    """Anything else is a bug of the explorer: logged whole, answered 500 in one line."""
    logger.error("dmt explore: %s %s failed", request.method, request.url.path, exc_info=exc)
    return JSONResponse({"error": f"{request.url.path}: internal error: {type(exc).__name__}", "key": None},
                        status_code=500)


def _cli_route(verb: str):
    async def endpoint(request: Request) -> JSONResponse:
        try:
            body = await _body(request)
        except UserInputError as exc:
            return JSONResponse(error_payload(verb, exc), status_code=400)
        status, payload = await run_in_threadpool(run_verb, verb, body)
        return JSONResponse(payload, status_code=status)

    return endpoint


async def generate(request: Request) -> JSONResponse:
    try:
        files = await run_in_threadpool(launch_files, await _body(request))
    except UserInputError as exc:  # its key is the request's (`plan.tp`, `--calibration`), as a request key
        return JSONResponse(error_payload("generate", exc), status_code=400)
    return JSONResponse({"files": files})


def create_app(initial_model=None) -> Starlette:
    setup = page_setup(initial_model)

    async def index(request: Request) -> FileResponse:
        return FileResponse(STATIC / "index.html")

    async def form(request: Request) -> JSONResponse:
        return JSONResponse(setup)

    return Starlette(exception_handlers={HTTPException: _http_error, Exception: _bug}, routes=[
        Route("/", index),
        Route("/api/form", form),
        Route("/api/estimate", _cli_route("estimate"), methods=["POST"]),
        Route("/api/plan", _cli_route("plan"), methods=["POST"]),
        Route("/api/generate", generate, methods=["POST"]),
        Mount("/static", StaticFiles(directory=STATIC), name="static"),
    ])
