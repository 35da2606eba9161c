"""A real `jaxdecode serve --model demo` process for tests: started on a free loopback port,
waited for through /health, stopped with SIGINT, and required to exit 0."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]


def require_demo_weights() -> None:
    if not (ROOT / "models" / "demo" / "main.safetensors").exists():
        pytest.skip("demo weights are not present")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serve(log: Path, *flags: str, wait: bool = True) -> Iterator[tuple[subprocess.Popen, str]]:
    """(process, base url) of `jaxdecode serve --model demo --port P *flags`, its output in
    `log`; with `wait`, only once /health answers. SIGINT at the end; it must exit 0."""
    require_demo_weights()
    port = free_port()
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "jaxdecode.cli", "serve", "--model", "demo", "--port",
             str(port), "--log-level", "warning", *flags],
            cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu"),
            stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        if wait:
            wait_up(proc, url, log)
        yield proc, url
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, log.read_text()[-4000:]


def wait_up(proc: subprocess.Popen, url: str, log: Path, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
        time.sleep(0.2)
