"""`jaxdecode serve --speculative prompt_lookup` on the demo model, in a real process: greedy
completions equal a plain server's, and /health, /v1/models and /metrics report the setting."""

from __future__ import annotations

import re
from contextlib import ExitStack

import httpx

from tests.serve_process import serve, wait_up

SETTING = {"draft": "prompt_lookup", "k": 3, "ngram_max": 2, "ngram_min": 1}


def test_speculative_server_matches_plain_and_reports_setting(tmp_path):
    body = {"prompt": "import os\nimport sys\n\ndef main():", "max_tokens": 24,
            "temperature": 0}
    with ExitStack() as stack:  # both servers start side by side
        small = ("--max-slots", "2", "--max-len", "256")
        plain = stack.enter_context(serve(tmp_path / "plain.log", *small, wait=False))
        spec = stack.enter_context(serve(tmp_path / "spec.log", *small, "--speculative",
                                         "prompt_lookup", "--num-speculative-tokens", "3",
                                         "--ngram-max", "2", wait=False))
        texts = []
        for (proc, url), name in ((plain, "plain"), (spec, "spec")):
            wait_up(proc, url, tmp_path / f"{name}.log")
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
