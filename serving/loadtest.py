"""An HTTP load test of the server: streaming requests at several concurrency levels (issue #6).

    python -m serving.loadtest [--model demo] [--max-slots 8] [--max-len 512]
                               [--requests 200] [--concurrency 8 --concurrency 32 ...]
                               [--max-tokens 64] [--url URL [--server-pid PID]] [--json FILE]
    jaxdecode bench --serve ...            (the same flags)

Without `--url` it starts `jaxdecode serve --warmup` as a subprocess on a free loopback port,
waits for /health, sends a few warm-up requests that are not counted, and stops the server at
the end. For each concurrency level C it sends `requests` streaming `/v1/completions` (or chat)
requests with at most C in flight -- Python snippets as prompts, temperature 0.8, one seed per
request, `stream_options.include_usage` -- and measures on the client side:

- time to first token: request sent -> first chunk with non-empty text;
- inter-chunk latency: the gaps between successive chunks with text. The server sends one chunk
  per engine delta, which is usually one token but may carry several (or none while UTF-8 bytes
  are pending), so these are per chunk; `tokens_per_chunk` reports the ratio;
- output tokens/s: the usage chunks' `completion_tokens` summed over the level's wall time;
- errors: HTTP status != 200, an error event, no usage chunk, no `[DONE]`, or an exception.

Server memory is the server process's resident set (VmRSS of /proc/<pid>/status; with `--url`
only when `--server-pid` is given) after warm-up and after each level; /metrics gives the
compilations during the run and `jaxdecode_requests_running` at the end, which must be 0.
Module imports are the standard library only, so the CLI can add these flags cheaply; numpy and
httpx (the dev extra) are imported when a test runs.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any, Iterable, Optional, Sequence

# Short, varied Python snippets (each well under the 64-token prompt bucket `--warmup` compiles).
PROMPTS = (
    "def fibonacci(n):\n    ",
    "import os\n\ndef list_files(path):\n    ",
    "class Stack:\n    def __init__(self):\n        ",
    "def is_prime(n: int) -> bool:\n    ",
    "for i in range(10):\n    ",
    "with open('data.txt') as f:\n    ",
    "def merge_sort(items):\n    if len(items) <= 1:\n        ",
    "import json\n\ndef load_config(path):\n    ",
    "try:\n    value = int(text)\nexcept ValueError:\n    ",
    "def binary_search(arr, target):\n    lo, hi = 0, len(arr) - 1\n    ",
    "class Point:\n    def __init__(self, x, y):\n        ",
    "def read_lines(path):\n    with open(path) as f:\n        ",
    "import re\n\npattern = re.compile(",
    "def factorial(n):\n    if n == 0:\n        ",
    "numbers = [1, 2, 3, 4, 5]\nsquares = ",
    "def main():\n    args = parse_args()\n    ",
)


@dataclasses.dataclass(frozen=True)
class LoadConfig:
    requests: int = 200
    concurrency: tuple[int, ...] = (8, 32, 64)
    max_tokens: int = 64
    temperature: float = 0.8
    ignore_eos: bool = True
    chat: bool = False
    seed: int = 0
    warmup_requests: int = 4
    timeout_s: float = 300.0
    api_key: Optional[str] = None

    def __post_init__(self) -> None:
        if self.requests < 1:
            raise ValueError("requests: must be >= 1")
        if not self.concurrency or min(self.concurrency) < 1:
            raise ValueError("concurrency: every level must be >= 1")
        if self.max_tokens < 1:
            raise ValueError("max_tokens: must be >= 1")
        if self.warmup_requests < 0:
            raise ValueError("warmup_requests: must be >= 0")


@dataclasses.dataclass
class RequestResult:
    """One streaming request as the client saw it (times in seconds from sending it)."""
    status: int = 0
    error: Optional[str] = None
    chunk_times: list[float] = dataclasses.field(default_factory=list)  # chunks with text
    completion_tokens: Optional[int] = None
    done: bool = False

    @property
    def ok(self) -> bool:
        return (self.error is None and self.status == 200 and self.done
                and self.completion_tokens is not None)

    @property
    def ttft_s(self) -> Optional[float]:
        return self.chunk_times[0] if self.chunk_times else None

    @property
    def gaps_s(self) -> list[float]:
        return [b - a for a, b in itertools.pairwise(self.chunk_times)]

    def failure(self) -> str:
        """A short reason for a failed request (for the error counts)."""
        if self.error is not None:
            return self.error
        if self.status != 200:
            return f"http {self.status}"
        return "no [DONE]" if not self.done else "no usage chunk"


# -- pure pieces: SSE parsing, chunk text, percentiles -------------------------------------------

class SSEParser:
    """Server-sent events, fed line by line (without line endings); `feed` returns an event's
    data (multi-line data joined with "\\n") when a blank line ends it, else None. Comments
    (": keep-alive") and the other fields (id, event, retry) are ignored."""

    def __init__(self) -> None:
        self._data: list[str] = []

    def feed(self, line: str) -> Optional[str]:
        if not line:
            if not self._data:
                return None
            data, self._data = "\n".join(self._data), []
            return data
        if line.startswith(":"):
            return None
        field, _, value = line.partition(":")
        if field == "data":
            self._data.append(value.removeprefix(" "))
        return None


def sse_events(lines: Iterable[str]) -> list[str]:
    """The data of every complete event in `lines`."""
    parser = SSEParser()
    return [d for d in map(parser.feed, lines) if d is not None]


def chunk_text(chunk: dict) -> str:
    """The text of a completion or chat chunk's first choice ("" for role, usage and final
    chunks)."""
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if "delta" in choice:
        return choice["delta"].get("content") or ""
    return choice.get("text") or ""


def apply_event(result: RequestResult, data: str, elapsed_s: float) -> None:
    """Update `result` with one SSE event's data received `elapsed_s` after sending."""
    if data == "[DONE]":
        result.done = True
        return
    chunk = json.loads(data)
    if "error" in chunk:
        err = chunk["error"]
        result.error = "stream error: " + str(err.get("code") if isinstance(err, dict) else err)
        return
    if chunk.get("usage"):
        result.completion_tokens = chunk["usage"]["completion_tokens"]
    if chunk_text(chunk):
        result.chunk_times.append(elapsed_s)


def percentiles(values: Sequence[float], qs: Sequence[int] = (50, 99)) -> dict:
    """{"p50": ..., "p99": ...} (numpy's linear interpolation); None values when empty."""
    import numpy as np

    if len(values) == 0:
        return {f"p{q}": None for q in qs}
    got = np.percentile(np.asarray(values, dtype=np.float64), qs)
    return {f"p{q}": float(v) for q, v in zip(qs, got)}


def summarize(results: Sequence[RequestResult], concurrency: int, wall_s: float) -> dict:
    """One level's row: counts, latency percentiles (seconds) and throughput."""
    ok = [r for r in results if r.ok]
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.failure()] = errors.get(r.failure(), 0) + 1
    tokens = sum(r.completion_tokens for r in ok)
    chunks = sum(len(r.chunk_times) for r in ok)
    return {"concurrency": concurrency, "requests": len(results), "errors": len(results) - len(ok),
            "error_kinds": errors, "wall_s": wall_s, "output_tokens": tokens,
            "output_tokens_per_s": tokens / wall_s if wall_s > 0 else None,
            "requests_per_s": len(ok) / wall_s if wall_s > 0 else None,
            "ttft_s": percentiles([r.ttft_s for r in ok if r.ttft_s is not None]),
            "inter_chunk_s": percentiles([g for r in ok for g in r.gaps_s]),
            "tokens_per_chunk": tokens / chunks if chunks else None}


# -- the server process ---------------------------------------------------------------------------

def rss_mb(pid: int) -> Optional[float]:
    """The resident set of process `pid` in MiB (VmRSS), or None when it cannot be read."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`jaxdecode serve --warmup` in a subprocess on a free loopback port; its output goes to a
    temporary log file that `start` quotes when the server dies or never becomes healthy."""

    def __init__(self, model: str = "demo", max_slots: int = 8, max_len: int = 512,
                 api_key: Optional[str] = None, extra_args: Sequence[str] = ()):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.argv = [sys.executable, "-m", "jaxdecode.cli", "serve", "--model", model,
                     "--port", str(self.port), "--max-slots", str(max_slots),
                     "--max-len", str(max_len), "--warmup", "--log-level", "warning",
                     *(["--api-key", api_key] if api_key else []), *extra_args]
        self.log = tempfile.NamedTemporaryFile("w+b", prefix="jaxdecode-serve-", suffix=".log")
        self.proc: Optional[subprocess.Popen] = None

    @property
    def pid(self) -> int:
        assert self.proc is not None, "the server is not started"
        return self.proc.pid

    def log_tail(self, chars: int = 3000) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read().decode("utf-8", "replace")[-chars:]

    def start(self, timeout_s: float) -> "ServerProcess":
        import httpx

        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            p for p in (root, os.environ.get("PYTHONPATH")) if p))
        self.proc = subprocess.Popen(self.argv, stdout=self.log, stderr=subprocess.STDOUT,
                                     env=env)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with status {self.proc.returncode}:\n"
                                   f"{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        tail = self.log_tail()
        self.stop()
        raise RuntimeError(f"--startup-timeout: the server was not healthy after {timeout_s:g} s:"
                           f"\n{tail}")

    def stop(self, timeout_s: float = 20.0) -> Optional[int]:
        """SIGINT (uvicorn's graceful shutdown), then SIGKILL; returns the exit status."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode if self.proc is not None else None

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def scrape_metrics(url: str, api_key: Optional[str] = None) -> dict[str, float]:
    """Unlabelled samples of the server's /metrics (e.g. jaxdecode_requests_running)."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    r = httpx.get(url + "/metrics", headers=headers, timeout=10)
    r.raise_for_status()
    out = {}
    for line in r.text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, _, value = line.partition(" ")
            out[name] = float(value)
    return out


# -- the client -----------------------------------------------------------------------------------

def request_body(i: int, cfg: LoadConfig) -> dict:
    """Request i of a level: prompt i mod len(PROMPTS), seed cfg.seed + i."""
    prompt = PROMPTS[i % len(PROMPTS)]
    body: dict[str, Any] = {"max_tokens": cfg.max_tokens, "temperature": cfg.temperature,
                            "seed": cfg.seed + i, "stream": True,
                            "stream_options": {"include_usage": True},
                            "ignore_eos": cfg.ignore_eos}
    if cfg.chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


async def stream_one(client: Any, body: dict, chat: bool) -> RequestResult:
    """Send one streaming request and read it to the end."""
    import httpx

    result = RequestResult()
    path = "/v1/chat/completions" if chat else "/v1/completions"
    parser = SSEParser()
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", path, json=body) as response:
            result.status = response.status_code
            if response.status_code != 200:
                await response.aread()
                return result
            async for line in response.aiter_lines():
                data = parser.feed(line)
                if data is not None:
                    apply_event(result, data, time.perf_counter() - t0)
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as e:
        result.error = type(e).__name__
    return result


async def run_level(url: str, cfg: LoadConfig, requests: int,
                    concurrency: int) -> tuple[list[RequestResult], float]:
    """`requests` streaming requests (bodies `request_body(0..requests-1)`), at most
    `concurrency` in flight; (results, wall seconds)."""
    import httpx

    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    results: list[Optional[RequestResult]] = [None] * requests
    pending = iter(range(requests))

    async with httpx.AsyncClient(base_url=url, headers=headers, limits=limits,
                                 timeout=httpx.Timeout(cfg.timeout_s)) as client:
        async def worker() -> None:
            for i in pending:  # a shared iterator: each index goes to exactly one worker
                results[i] = await stream_one(client, request_body(i, cfg), cfg.chat)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(min(concurrency, requests))))
        wall = time.perf_counter() - t0
    return [r for r in results if r is not None], wall


def run(url: str, cfg: LoadConfig, server_pid: Optional[int] = None,
        progress=None) -> dict:
    """Warm up, then every concurrency level in turn; the report (see `format_table`)."""
    if cfg.warmup_requests:
        warm, _ = asyncio.run(run_level(url, cfg, cfg.warmup_requests,
                                        min(cfg.warmup_requests, max(cfg.concurrency))))
        failed = [r.failure() for r in warm if not r.ok]
        if failed:
            raise RuntimeError(f"{len(failed)} warm-up requests failed (first: {failed[0]}); "
                               "is it a jaxdecode server, and is --api-key right?")
    before = scrape_metrics(url, cfg.api_key)
    report: dict[str, Any] = {
        "url": url, "config": {**dataclasses.asdict(cfg), "api_key": cfg.api_key is not None},
        "rss_mb_before": rss_mb(server_pid) if server_pid else None, "levels": []}
    for c in cfg.concurrency:
        results, wall = asyncio.run(run_level(url, cfg, cfg.requests, c))
        row = summarize(results, c, wall)
        row["rss_mb_after"] = rss_mb(server_pid) if server_pid else None
        report["levels"].append(row)
        if progress is not None:
            progress(row)
    # the engine frees a slot just after the request's last event: allow it a moment
    deadline = time.monotonic() + 2.0
    after = scrape_metrics(url, cfg.api_key)
    while after.get("jaxdecode_requests_running") and time.monotonic() < deadline:
        time.sleep(0.05)
        after = scrape_metrics(url, cfg.api_key)
    report["requests_running_at_end"] = after.get("jaxdecode_requests_running")
    compiles = "jaxdecode_compilations_total"
    report["compilations_during_run"] = (after[compiles] - before[compiles]
                                         if compiles in after and compiles in before else None)
    return report


# -- output ---------------------------------------------------------------------------------------

_COLUMNS = ("concurrency", "requests", "errors", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms",
            "ITL p99 ms", "tok/chunk", "output tok/s", "RSS MiB after")


def _ms(v: Optional[float]) -> str:
    return "-" if v is None else f"{v * 1e3:.1f}"


def _cells(row: dict) -> list[str]:
    return [str(row["concurrency"]), str(row["requests"]), str(row["errors"]),
            _ms(row["ttft_s"]["p50"]), _ms(row["ttft_s"]["p99"]),
            _ms(row["inter_chunk_s"]["p50"]), _ms(row["inter_chunk_s"]["p99"]),
            "-" if row["tokens_per_chunk"] is None else f"{row['tokens_per_chunk']:.2f}",
            _number(row["output_tokens_per_s"]), _number(row.get("rss_mb_after"))]


def _number(v: Optional[float], unit: str = "") -> str:
    return "-" if v is None else f"{v:.0f}{unit}"


def _footer(report: dict) -> str:
    return (f"server RSS after warm-up: {_number(report.get('rss_mb_before'), ' MiB')}; "
            f"requests running at the end: {_number(report['requests_running_at_end'])}; "
            f"compilations during the run: {_number(report['compilations_during_run'])}. "
            "ITL = gap between successive chunks with text (tok/chunk tokens each).")


def format_table(report: dict) -> str:
    """A plain-text table of the levels, then the memory and metrics line."""
    rows = [list(_COLUMNS)] + [_cells(r) for r in report["levels"]]
    widths = [max(len(r[i]) for r in rows) for i in range(len(_COLUMNS))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(lines + [_footer(report)])


def markdown_table(report: dict) -> str:
    """The same table in Markdown (for reports such as `bench --report`'s report.md)."""
    lines = ["| " + " | ".join(_COLUMNS) + " |", "|" + "---:|" * len(_COLUMNS)]
    lines += ["| " + " | ".join(_cells(r)) + " |" for r in report["levels"]]
    return "\n".join(lines + ["", _footer(report)])


# -- command line ---------------------------------------------------------------------------------

def add_arguments(p: Any) -> None:
    """The load test's flags except --model and --json, which `jaxdecode bench` already has
    (`p`: a parser or an argument group)."""
    p.add_argument("--url", default=None,
                   help="test a running server at this URL instead of starting one")
    p.add_argument("--server-pid", type=int, default=None,
                   help="with --url: the server's pid, to read its memory (VmRSS)")
    p.add_argument("--requests", type=int, default=200, help="requests per concurrency level")
    p.add_argument("--concurrency", type=int, action="append",
                   help="requests in flight (repeatable; default 8, 32, 64)")
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per request")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="generate exactly --max-tokens per request (default: yes)")
    p.add_argument("--chat", action="store_true", help="use /v1/chat/completions")
    p.add_argument("--seed", type=int, default=0, help="request i uses seed SEED + i")
    p.add_argument("--warmup-requests", type=int, default=4, help="sent first, not counted")
    p.add_argument("--request-timeout", type=float, default=300.0, help="seconds per request")
    p.add_argument("--api-key", default=None, help="Bearer key for the server")
    p.add_argument("--max-slots", type=int, default=None,
                   help="the started server's --max-slots (default 8)")
    p.add_argument("--max-len", type=int, default=None,
                   help="the started server's --max-len (default 512)")
    p.add_argument("--startup-timeout", type=float, default=None,
                   help="seconds to wait for the started server's /health (default 600)")


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
        for flag in ("model", "max_slots", "max_len", "startup_timeout"):
            if getattr(args, flag) not in (None, "demo"):
                raise SystemExit(f"--{flag.replace('_', '-')}: configures the started server; "
                                 "with --url the server is already running")
    try:
        cfg = LoadConfig(requests=args.requests, concurrency=tuple(args.concurrency or (8, 32, 64)),
                         max_tokens=args.max_tokens, temperature=args.temperature,
                         ignore_eos=args.ignore_eos, chat=args.chat, seed=args.seed,
                         warmup_requests=args.warmup_requests, timeout_s=args.request_timeout,
                         api_key=args.api_key)
    except ValueError as e:
        raise SystemExit(f"--{str(e).split(':')[0].replace('_', '-')}: {e}")
    progress = lambda row: print(json.dumps(row), file=sys.stderr)  # noqa: E731
    try:
        if args.url is not None:
            report = run(args.url.rstrip("/"), cfg, args.server_pid, progress)
        else:
            with ServerProcess(args.model or "demo", args.max_slots or 8, args.max_len or 512,
                               args.api_key) as server:
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
    return 0 if failed == 0 and report["requests_running_at_end"] == 0 else 1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m serving.loadtest",
                                description=__doc__.split("\n")[0])
    p.add_argument("--model", default="demo",
                   help="the started server's model: a local HF checkpoint directory, or 'demo'")
    p.add_argument("--json", help="write the report as JSON")
    add_arguments(p)
    return p


if __name__ == "__main__":
    sys.exit(main(build_parser().parse_args()))
