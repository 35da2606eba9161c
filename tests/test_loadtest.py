"""The HTTP load test (serving/loadtest.py, `jaxdecode bench --serve`): its pure pieces on a
hand-made stream, and one tiny end-to-end run against a `jaxdecode serve` subprocess on the demo
model."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from jaxdecode import cli
from serving.loadtest import (RequestResult, apply_event, chunk_text, format_table,
                              markdown_table, percentiles, sse_events, summarize)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _chunk(text=None, usage=None, chat=False):
    if text is None:
        choices = []
    elif chat:
        choices = [{"index": 0, "delta": {"content": text}, "finish_reason": None}]
    else:
        choices = [{"index": 0, "text": text, "finish_reason": None}]
    return json.dumps({"id": "cmpl-1", "choices": choices, "usage": usage})


def test_sse_parser_events_comments_and_multiline_data():
    lines = ["id: 0", "data: " + _chunk(""), "", ": keep-alive", "",
             "id: 1", "data: {\"a\":", "data: 1}", "",
             "event: message", "data:[DONE]", "", "data: incomplete"]
    assert sse_events(lines) == [_chunk(""), "{\"a\":\n1}", "[DONE]"]


def test_stream_timings_per_chunk_and_usage():
    events = [(_chunk(""), 0.01),                      # the empty first chunk: not a token
              (_chunk("def"), 0.10), (_chunk(" f"), 0.15), (_chunk(""), 0.16),
              (_chunk("():"), 0.30),
              (_chunk(usage={"prompt_tokens": 3, "completion_tokens": 4}), 0.31),
              ("[DONE]", 0.32)]
    r = RequestResult(status=200)
    for data, t in events:
        apply_event(r, data, t)
    assert r.ok and r.done and r.completion_tokens == 4
    assert r.ttft_s == pytest.approx(0.10)
    assert r.gaps_s == pytest.approx([0.05, 0.15])
    assert chunk_text(json.loads(_chunk("hi", chat=True))) == "hi"


def test_failures_are_counted_by_kind():
    truncated = RequestResult(status=200, chunk_times=[0.1], completion_tokens=2)
    refused = RequestResult(status=429)
    broken = RequestResult(status=200)
    apply_event(broken, json.dumps({"error": {"code": "model_error"}, "index": 0}), 0.2)
    good = RequestResult(status=200, chunk_times=[0.1, 0.2, 0.4], completion_tokens=3, done=True)
    row = summarize([truncated, refused, broken, good], concurrency=2, wall_s=2.0)
    assert row["errors"] == 3
    assert row["error_kinds"] == {"no [DONE]": 1, "http 429": 1, "stream error: model_error": 1}
    assert row["output_tokens"] == 3 and row["output_tokens_per_s"] == 1.5
    assert row["tokens_per_chunk"] == 1.0
    assert row["ttft_s"]["p50"] == pytest.approx(0.1)
    assert row["inter_chunk_s"]["p99"] == pytest.approx(np.percentile([0.1, 0.2], 99))


def test_percentiles_match_numpy_and_empty_is_none():
    values = list(range(1, 101))
    assert percentiles(values) == {"p50": 50.5, "p99": pytest.approx(99.01)}
    assert percentiles([]) == {"p50": None, "p99": None}


def test_tables_have_one_row_per_level():
    row = summarize([RequestResult(status=200, chunk_times=[0.01, 0.02], completion_tokens=2,
                                   done=True)], concurrency=8, wall_s=1.0)
    report = {"levels": [row], "rss_mb_before": None, "requests_running_at_end": 0.0,
              "compilations_during_run": 0.0}
    text, md = format_table(report), markdown_table(report)
    assert len(text.splitlines()) == 3 and text.splitlines()[1].split()[0] == "8"
    assert md.splitlines()[2].startswith("| 8 | 1 | 0 | 10.0 |")


def test_bench_modes_reject_the_other_modes_flags():
    with pytest.raises(SystemExit, match="--batch"):
        cli.main(["bench", "--serve", "--batch", "2"])
    with pytest.raises(SystemExit, match="--requests.*add --serve"):
        cli.main(["bench", "--requests", "5"])


def test_bench_serve_demo_model_end_to_end(tmp_path):
    if not os.path.exists(os.path.join(ROOT, "models", "demo", "main.safetensors")):
        pytest.skip("demo weights are not present")
    out = tmp_path / "load.json"
    proc = subprocess.run(
        [sys.executable, "-m", "jaxdecode.cli", "bench", "--serve", "--requests", "12",
         "--concurrency", "1", "--concurrency", "4", "--max-tokens", "8", "--max-slots", "4",
         "--max-len", "128", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert [r["concurrency"] for r in report["levels"]] == [1, 4]
    for row in report["levels"]:
        assert row["requests"] == 12 and row["errors"] == 0, row["error_kinds"]
        assert row["output_tokens"] == 12 * 8  # --ignore-eos is the default
        for key in ("ttft_s", "inter_chunk_s"):
            assert 0 < row[key]["p50"] <= row[key]["p99"]
        assert row["output_tokens_per_s"] > 0 and row["rss_mb_after"] > 0
    assert report["rss_mb_before"] > 0
    assert report["requests_running_at_end"] == 0
    assert "TTFT p50 ms" in proc.stdout
