"""`dmt explore`: serve the interactive memory and plan explorer on a local port and print its URL."""

from __future__ import annotations

import argparse
import sys

from toolkit.errors import UserInputError, interrupted
from toolkit.numeric import bounded_int
from toolkit.readers import read_json
from toolkit.spec.model import load_model_spec, preset_names

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--port", type=bounded_int, default=8765, help="TCP port (default %(default)s; 0: any free port)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to bind (default %(default)s, this machine only; 0.0.0.0 serves everyone who "
                             "can reach it, without authentication)")
    parser.add_argument("--model", default=None,
                        help="model shown first: a preset, or an HF config.json (file or directory)")


def initial_model(source: str | None):
    """A preset name, or the contents of an HF config.json (the page sends it back as a pasted config)."""
    from pathlib import Path

    if source is None or source in preset_names():
        return source
    path = Path(source).expanduser()
    path = path / "config.json" if path.is_dir() else path
    if path.suffix != ".json" or not path.is_file():
        raise UserInputError("--model", f"{source}: dmt explore takes a preset or an HF config.json (file or "
                                        f"directory); presets: {', '.join(preset_names())}")
    load_model_spec(str(path))  # the same checks and one-line errors as dmt estimate
    return read_json(path, "--model", what="an HF config.json")


def _listen(host: str, port: int):
    import errno
    import socket

    if not 0 <= port <= 65535:
        raise UserInputError("--port", f"must be 0-65535, got {port}")
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except (OSError, ValueError, TypeError) as exc:  # a name that does not resolve, or is no host name at all
        raise UserInputError("--host", f"{host!r} is not an address or host name of this machine "
                                       f"({getattr(exc, 'strerror', None) or exc}); e.g. 127.0.0.1 or 0.0.0.0") from None
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except (ValueError, TypeError) as exc:  # a NUL in the name: not a host name socket can even pass on
        sock.close()
        raise UserInputError("--host", f"{host!r} is not an address or host name ({exc}); e.g. 127.0.0.1") from None
    except OSError as exc:
        sock.close()
        if exc.errno in (errno.EADDRINUSE, errno.EACCES):  # the port is taken, or privileged
            raise UserInputError("--port", f"cannot listen on {host}:{port} ({exc.strerror}); pick another --port "
                                           f"(0: any free one)") from None
        raise UserInputError("--host", f"cannot listen on {host}:{port} ({exc.strerror or exc}); give an address "
                                       f"of this machine (127.0.0.1, or 0.0.0.0 for every interface)") from None
    sock.listen()  # before the URL is printed: a client that opens it at once waits in the backlog, never refused
    return sock


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from toolkit.explore.server import create_app  # lazy: starlette

    app = create_app(initial_model(args.model))
    sock = _listen(args.host, args.port)
    if args.host not in LOOPBACK:
        print(f"dmt explore: warning: --host {args.host} serves the explorer to every machine that can reach this "
              f"one, with no authentication", file=sys.stderr)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    url = f"http://{shown}:{port}/"
    print(f"dmt explore: serving {url} (Ctrl-C to stop)", flush=True)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    try:
        server.run(sockets=[sock])  # uvicorn shuts down on SIGINT, then raises it again
    except KeyboardInterrupt as exc:
        raise interrupted(exc, f"stopped serving {url}") from None
    return 0
