"""An HTTP load test of OpenAI-compatible servers with the metrics of `vllm bench serve`.

Streaming requests at several concurrency levels (issue #6):

    python -m serving.loadtest [--model demo] [--max-slots 8] [--max-len 512]
                               [--workload snippets|random|prefix-repetition|sharegpt]
                               [--requests 200] [--concurrency 8 --concurrency 32 ...]
                               [--request-rate inf] [--max-tokens 64]
                               [--url URL [--server-pid PID] [--served-model-name NAME]]
                               [--server-arg=--no-prefix-cache ...] [--json FILE]
    jaxdecode bench --serve ...            (the same flags)

Without `--url` it starts the server (`python -m serving --warmup N`, N the longest prompt of a
token-id workload, the flags of `jaxdecode serve`, plus every `--server-arg`) as a subprocess on
a free loopback port, waits for /health, sends a few warm-up requests that are not counted, and
stops the server at the end. With `--url` it tests any OpenAI-compatible server (vLLM
included): it sends only fields vLLM accepts too, puts `--served-model-name` in the body's
`model` field when given, and reads /metrics only when the server has one.

Workloads (every one deterministic given `--seed`; docs/serving.md "Load test"):

- `snippets` (default): one of 16 short Python snippets as a text prompt, `--max-tokens` out;
- `random`: `--input-len` token ids drawn uniformly from [`--token-min`, `--token-max`),
  `--output-len` (= `--max-tokens`) out;
- `prefix-repetition`: `--num-prefixes` shared prefixes of `--prefix-len` random tokens, each
  request one of them plus its own `--suffix-len` random tokens (vLLM's prefix_repetition);
- `sharegpt`: ShareGPT-like input and output lengths from two lognormals generated locally
  (`SHAREGPT_INPUT` and `SHAREGPT_OUTPUT`), prompts of random token ids.

Arrivals: `--request-rate R` requests/s, gaps drawn from a gamma distribution of shape
`--burstiness` (1: a Poisson process; `inf`, the default, sends every request at once), and
at most C in flight for each level C of `--concurrency` / `--max-concurrency`.

Metrics per level (client side, like `vllm bench serve`): completed and failed requests,
duration, request, output-token and total-token (input + output) throughput, and mean /
median / p99 (std in the JSON) of

- TTFT: request sent -> first chunk with non-empty text;
- TPOT: (E2EL - TTFT) / (output tokens - 1) per request with more than one output token;
- ITL: the gaps between successive chunks with text. A chunk is one server delta: usually one
  token but it may carry several, so these are per chunk; `tokens_per_chunk` reports the ratio;
- E2EL: request sent -> `[DONE]`.

Token counts are the usage chunk's (`stream_options.include_usage`): `completion_tokens`,
`prompt_tokens` and `prompt_tokens_details.cached_tokens` (summed, when the server reports it).
Errors: HTTP status != 200, an error event, no usage chunk, no `[DONE]`, or an exception.

Server memory is the server process's resident set (VmRSS of /proc/<pid>/status; with `--url`
only when `--server-pid` is given) after warm-up and after each level. When /metrics answers,
it gives the compilations during the run, the requests running at the end (which must be 0) and
the prefix-cache hits per level (jaxdecode's or vLLM's counters).
Module imports are the standard library only, so the CLI can add these flags cheaply; numpy and
httpx (the dev extra) are imported when a test runs.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any, Iterable, Optional, Sequence, Union

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

WORKLOADS = ("snippets", "random", "prefix-repetition", "sharegpt")

# The ShareGPT-like length mix: lognormal (median, sigma) of input and output tokens. With the
# clipping of `sharegpt_lengths` (input to [4, 1024], input + output to 2048) the means are
# about 218 input and 192 output tokens per request, near what `vllm bench serve` and SGLang
# print for ShareGPT with a Llama tokenizer (e.g. 229711 input and 203068 generated tokens for
# 1000 prompts, vllm-project/vllm#18566). The shapes are an assumption, not a fit to the data.
SHAREGPT_INPUT = (135.0, 1.05)
SHAREGPT_OUTPUT = (140.0, 0.8)
SHAREGPT_MIN_LEN = 4
SHAREGPT_MAX_TOTAL = 2048  # vLLM's ShareGPT filter: prompt + output <= 2048


@dataclasses.dataclass(frozen=True)
class LoadConfig:
    requests: int = 200
    concurrency: tuple[int, ...] = (8, 32, 64)
    max_tokens: int = 64                      # output tokens (snippets, random, prefix-rep.)
    temperature: Optional[float] = None       # None: 0.8 for snippets, 0 (greedy) otherwise
    ignore_eos: bool = True
    chat: bool = False
    seed: int = 0
    warmup_requests: int = 4
    timeout_s: float = 300.0
    api_key: Optional[str] = None
    model_name: Optional[str] = None          # the body's `model` field (vLLM needs it)
    workload: str = "snippets"
    input_len: int = 128                      # random
    token_min: int = 10                       # token ids of generated prompts: [min, max)
    token_max: int = 4000
    num_prefixes: int = 10                    # prefix-repetition
    prefix_len: int = 256
    suffix_len: int = 64
    max_input_len: int = 1024                 # sharegpt: input lengths clipped to [4, this]
    max_total_len: Optional[int] = None       # sharegpt: input + output at most this (None:
                                              # min(2048, the server's max_model_len))
    sharegpt_output_len: Optional[int] = None  # sharegpt: a fixed output length instead
    request_rate: float = math.inf            # requests/s; inf: all at once
    burstiness: float = 1.0                   # gamma shape of the gaps; 1: Poisson

    def __post_init__(self) -> None:
        if self.requests < 1:
            raise ValueError("requests: must be >= 1")
        if not self.concurrency or min(self.concurrency) < 1:
            raise ValueError("concurrency: every level must be >= 1")
        if self.max_tokens < 1:
            raise ValueError("max_tokens: must be >= 1")
        if self.warmup_requests < 0:
            raise ValueError("warmup_requests: must be >= 0")
        if self.seed < 0:
            raise ValueError("seed: must be >= 0 (request i uses seed + i)")
        if self.workload not in WORKLOADS:
            raise ValueError(f"workload: one of {', '.join(WORKLOADS)}")
        if self.chat and self.workload != "snippets":
            raise ValueError("chat: only with --workload snippets (the others send token ids)")
        for name in ("input_len", "num_prefixes", "prefix_len", "suffix_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1")
        if not 0 <= self.token_min < self.token_max:
            raise ValueError("token_min: must be >= 0 and below --token-max")
        if self.max_input_len < SHAREGPT_MIN_LEN:
            raise ValueError(f"max_input_len: must be >= {SHAREGPT_MIN_LEN}")
        if self.max_total_len is not None and self.max_total_len < 2 * SHAREGPT_MIN_LEN:
            raise ValueError(f"max_total_len: must be >= {2 * SHAREGPT_MIN_LEN}")
        if self.sharegpt_output_len is not None and self.sharegpt_output_len < 1:
            raise ValueError("sharegpt_output_len: must be >= 1")
        if not self.request_rate > 0:
            raise ValueError("request_rate: must be > 0 (inf: all at once)")
        if not (self.burstiness > 0 and math.isfinite(self.burstiness)):
            raise ValueError("burstiness: must be > 0")

    @property
    def sampling_temperature(self) -> float:
        if self.temperature is not None:
            return self.temperature
        return 0.8 if self.workload == "snippets" else 0.0


@dataclasses.dataclass
class RequestResult:
    """One streaming request as the client saw it (times in seconds from sending it)."""
    status: int = 0
    error: Optional[str] = None
    chunk_times: list[float] = dataclasses.field(default_factory=list)  # chunks with text
    completion_tokens: Optional[int] = None
    done: bool = False
    prompt_tokens: Optional[int] = None   # the usage chunk's (else the client's count)
    cached_tokens: Optional[int] = None   # usage.prompt_tokens_details.cached_tokens
    end_s: Optional[float] = None         # when [DONE] arrived

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

    @property
    def e2el_s(self) -> Optional[float]:
        """End-to-end latency: sent -> [DONE] (the last chunk with text when not recorded)."""
        if self.end_s is not None:
            return self.end_s
        return self.chunk_times[-1] if self.chunk_times else None

    @property
    def tpot_s(self) -> Optional[float]:
        """Time per output token after the first (vLLM's TPOT); None with <= 1 output token."""
        if (self.completion_tokens is None or self.completion_tokens < 2
                or self.ttft_s is None or self.e2el_s is None):
            return None
        return (self.e2el_s - self.ttft_s) / (self.completion_tokens - 1)

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
        return (choice["delta"] or {}).get("content") or ""
    return choice.get("text") or ""


def apply_event(result: RequestResult, data: str, elapsed_s: float) -> None:
    """Update `result` with one SSE event's data received `elapsed_s` after sending."""
    if data == "[DONE]":
        result.done = True
        result.end_s = elapsed_s
        return
    chunk = json.loads(data)
    if "error" in chunk:
        err = chunk["error"]
        result.error = "stream error: " + str(err.get("code") if isinstance(err, dict) else err)
        return
    usage = chunk.get("usage")
    if usage:
        result.completion_tokens = usage["completion_tokens"]
        if usage.get("prompt_tokens") is not None:
            result.prompt_tokens = usage["prompt_tokens"]
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and details.get("cached_tokens") is not None:
            result.cached_tokens = details["cached_tokens"]
    if chunk_text(chunk):
        result.chunk_times.append(elapsed_s)


def percentiles(values: Sequence[float], qs: Sequence[int] = (50, 99)) -> dict:
    """{"p50": ..., "p99": ...} (numpy's linear interpolation); None values when empty."""
    import numpy as np

    if len(values) == 0:
        return {f"p{q}": None for q in qs}
    got = np.percentile(np.asarray(values, dtype=np.float64), qs)
    return {f"p{q}": float(v) for q, v in zip(qs, got)}


def stats_ms(values_s: Sequence[float]) -> dict:
    """vLLM's statistics of a latency in milliseconds: {"mean", "median", "std", "p99"}
    (numpy's mean, median, population std and linear-interpolation p99); None when empty."""
    import numpy as np

    if len(values_s) == 0:
        return {"mean": None, "median": None, "std": None, "p99": None}
    ms = np.asarray(values_s, dtype=np.float64) * 1e3
    return {"mean": float(ms.mean()), "median": float(np.median(ms)), "std": float(ms.std()),
            "p99": float(np.percentile(ms, 99))}


def summarize(results: Sequence[RequestResult], concurrency: int, wall_s: float,
              request_rate: float = math.inf) -> dict:
    """One level's row: counts, token totals, throughput, and latency statistics -- vLLM's
    (`ttft_ms`, `tpot_ms`, `itl_ms`, `e2el_ms`: mean / median / std / p99 in ms) and the
    earlier percentiles in seconds (`ttft_s`, `inter_chunk_s`: p50 / p99)."""
    ok = [r for r in results if r.ok]
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.failure()] = errors.get(r.failure(), 0) + 1
    tokens = sum(r.completion_tokens for r in ok)
    inputs = sum(r.prompt_tokens or 0 for r in ok)
    cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    chunks = sum(len(r.chunk_times) for r in ok)
    gaps = [g for r in ok for g in r.gaps_s]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    per_s = (lambda v: v / wall_s) if wall_s > 0 else (lambda v: None)
    return {"concurrency": concurrency,
            "request_rate": None if math.isinf(request_rate) else request_rate,
            "requests": len(results), "completed": len(ok), "errors": len(results) - len(ok),
            "error_kinds": errors, "wall_s": wall_s, "input_tokens": inputs,
            "output_tokens": tokens, "cached_tokens": sum(cached) if cached else None,
            "requests_per_s": per_s(len(ok)), "output_tokens_per_s": per_s(tokens),
            "total_tokens_per_s": per_s(inputs + tokens),
            "ttft_ms": stats_ms(ttfts),
            "tpot_ms": stats_ms([r.tpot_s for r in ok if r.tpot_s is not None]),
            "itl_ms": stats_ms(gaps),
            "e2el_ms": stats_ms([r.e2el_s for r in ok if r.e2el_s is not None]),
            "ttft_s": percentiles(ttfts), "inter_chunk_s": percentiles(gaps),
            "tokens_per_chunk": tokens / chunks if chunks else None}


# -- workloads and arrivals -----------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class WorkItem:
    """One request's prompt (text, or token ids) and output length."""
    prompt: Union[str, list[int]]
    max_tokens: int

    @property
    def prompt_len(self) -> Optional[int]:
        return len(self.prompt) if isinstance(self.prompt, list) else None


def _rng(seed: int, stream: int, purpose: int):
    """A numpy Generator for (seed, stream, purpose): stream 0, 1, ... are the levels and -1 the
    warm-up; purpose 0 is the prompts, 1 the arrivals."""
    import numpy as np

    return np.random.default_rng([seed, stream + 1, purpose])


def _tokens(rng, cfg: LoadConfig, shape) -> Any:
    return rng.integers(cfg.token_min, cfg.token_max, size=shape)


def _distinct_rows(rng, cfg: LoadConfig, n: int, length: int) -> list[list[int]]:
    """n rows of random token ids, redrawn until no two are equal (when that is possible)."""
    rows = _tokens(rng, cfg, (n, length)).tolist()
    if (cfg.token_max - cfg.token_min) ** length < n:
        return rows
    seen: dict[tuple, int] = {}
    for i in range(n):
        while tuple(rows[i]) in seen:
            rows[i] = _tokens(rng, cfg, length).tolist()
        seen[tuple(rows[i])] = i
    return rows


def sharegpt_lengths(n: int, rng, max_input_len: int = 1024, max_total_len: int = 2048,
                     output_len: Optional[int] = None) -> list[tuple[int, int]]:
    """n (input, output) lengths: lognormal `SHAREGPT_INPUT` / `SHAREGPT_OUTPUT` rounded; input
    clipped to [4, min(max_input_len, max_total_len - 4)]; output at least 4 (or the fixed
    `output_len`) and at most max_total_len - input."""
    import numpy as np

    lo = SHAREGPT_MIN_LEN
    (mi, si), (mo, so) = SHAREGPT_INPUT, SHAREGPT_OUTPUT
    ins = np.rint(rng.lognormal(np.log(mi), si, n))
    outs = np.rint(rng.lognormal(np.log(mo), so, n))
    ins = np.clip(ins, lo, max(lo, min(max_input_len, max_total_len - lo))).astype(int)
    outs = np.full(n, output_len) if output_len is not None else np.maximum(outs, lo)
    outs = np.maximum(np.minimum(outs, max_total_len - ins), 1).astype(int)
    return [(int(a), int(b)) for a, b in zip(ins, outs)]


def make_workload(cfg: LoadConfig, n: int, stream: int = 0) -> list[WorkItem]:
    """The n requests of one level (`stream` 0, 1, ...; -1: the warm-up), deterministic given
    cfg.seed: each level draws its own token ids, so a level does not hit the prefix cache with
    an earlier level's prompts (the prefix-repetition prefixes are per level too)."""
    w = cfg.workload
    if w == "snippets":
        return [WorkItem(PROMPTS[i % len(PROMPTS)], cfg.max_tokens) for i in range(n)]
    rng = _rng(cfg.seed, stream, 0)
    if w == "random":
        rows = _tokens(rng, cfg, (n, cfg.input_len)).tolist()
        return [WorkItem(p, cfg.max_tokens) for p in rows]
    if w == "prefix-repetition":
        prefixes = _distinct_rows(rng, cfg, cfg.num_prefixes, cfg.prefix_len)
        suffixes = _distinct_rows(rng, cfg, n, cfg.suffix_len)
        which = rng.permutation(n) % cfg.num_prefixes  # each prefix n / N times, shuffled
        return [WorkItem(prefixes[k] + suffixes[i], cfg.max_tokens)
                for i, k in enumerate(which.tolist())]
    assert w == "sharegpt", w
    lengths = sharegpt_lengths(n, rng, cfg.max_input_len,
                               cfg.max_total_len or SHAREGPT_MAX_TOTAL, cfg.sharegpt_output_len)
    return [WorkItem(_tokens(rng, cfg, a).tolist(), b) for a, b in lengths]


def arrival_offsets(n: int, rate: float, burstiness: float = 1.0, seed: int = 0,
                    stream: int = 0) -> list[float]:
    """When each of n requests arrives, in seconds from the level's start: the first at 0, then
    gaps from a gamma distribution of shape `burstiness` and mean 1 / rate (shape 1: a Poisson
    process, exponential gaps; vLLM's `--burstiness`); every request at 0 when rate is inf."""
    import numpy as np

    if math.isinf(rate) or n <= 1:
        return [0.0] * n
    gaps = _rng(seed, stream, 1).gamma(burstiness, 1.0 / (rate * burstiness), n - 1)
    return [0.0] + np.cumsum(gaps).tolist()


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


def warmup_tokens(cfg: LoadConfig) -> Optional[int]:
    """The started server's `--warmup N`: the longest prompt a token-id workload can send, so
    its prefill programs compile before the run; None (the flag's own default) for the text
    snippets."""
    return {"random": cfg.input_len,
            "prefix-repetition": cfg.prefix_len + cfg.suffix_len,
            "sharegpt": min(cfg.max_input_len,
                            (cfg.max_total_len or SHAREGPT_MAX_TOTAL) - SHAREGPT_MIN_LEN),
            }.get(cfg.workload)


class ServerProcess:
    """`python -m serving --warmup N` (the flags of `jaxdecode serve`) in a subprocess on a free
    loopback port; its output goes to a temporary log file that `start` quotes when the server
    dies or never becomes healthy."""

    def __init__(self, model: str = "demo", max_slots: int = 8, max_len: int = 512,
                 api_key: Optional[str] = None, extra_args: Sequence[str] = (),
                 warmup: Optional[int] = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.argv = [sys.executable, "-m", "serving", "--model", model,
                     "--port", str(self.port), "--max-slots", str(max_slots),
                     "--max-len", str(max_len), "--warmup",
                     *([] if warmup is None else [str(warmup)]), "--log-level", "warning",
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
    """The server's /metrics as {name: value}, labelled samples of one name summed (e.g.
    jaxdecode_requests_running, vllm:num_requests_running); raises on an HTTP error."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    r = httpx.get(url + "/metrics", headers=headers, timeout=10)
    r.raise_for_status()
    return parse_metrics(r.text)


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text format -> {name: sum of its samples}; lines that do not parse are
    skipped (a server may put anything at /metrics)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if "{" in line:
            name, rest = line[:line.index("{")], line[line.rfind("}") + 1:].split()
        else:
            name, *rest = line.split()
        try:
            value = float(rest[0])
        except (IndexError, ValueError):
            continue
        out[name] = out.get(name, 0.0) + value
    return out


def try_scrape(url: str, api_key: Optional[str] = None) -> dict[str, float]:
    """`scrape_metrics`, or {} when the server has no usable /metrics (not jaxdecode, say)."""
    import httpx

    try:
        return scrape_metrics(url, api_key)
    except (httpx.HTTPError, OSError):
        return {}


# (hits, queries) counters in prompt tokens: jaxdecode's, then vLLM V1's
_PREFIX_CACHE = (("jaxdecode_prefix_cache_hits_total", "jaxdecode_prefix_cache_queries_total"),
                 ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"))
_RUNNING = ("jaxdecode_requests_running", "vllm:num_requests_running")


def prefix_cache_delta(before: dict, after: dict) -> Optional[dict]:
    """Prefix-cache hits between two scrapes: {"hits", "queries", "hit_rate"} in prompt
    tokens, or None when the server has no such counters."""
    for hits, queries in _PREFIX_CACHE:
        if all(k in before and k in after for k in (hits, queries)):
            h, q = after[hits] - before[hits], after[queries] - before[queries]
            return {"hits": h, "queries": q, "hit_rate": h / q if q > 0 else None}
    return None


def requests_running(metrics: dict) -> Optional[float]:
    return next((metrics[k] for k in _RUNNING if k in metrics), None)


def server_max_model_len(url: str, cfg: LoadConfig) -> Optional[int]:
    """`max_model_len` of the served model from /v1/models (jaxdecode and vLLM have it), or
    None."""
    import httpx

    try:
        r = httpx.get(url + "/v1/models", headers=_headers(cfg), timeout=10)
        r.raise_for_status()
        models = r.json().get("data") or []
        card = next((m for m in models if m.get("id") == cfg.model_name), models[0])
        value = card.get("max_model_len")
        return int(value) if value else None
    except (httpx.HTTPError, ValueError, TypeError, AttributeError, IndexError):
        return None


# -- the client -----------------------------------------------------------------------------------

def _headers(cfg: LoadConfig) -> dict:
    return {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}


def request_body(i: int, cfg: LoadConfig, item: Optional[WorkItem] = None) -> dict:
    """Request i of a level: `item`'s prompt and output length (default: snippet i mod
    len(PROMPTS) and cfg.max_tokens), seed cfg.seed + i; only fields vLLM accepts too, and
    `model` only when cfg.model_name is set."""
    if item is None:
        item = WorkItem(PROMPTS[i % len(PROMPTS)], cfg.max_tokens)
    body: dict[str, Any] = {"max_tokens": item.max_tokens,
                            "temperature": cfg.sampling_temperature,
                            "seed": cfg.seed + i, "stream": True,
                            "stream_options": {"include_usage": True},
                            "ignore_eos": cfg.ignore_eos}
    if cfg.model_name:
        body["model"] = cfg.model_name
    if cfg.chat:
        body["messages"] = [{"role": "user", "content": item.prompt}]
    else:
        body["prompt"] = item.prompt
    return body


async def stream_one(client: Any, body: dict, chat: bool) -> RequestResult:
    """Send one streaming request and read it to the end (times from sending it)."""
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
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
        result.error = type(e).__name__
    return result


async def run_level(url: str, cfg: LoadConfig, items: Sequence[WorkItem], concurrency: int,
                    offsets: Optional[Sequence[float]] = None
                    ) -> tuple[list[RequestResult], float]:
    """Request i (`request_body(i, cfg, items[i])`) arrives `offsets[i]` seconds after the
    start (default: all at once) and waits until fewer than `concurrency` are in flight (its
    times start when it is sent, as in `vllm bench serve`); (results, wall seconds)."""
    import httpx

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    results: list[Optional[RequestResult]] = [None] * len(items)
    slots = asyncio.Semaphore(concurrency)  # waiters get a slot first come, first served

    async with httpx.AsyncClient(base_url=url, headers=_headers(cfg), limits=limits,
                                 timeout=httpx.Timeout(cfg.timeout_s)) as client:
        async def one(i: int) -> None:
            if offsets is not None:
                delay = t0 + offsets[i] - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
            async with slots:
                r = await stream_one(client, request_body(i, cfg, items[i]), cfg.chat)
            if r.prompt_tokens is None:  # a server without usage.prompt_tokens
                r.prompt_tokens = items[i].prompt_len
            results[i] = r

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(len(items))))
        wall = time.perf_counter() - t0
    return [r for r in results if r is not None], wall


def run(url: str, cfg: LoadConfig, server_pid: Optional[int] = None,
        progress=None) -> dict:
    """Warm up, then every concurrency level in turn; the report (see `format_table`)."""
    if cfg.workload == "sharegpt" and cfg.max_total_len is None:
        served = server_max_model_len(url, cfg)
        cfg = dataclasses.replace(cfg, max_total_len=min(SHAREGPT_MAX_TOTAL, served or
                                                         SHAREGPT_MAX_TOTAL))
    if cfg.warmup_requests:
        warm, _ = asyncio.run(run_level(url, cfg, make_workload(cfg, cfg.warmup_requests, -1),
                                        min(cfg.warmup_requests, max(cfg.concurrency))))
        failed = [r.failure() for r in warm if not r.ok]
        if failed:
            raise RuntimeError(f"{len(failed)} warm-up requests failed (first: {failed[0]}); "
                               "is it an OpenAI-compatible server, is --api-key right, and "
                               "does it need --served-model-name?")
    before = try_scrape(url, cfg.api_key)
    report: dict[str, Any] = {
        "url": url, "config": {**dataclasses.asdict(cfg), "api_key": cfg.api_key is not None,
                               "temperature": cfg.sampling_temperature},
        "metrics_available": bool(before),
        "rss_mb_before": rss_mb(server_pid) if server_pid else None, "levels": []}
    for level, c in enumerate(cfg.concurrency):
        items = make_workload(cfg, cfg.requests, level)
        offsets = arrival_offsets(cfg.requests, cfg.request_rate, cfg.burstiness, cfg.seed,
                                  level)
        m0 = try_scrape(url, cfg.api_key) if before else {}
        results, wall = asyncio.run(run_level(url, cfg, items, c, offsets))
        row = summarize(results, c, wall, cfg.request_rate)
        row["prefix_cache"] = prefix_cache_delta(m0, try_scrape(url, cfg.api_key)) \
            if before else None
        row["rss_mb_after"] = rss_mb(server_pid) if server_pid else None
        report["levels"].append(row)
        if progress is not None:
            progress(row)
    # the engine frees a slot just after the request's last event: allow it a moment
    deadline = time.monotonic() + 2.0
    after = try_scrape(url, cfg.api_key)
    while requests_running(after) and time.monotonic() < deadline:
        time.sleep(0.05)
        after = try_scrape(url, cfg.api_key)
    report["requests_running_at_end"] = requests_running(after)
    compiles = "jaxdecode_compilations_total"
    report["compilations_during_run"] = (after[compiles] - before[compiles]
                                         if compiles in after and compiles in before else None)
    report["prefix_cache"] = prefix_cache_delta(before, after)
    return report


# -- output ---------------------------------------------------------------------------------------

_LATENCIES = (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"), ("E2EL", "e2el_ms"))
_COLUMNS = ("concurrency", "rate/s", "completed", "failed", "duration s", "req/s",
            "output tok/s", "total tok/s",
            *(f"{name} ms mean/median/p99" for name, _ in _LATENCIES),
            "tok/chunk", "cached tok", "RSS MiB after")


def _fixed(v: Optional[float], digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _number(v: Optional[float], unit: str = "") -> str:
    return "-" if v is None else f"{v:.0f}{unit}"


def _latency(stats: dict) -> str:
    return "/".join(_fixed(stats[k]) for k in ("mean", "median", "p99"))


def _cells(row: dict) -> list[str]:
    return [str(row["concurrency"]),
            "inf" if row.get("request_rate") is None else f"{row['request_rate']:g}",
            str(row["completed"]), str(row["errors"]), _fixed(row["wall_s"]),
            _fixed(row["requests_per_s"]), _fixed(row["output_tokens_per_s"]),
            _fixed(row["total_tokens_per_s"]),
            *(_latency(row[key]) for _, key in _LATENCIES),
            _fixed(row["tokens_per_chunk"]), _number(row.get("cached_tokens")),
            _number(row.get("rss_mb_after"))]


def _footer(report: dict) -> str:
    pc = report.get("prefix_cache")
    cache = ("-" if pc is None else
             f"{pc['hits']:.0f} of {pc['queries']:.0f} prompt tokens"
             + ("" if pc["hit_rate"] is None else f" ({pc['hit_rate'] * 100:.1f}%)"))
    return (f"server RSS after warm-up: {_number(report.get('rss_mb_before'), ' MiB')}; "
            f"requests running at the end: {_number(report.get('requests_running_at_end'))}; "
            f"compilations during the run: {_number(report.get('compilations_during_run'))}; "
            f"prefix-cache hits (server metrics): {cache}. "
            "Latencies in ms from the client, mean/median/p99; TPOT = (E2EL - TTFT) / "
            "(output tokens - 1); ITL = gap between successive chunks with text (tok/chunk "
            "tokens each).")


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
    d = LoadConfig()
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
    p = argparse.ArgumentParser(prog="python -m serving.loadtest",
                                description=__doc__.split("\n")[0])
    p.add_argument("--model", default="demo",
                   help="the started server's model: a local HF checkpoint directory, or 'demo'")
    p.add_argument("--json", help="write the report as JSON")
    add_arguments(p)
    return p


if __name__ == "__main__":
    sys.exit(main(build_parser().parse_args()))
