"""`jaxdecode serve --speculative prompt_lookup` on the demo model, in a real process: greedy
completions equal a plain server's, and /health, /v1/models and /metrics report the setting."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]
SETTING = {"draft": "prompt_lookup", "k": 3, "ngram_max": 2, "ngram_min": 1}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def _serve(log: Path, *flags: str):
    """A `jaxdecode serve --model demo` process (its base url); SIGINT at the end, exit 0."""
    port = _free_port()
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "jaxdecode.cli", "serve", "--model", "demo", "--port",
             str(port), "--max-slots", "2", "--max-len", "256", "--log-level", "warning", *flags],
            cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu"),
            stdout=out, stderr=subprocess.STDOUT)
    try:
        yield proc, f"http://127.0.0.1:{port}"
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, log.read_text()[-4000:]


def _wait_up(proc, url: str, log: Path) -> None:
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.2)


def test_speculative_server_matches_plain_and_reports_setting(tmp_path):
    if not (ROOT / "models" / "demo" / "main.safetensors").exists():
        pytest.skip("demo weights are not present")
    body = {"prompt": "import os\nimport sys\n\ndef main():", "max_tokens": 24,
            "temperature": 0}
    with ExitStack() as stack:  # both servers start side by side
        plain = stack.enter_context(_serve(tmp_path / "plain.log"))
        spec = stack.enter_context(_serve(tmp_path / "spec.log", "--speculative", "prompt_lookup",
                                          "--num-speculative-tokens", "3", "--ngram-max", "2"))
        texts = []
        for (proc, url), name in ((plain, "plain"), (spec, "spec")):
            _wait_up(proc, url, tmp_path / f"{name}.log")
            r = httpx.post(url + "/v1/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            texts.append(r.json()["choices"][0]["text"])
        assert texts[0] == texts[1] and texts[0]
        url = spec[1]
        assert httpx.get(url + "/health").json()["speculative"] == SETTING
        assert httpx.get(url + "/v1/models").json()["data"][0]["speculative"] == SETTING
        assert "speculative" not in httpx.get(plain[1] + "/health").json()
        metrics = httpx.get(url + "/metrics").text
        value = {name: float(re.search(rf"^jaxdecode_spec_{name}_total (\S+)$", metrics,
                                       re.MULTILINE).group(1))
                 for name in ("proposed_tokens", "accepted_tokens", "rounds")}
        assert value["proposed_tokens"] == 3 * value["rounds"] > 0
        assert 0 <= value["accepted_tokens"] <= value["proposed_tokens"]
