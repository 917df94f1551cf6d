"""The explorer's web app: the static page, and a JSON API over `dmt estimate`, `dmt plan` and the generator."""

from __future__ import annotations

import logging
from pathlib import Path

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from toolkit.errors import UserInputError

STATIC = Path(__file__).resolve().parent / "static"
logger = logging.getLogger(__name__)


def page_setup(initial_model) -> dict:
    """What the page builds its form from: the verbs' fields, presets with their sizes, the GPU catalogue."""
    from toolkit.estimate.params import count_params
    from toolkit.explore.form import form_fields
    from toolkit.spec.cluster import load_catalogue
    from toolkit.spec.model import load_model_spec, preset_names

    presets = [{"name": name, "params": count_params(load_model_spec(name)).total} for name in preset_names()]
    gpus = {gpu.name: gpu.memory_bytes for gpu in load_catalogue().values()}
    return {
        "fields": {verb: form_fields(verb) for verb in ("estimate", "plan")},
        "presets": sorted(presets, key=lambda p: p["params"]),
        "gpus": [{"name": name, "memory_bytes": memory} for name, memory in sorted(gpus.items())],
        "initial": {"model": initial_model},
    }


async def _body(request: Request):
    """The request's JSON, through the toolkit's one JSON reader: at most SIZE_LIMITS["json"] bytes are received and
    nesting is bounded, so that a body that never ends or nests a million deep is one line, not memory or a 500.
    Whether it is an object is the handler's to say."""
    from toolkit.readers import SIZE_LIMITS, parse_json

    limit, body = SIZE_LIMITS["json"], bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise UserInputError("the request body", f"holds more than {limit} bytes; expected a JSON object")
    return parse_json(bytes(body), "the request body", None, None, "a JSON object")


def _cli_route(verb: str):
    async def endpoint(request: Request) -> JSONResponse:
        from toolkit.explore.bridge import error_payload, run_verb

        try:
            body = await _body(request)
        except UserInputError as exc:
            return JSONResponse(error_payload(verb, f"dmt {verb}: error: {exc}"), status_code=400)
        status, payload = await run_in_threadpool(run_verb, verb, body)
        return JSONResponse(payload, status_code=status)

    return endpoint


async def generate(request: Request) -> JSONResponse:
    from toolkit.explore.launch_files import launch_files

    try:
        files = await run_in_threadpool(launch_files, await _body(request))
    except UserInputError as exc:
        return JSONResponse({"error": f"dmt generate: error: {exc}", "key": None}, status_code=400)
    return JSONResponse({"files": files})


def create_app(initial_model=None) -> Starlette:
    setup = page_setup(initial_model)

    async def index(request: Request) -> FileResponse:
        return FileResponse(STATIC / "index.html")

    async def form(request: Request) -> JSONResponse:
        return JSONResponse(setup)

    return Starlette(routes=[
        Route("/", index),
        Route("/api/form", form),
        Route("/api/estimate", _cli_route("estimate"), methods=["POST"]),
        Route("/api/plan", _cli_route("plan"), methods=["POST"]),
        Route("/api/generate", generate, methods=["POST"]),
        Mount("/static", StaticFiles(directory=STATIC), name="static"),
    ])
