"""`jaxdecode serve`: the OpenAI-compatible HTTP server of `serving/` (serving/server.py)."""

from __future__ import annotations


def cmd_serve(args) -> int:
    from serving import server

    return server.main(args)


def add_parser(sub) -> None:
    s = sub.add_parser("serve", help="the OpenAI-compatible HTTP server (SSE streaming)")
    _add_serve_arguments(s)
    s.set_defaults(func=cmd_serve)


def _add_serve_arguments(p) -> None:
    # the flags live next to the server; importing serving.server is cheap (no FastAPI import)
    from serving.server import add_arguments

    add_arguments(p)
