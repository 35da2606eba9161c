"""The server side of a run: a started `python -m serving` subprocess (`ServerProcess`), its
memory (VmRSS) and its /metrics and /v1/models as the client reads them.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

from jaxdecode.cli.bench.loadtest.config import (SHAREGPT_MAX_TOTAL, SHAREGPT_MIN_LEN, LoadConfig,
                                                 auth_headers)

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

        root = str(Path(__file__).resolve().parents[4])  # the checkout holding `serving`
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
        r = httpx.get(url + "/v1/models", headers=auth_headers(cfg), timeout=10)
        r.raise_for_status()
        models = r.json().get("data") or []
        card = next((m for m in models if m.get("id") == cfg.model_name), models[0])
        value = card.get("max_model_len")
        return int(value) if value else None
    except (httpx.HTTPError, ValueError, TypeError, AttributeError, IndexError):
        return None
