"""The command line: the load test's flags (`add_arguments`, shared with `jaxdecode bench
--serve`), their `LoadConfig`, and `main`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Any

from jaxdecode.cli.bench.loadtest.client import run
from jaxdecode.cli.bench.loadtest.config import WORKLOADS, LoadConfig
from jaxdecode.cli.bench.loadtest.report import format_table
from jaxdecode.cli.bench.loadtest.server import ServerProcess, warmup_tokens

# flags that shape one workload's prompts (default None: LoadConfig's value)
_WORKLOAD_FLAGS = {"input_len": ("random",),
                   "token_min": ("random", "prefix-repetition", "sharegpt"),
                   "token_max": ("random", "prefix-repetition", "sharegpt"),
                   "num_prefixes": ("prefix-repetition",), "prefix_len": ("prefix-repetition",),
                   "suffix_len": ("prefix-repetition",), "max_input_len": ("sharegpt",),
                   "max_total_len": ("sharegpt",)}


def add_arguments(p: Any) -> None:
    """The load test's flags except --model and --json, which `jaxdecode bench` already has
    (`p`: a parser or an argument group)."""
    _add_target_and_arrival_arguments(p)
    _add_shape_and_request_arguments(p, LoadConfig())


def _add_target_and_arrival_arguments(p: Any) -> None:
    p.add_argument("--url", default=None,
                   help="test a running OpenAI-compatible server (jaxdecode, vLLM, ...) at "
                        "this URL instead of starting one")
    p.add_argument("--server-pid", type=int, default=None,
                   help="with --url: the server's pid, to read its memory (VmRSS)")
    p.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="send `model: NAME` in every body (vLLM needs its served name); a "
                        "started server is given --model-name NAME (default: no model field)")
    p.add_argument("--server-arg", action="append", default=None, metavar="ARG",
                   help="an extra flag for the started `jaxdecode serve` (repeatable; write "
                        "--server-arg=--no-prefix-cache)")
    p.add_argument("--workload", choices=WORKLOADS, default="snippets",
                   help="snippets: 16 Python snippets as text; random: --input-len random "
                        "token ids; prefix-repetition: --num-prefixes shared prefixes of "
                        "--prefix-len tokens + --suffix-len distinct tokens; sharegpt: a "
                        "ShareGPT-like lognormal length mix, generated locally")
    p.add_argument("--requests", type=int, default=200, help="requests per concurrency level")
    p.add_argument("--concurrency", "--max-concurrency", dest="concurrency", type=int,
                   action="append",
                   help="at most this many requests in flight; one level per value "
                        "(repeatable, either name; default 8, 32, 64)")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="arrivals per second, a Poisson process (see --burstiness); default "
                        "inf: every request at once")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the gaps between arrivals (1: Poisson; < 1 burstier)")


def _add_shape_and_request_arguments(p: Any, d: LoadConfig) -> None:
    p.add_argument("--max-tokens", "--output-len", dest="max_tokens", type=int, default=None,
                   help=f"output tokens per request (default {d.max_tokens}); with sharegpt: "
                        "fix every output length to this instead of drawing it")
    p.add_argument("--input-len", type=int, default=None,
                   help=f"random: prompt tokens per request (default {d.input_len})")
    p.add_argument("--token-min", type=int, default=None,
                   help=f"generated prompts' token ids are >= this (default {d.token_min})")
    p.add_argument("--token-max", type=int, default=None,
                   help=f"... and < this (default {d.token_max}: fits a 4096-token "
                        "vocabulary such as the demo model's)")
    p.add_argument("--num-prefixes", type=int, default=None,
                   help=f"prefix-repetition: shared prefixes (default {d.num_prefixes})")
    p.add_argument("--prefix-len", type=int, default=None,
                   help=f"prefix-repetition: tokens per prefix (default {d.prefix_len})")
    p.add_argument("--suffix-len", type=int, default=None,
                   help=f"prefix-repetition: distinct tokens after it (default {d.suffix_len})")
    p.add_argument("--max-input-len", type=int, default=None,
                   help=f"sharegpt: clip input lengths to this (default {d.max_input_len})")
    p.add_argument("--max-total-len", type=int, default=None,
                   help="sharegpt: input + output at most this (default: 2048, or the "
                        "server's max_model_len when smaller)")
    p.add_argument("--temperature", type=float, default=None,
                   help="default 0.8 for snippets, 0 (greedy, as `vllm bench serve`) otherwise")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="generate exactly the output length per request (default: yes)")
    p.add_argument("--chat", action="store_true",
                   help="use /v1/chat/completions (snippets only)")
    p.add_argument("--seed", type=int, default=0,
                   help="the workload's and the arrivals' seed; request i uses seed SEED + i")
    p.add_argument("--warmup-requests", type=int, default=4, help="sent first, not counted")
    p.add_argument("--request-timeout", type=float, default=300.0, help="seconds per request")
    p.add_argument("--api-key", default=None, help="Bearer key for the server")
    p.add_argument("--max-slots", type=int, default=None,
                   help="the started server's --max-slots (default 8)")
    p.add_argument("--max-len", type=int, default=None,
                   help="the started server's --max-len (default 512)")
    p.add_argument("--startup-timeout", type=float, default=None,
                   help="seconds to wait for the started server's /health (default 600)")


def config_from_args(args: argparse.Namespace) -> LoadConfig:
    """The LoadConfig of parsed flags; SystemExit naming the flag for a bad value or a flag of
    another workload."""
    flag = lambda name: "--" + name.replace("_", "-")  # noqa: E731
    for name, workloads in _WORKLOAD_FLAGS.items():
        if getattr(args, name) is not None and args.workload not in workloads:
            raise SystemExit(f"{flag(name)}: only with --workload {' or '.join(workloads)}")
    shaped = {n: getattr(args, n) for n in _WORKLOAD_FLAGS if getattr(args, n) is not None}
    sharegpt = args.workload == "sharegpt"
    try:
        return LoadConfig(
            requests=args.requests, concurrency=tuple(args.concurrency or (8, 32, 64)),
            max_tokens=(args.max_tokens if args.max_tokens is not None and not sharegpt
                        else LoadConfig.max_tokens),
            sharegpt_output_len=args.max_tokens if sharegpt else None,
            temperature=args.temperature, ignore_eos=args.ignore_eos, chat=args.chat,
            seed=args.seed, warmup_requests=args.warmup_requests,
            timeout_s=args.request_timeout, api_key=args.api_key,
            model_name=args.served_model_name, workload=args.workload,
            request_rate=args.request_rate, burstiness=args.burstiness, **shaped)
    except ValueError as e:
        name = str(e).split(":")[0]
        names = {"sharegpt_output_len": "max_tokens", "model_name": "served_model_name",
                 "timeout_s": "request_timeout"}
        raise SystemExit(f"{flag(names.get(name, name))}: {e}") from None


def main(args: argparse.Namespace) -> int:
    """Run the load test from parsed flags; exit 1 when a request failed or a request is still
    running at the end."""
    try:
        import httpx  # checked before starting a server, not after
    except ImportError:
        raise SystemExit("the load test needs httpx (pip install httpx, or the project's dev "
                         "extra)") from None
    if args.server_pid is not None and args.url is None:
        raise SystemExit("--server-pid: only with --url (a started server's pid is known)")
    if args.url is not None:
        for name in ("model", "max_slots", "max_len", "startup_timeout", "server_arg"):
            if getattr(args, name) not in (None, "demo"):
                raise SystemExit(f"--{name.replace('_', '-')}: configures the started server; "
                                 "with --url the server is already running")
    cfg = config_from_args(args)
    progress = lambda row: print(json.dumps(row), file=sys.stderr)  # noqa: E731
    try:
        if args.url is not None:
            report = run(args.url.rstrip("/"), cfg, args.server_pid, progress)
        else:
            extra = [*(["--model-name", cfg.model_name] if cfg.model_name else []),
                     *(args.server_arg or [])]
            with ServerProcess(args.model or "demo", args.max_slots or 8, args.max_len or 512,
                               args.api_key, extra, warmup_tokens(cfg)) as server:
                server.start(args.startup_timeout or 600.0)
                report = run(server.url, cfg, server.pid, progress)
                report["server"] = {"argv": server.argv[1:]}
    except (RuntimeError, httpx.HTTPError) as e:
        raise SystemExit(f"--url {args.url}: {e}" if args.url else str(e)) from None
    print(format_table(report))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    failed = sum(r["errors"] for r in report["levels"])
    return 0 if failed == 0 and report["requests_running_at_end"] in (0, None) else 1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jaxdecode.cli.bench.loadtest",
                                description="An HTTP load test of OpenAI-compatible servers "
                                            "with the metrics of `vllm bench serve`.")
    p.add_argument("--model", default="demo",
                   help="the started server's model: a local HF checkpoint directory, or 'demo'")
    p.add_argument("--json", help="write the report as JSON")
    add_arguments(p)
    return p
