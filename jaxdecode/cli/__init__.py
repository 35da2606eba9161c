"""The `jaxdecode` command: the composition root that wires `jaxdecode`, `models` and `serving`
together (the apps layer of docs/architecture.md). Only this package of `jaxdecode` imports
`models` / `serving`, inside the subcommands; loading a model from flags is
`serving.loading`, shared with the server.

    jaxdecode generate [--model DIR|demo] [--prompt TEXT | --prompt-file F] [--max-tokens N] ...
        [--speculative prompt_lookup|demo-draft|DIR] [--num-speculative-tokens K]
        (streams through the engine `jd.LLM`: detokenizer, stop matcher, ordered stream)
    jaxdecode replay FILE [--model DIR|demo]
    jaxdecode serve [--model DIR|demo] [--host 127.0.0.1] [--port 8000] [--max-slots N] [--max-len N]
        [--api-key KEY] [--on-disconnect cancel|continue] [--max-queue N]
        [--speculative prompt_lookup|demo-draft|DIR] [--num-speculative-tokens K]
        [--mesh data=N,model=M] [--distributed]
        (the OpenAI-compatible HTTP server of `serving/`; multi-host: serving/README.md)
    jaxdecode bench [--model DIR|demo|CONFIG] [--batch N]... [--compare-hf] [--json FILE]
    jaxdecode bench --serve [--model DIR|demo | --url URL] [--requests N] [--concurrency C]...
        [--max-tokens N] [--max-slots N] [--json FILE]
        (the HTTP load test of `jaxdecode.cli.bench.loadtest`: streaming requests against `jaxdecode serve`)

One module per subcommand (`generate`, `replay`, `serve`, `bench/`), each with `add_parser`.
"""

from __future__ import annotations

import argparse
from typing import Optional, Sequence


def build_parser() -> argparse.ArgumentParser:
    from jaxdecode.cli import bench, generate, replay, serve

    parser = argparse.ArgumentParser(prog="jaxdecode", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for command in (generate, replay, serve, bench):
        command.add_parser(sub)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)
