"""The HTTP load test (jaxdecode/cli/bench/loadtest/, `jaxdecode bench --serve`): its pure
pieces on a hand-made stream, the workloads, the arrivals and the vLLM-style metrics; a run
against a fake OpenAI-compatible server that is not jaxdecode (vLLM's shape: `model` required,
no /metrics); and tiny end-to-end runs against a `jaxdecode serve` subprocess on the demo
model."""

import http.server
import json
import math
import os
import subprocess
import sys
import threading

import numpy as np
import pytest

from jaxdecode import cli
from jaxdecode.cli.bench import loadtest
from jaxdecode.cli.bench.loadtest import (LoadConfig, RequestResult, WorkItem, apply_event,
                                          arrival_offsets, chunk_text, format_table,
                                          make_workload, markdown_table, parse_metrics,
                                          percentiles, prefix_cache_delta, request_body,
                                          requests_running, sharegpt_lengths, sse_events,
                                          stats_ms, summarize)

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
    assert "TTFT ms mean/median/p99" in text.splitlines()[0]
    # concurrency, rate, completed, failed, duration, req/s, output tok/s, total tok/s, TTFT
    assert md.splitlines()[2].startswith(
        "| 8 | inf | 1 | 0 | 1.00 | 1.00 | 2.00 | 2.00 | 10.00/10.00/10.00 | 10.00/10.00/10.00 |")


def test_vllm_metrics_on_hand_made_results():
    # request a: sent at 0, text chunks at 0.1, 0.2, 0.4, [DONE] at 0.5, 4 output tokens
    a = RequestResult(status=200)
    for data, t in [(_chunk(""), 0.01), (_chunk("x"), 0.1), (_chunk("y"), 0.2),
                    (_chunk("z"), 0.4),
                    (_chunk(usage={"prompt_tokens": 10, "completion_tokens": 4,
                                   "prompt_tokens_details": {"cached_tokens": 8}}), 0.45),
                    ("[DONE]", 0.5)]:
        apply_event(a, data, t)
    assert a.ok and a.prompt_tokens == 10 and a.cached_tokens == 8
    assert a.e2el_s == pytest.approx(0.5) and a.tpot_s == pytest.approx((0.5 - 0.1) / 3)
    # request b: one output token (no TPOT), vLLM's usage without prompt_tokens_details
    b = RequestResult(status=200)
    for data, t in [(_chunk("w"), 0.3),
                    (_chunk(usage={"prompt_tokens": 6, "completion_tokens": 1,
                                   "prompt_tokens_details": None}), 0.31), ("[DONE]", 0.32)]:
        apply_event(b, data, t)
    assert b.ok and b.tpot_s is None and b.cached_tokens is None
    failed = RequestResult(status=500)
    row = summarize([a, b, failed], concurrency=2, wall_s=2.0, request_rate=4.0)
    assert (row["completed"], row["errors"], row["request_rate"]) == (2, 1, 4.0)
    assert (row["input_tokens"], row["output_tokens"], row["cached_tokens"]) == (16, 5, 8)
    assert row["requests_per_s"] == 1.0 and row["output_tokens_per_s"] == 2.5
    assert row["total_tokens_per_s"] == pytest.approx((16 + 5) / 2.0)
    ttft = np.array([0.1, 0.3]) * 1e3
    assert row["ttft_ms"] == pytest.approx({"mean": ttft.mean(), "median": np.median(ttft),
                                            "std": ttft.std(), "p99": np.percentile(ttft, 99)})
    assert row["tpot_ms"]["mean"] == pytest.approx(400 / 3) == row["tpot_ms"]["p99"]
    itl = np.array([0.1, 0.2]) * 1e3  # only a's gaps between chunks with text
    assert row["itl_ms"]["mean"] == pytest.approx(itl.mean())
    assert row["itl_ms"]["p99"] == pytest.approx(np.percentile(itl, 99))
    e2el = np.array([0.5, 0.32]) * 1e3
    assert row["e2el_ms"]["median"] == pytest.approx(np.median(e2el))
    assert row["e2el_ms"]["p99"] == pytest.approx(np.percentile(e2el, 99))
    assert row["ttft_s"]["p50"] == pytest.approx(0.2)  # the earlier keys stay
    assert stats_ms([]) == {"mean": None, "median": None, "std": None, "p99": None}
    assert stats_ms([0.001, 0.002, 0.009])["median"] == pytest.approx(2.0)


def test_random_workload_lengths_range_and_determinism():
    cfg = LoadConfig(workload="random", input_len=16, max_tokens=8, token_min=10,
                     token_max=20, seed=3)
    items = make_workload(cfg, 50)
    assert all(len(it.prompt) == 16 and it.max_tokens == 8 for it in items)
    ids = np.array([it.prompt for it in items])
    assert ids.min() >= 10 and ids.max() < 20 and len(np.unique(ids)) == 10
    assert make_workload(cfg, 50) == items                         # same seed, same prompts
    assert make_workload(cfg, 50, stream=1) != items               # each level its own
    assert make_workload(LoadConfig(workload="random", seed=4, input_len=16, max_tokens=8,
                                    token_min=10, token_max=20), 50) != items
    body = request_body(0, cfg, items[0])
    assert body["prompt"] == items[0].prompt and body["max_tokens"] == 8
    assert body["ignore_eos"] is True and body["temperature"] == 0.0  # greedy, as vLLM's
    assert "model" not in body and body["stream_options"] == {"include_usage": True}


def test_snippets_workload_is_the_old_bodies():
    cfg = LoadConfig(seed=5)
    items = make_workload(cfg, 40, stream=2)
    assert [it.prompt for it in items] == [loadtest.PROMPTS[i % 16] for i in range(40)]
    assert request_body(17, cfg, items[17]) == request_body(17, cfg)
    body = request_body(17, LoadConfig(seed=5, model_name="Qwen/Qwen2.5-0.5B"))
    assert body["model"] == "Qwen/Qwen2.5-0.5B" and body["seed"] == 22
    assert body["temperature"] == 0.8 and body["prompt"] == loadtest.PROMPTS[1]


def test_prefix_repetition_structure():
    cfg = LoadConfig(workload="prefix-repetition", num_prefixes=3, prefix_len=12,
                     suffix_len=5, max_tokens=7, seed=1)
    items = make_workload(cfg, 30)
    assert all(len(it.prompt) == 17 and it.max_tokens == 7 for it in items)
    prefixes = [tuple(it.prompt[:12]) for it in items]
    assert len(set(prefixes)) == 3
    assert sorted(prefixes.count(p) for p in set(prefixes)) == [10, 10, 10]
    assert len({tuple(it.prompt[12:]) for it in items}) == 30   # distinct suffixes
    assert make_workload(cfg, 30) == items
    assert {tuple(it.prompt[:12]) for it in make_workload(cfg, 30, stream=1)}.isdisjoint(
        prefixes)


def test_started_server_warms_up_the_workloads_longest_prompt():
    """`bench --serve` starts `serve --warmup N` with N the longest prompt a token-id workload
    sends (the flag's default, 64 tokens, for the text snippets), so a run of longer prompts
    compiles nothing while it is measured."""
    assert loadtest.warmup_tokens(LoadConfig()) is None                     # snippets
    argv = loadtest.ServerProcess().argv
    assert argv[argv.index("--warmup") + 1] == "--log-level"                # the server's 64
    assert loadtest.warmup_tokens(LoadConfig(workload="random", input_len=16)) == 16
    assert loadtest.warmup_tokens(LoadConfig(workload="random", input_len=128)) == 128
    cfg = LoadConfig(workload="prefix-repetition", prefix_len=1024, suffix_len=64)
    longest = max(w.prompt_len for w in loadtest.make_workload(cfg, 8))
    assert loadtest.warmup_tokens(cfg) == longest == 1088
    cfg = LoadConfig(workload="sharegpt", max_input_len=300, requests=200)
    assert max(w.prompt_len for w in loadtest.make_workload(cfg, 200)) <= 300
    assert loadtest.warmup_tokens(cfg) == 300
    argv = loadtest.ServerProcess(warmup=1088).argv
    assert argv[argv.index("--warmup") + 1] == "1088"


def test_sharegpt_lengths_clipped_deterministic_and_near_the_target_means():
    lengths = np.array(sharegpt_lengths(20000, np.random.default_rng(0)))
    ins, outs = lengths[:, 0], lengths[:, 1]
    assert ins.min() >= 4 and ins.max() <= 1024 and outs.min() >= 4
    assert (ins + outs).max() <= 2048
    assert 190 < ins.mean() < 250 and 170 < outs.mean() < 220  # documented: ~218 / ~192
    assert np.median(ins) < ins.mean()                          # a long tail
    small = np.array(sharegpt_lengths(2000, np.random.default_rng(0), 100, 128))
    assert small[:, 0].max() <= 100 and (small.sum(axis=1)).max() <= 128
    fixed = np.array(sharegpt_lengths(100, np.random.default_rng(0), output_len=32))
    assert set(fixed[:, 1]) == {32}
    cfg = LoadConfig(workload="sharegpt", max_total_len=256, seed=2)
    items = make_workload(cfg, 64)
    assert items == make_workload(cfg, 64)
    assert all(4 <= len(it.prompt) and len(it.prompt) + it.max_tokens <= 256 for it in items)
    assert len({len(it.prompt) for it in items}) > 10


def test_poisson_arrivals_mean_gap_and_determinism():
    offsets = arrival_offsets(20001, rate=4.0, seed=0)
    gaps = np.diff(offsets)
    assert offsets[0] == 0 and (gaps >= 0).all()
    assert gaps.mean() == pytest.approx(0.25, rel=0.05)
    assert gaps.std() == pytest.approx(0.25, rel=0.05)          # exponential: std = mean
    assert arrival_offsets(20001, rate=4.0, seed=0) == offsets
    assert arrival_offsets(20001, rate=4.0, seed=1) != offsets
    bursty = np.diff(arrival_offsets(20001, rate=4.0, burstiness=0.25, seed=0))
    assert bursty.mean() == pytest.approx(0.25, rel=0.08)
    assert bursty.std() == pytest.approx(0.25 / math.sqrt(0.25), rel=0.08)
    assert arrival_offsets(5, rate=math.inf) == [0.0] * 5


def test_metrics_of_jaxdecode_and_vllm_servers():
    jd = parse_metrics("# HELP x\njaxdecode_requests_running 0.0\n"
                       "jaxdecode_prefix_cache_hits_total 10.0\n"
                       "jaxdecode_prefix_cache_queries_total 40.0\n"
                       'jaxdecode_requests_total{finish_reason="eos"} 2.0\n'
                       'jaxdecode_requests_total{finish_reason="stop_sequence"} 3.0\n'
                       "not a metric line\n")
    assert jd["jaxdecode_requests_total"] == 5.0 and requests_running(jd) == 0.0
    later = dict(jd, jaxdecode_prefix_cache_hits_total=30.0,
                 jaxdecode_prefix_cache_queries_total=80.0)
    assert prefix_cache_delta(jd, later) == {"hits": 20.0, "queries": 40.0, "hit_rate": 0.5}
    vllm = parse_metrics('vllm:num_requests_running{engine="0",model_name="m"} 1.0 1700000000\n'
                         'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 64.0\n'
                         'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 16.0\n')
    assert requests_running(vllm) == 1.0
    assert prefix_cache_delta({}, vllm) is None and prefix_cache_delta(vllm, vllm)["hits"] == 0
    assert requests_running({}) is None


def test_flags_of_another_workload_and_bad_values_name_the_flag():
    parser = loadtest.build_parser()
    for argv, match in ((["--input-len", "8"], "--input-len: only with --workload random"),
                        (["--workload", "random", "--suffix-len", "8"], "--suffix-len"),
                        (["--workload", "random", "--chat"], "--chat"),
                        (["--request-rate", "0"], "--request-rate"),
                        (["--workload", "random", "--token-min", "9", "--token-max", "9"],
                         "--token-min")):
        with pytest.raises(SystemExit, match=match):
            loadtest.config_from_args(parser.parse_args(argv))
    cfg = loadtest.config_from_args(parser.parse_args(
        ["--workload", "sharegpt", "--output-len", "32", "--max-concurrency", "4",
         "--max-concurrency", "16", "--request-rate", "2.5", "--served-model-name", "m"]))
    assert cfg.sharegpt_output_len == 32 and cfg.concurrency == (4, 16)
    assert cfg.request_rate == 2.5 and cfg.model_name == "m"
    assert loadtest.config_from_args(parser.parse_args([])).request_rate == math.inf


class _FakeOpenAIServer(http.server.BaseHTTPRequestHandler):
    """vLLM's shape: `model` required, no /metrics (404), max_model_len in /v1/models, and
    usage without prompt_tokens_details; one text chunk per output token."""
    bodies: list = []

    def log_message(self, *args):
        pass

    def _json(self, status, obj):
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/v1/models":
            self._json(200, {"data": [{"id": "fake", "max_model_len": 96}]})
        else:
            self._json(404, {"detail": "Not Found"})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        type(self).bodies.append(body)
        if body.get("model") != "fake":
            return self._json(404, {"error": {"message": "model", "code": 404}})
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.end_headers()
        n = body["max_tokens"]
        for i in range(n):
            chunk = {"choices": [{"index": 0, "text": "t", "finish_reason":
                                  "length" if i == n - 1 else None}], "usage": None}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": n,
                 "total_tokens": len(body["prompt"]) + n, "prompt_tokens_details": None}
        self.wfile.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")


def test_url_mode_against_a_server_that_is_not_jaxdecode(tmp_path, capsys):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FakeOpenAIServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    _FakeOpenAIServer.bodies = []
    try:
        argv = ["--url", url, "--workload", "sharegpt", "--requests", "12", "--concurrency",
                "3", "--request-rate", "200", "--warmup-requests", "1", "--json",
                str(tmp_path / "r.json")]
        # without the served name the warm-up fails and says what may be missing
        with pytest.raises(SystemExit, match="served-model-name"):
            loadtest.main(loadtest.build_parser().parse_args(argv))
        _FakeOpenAIServer.bodies = []
        rc = loadtest.main(loadtest.build_parser().parse_args(
            argv + ["--served-model-name", "fake"]))
    finally:
        server.shutdown()
    assert rc == 0
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["metrics_available"] is False and report["requests_running_at_end"] is None
    assert report["config"]["max_total_len"] == 96  # the server's max_model_len
    (row,) = report["levels"]
    assert row["completed"] == 12 and row["errors"] == 0 and row["prefix_cache"] is None
    bodies = _FakeOpenAIServer.bodies
    assert len(bodies) == 13 and all(b["model"] == "fake" for b in bodies)
    assert all(len(b["prompt"]) + b["max_tokens"] <= 96 for b in bodies)
    assert all(b["stream_options"] == {"include_usage": True} for b in bodies)
    assert row["input_tokens"] == sum(len(b["prompt"]) for b in bodies[1:])
    assert row["output_tokens"] == sum(b["max_tokens"] for b in bodies[1:])
    assert row["tokens_per_chunk"] == 1.0 and row["cached_tokens"] is None
    assert row["tpot_ms"]["mean"] > 0 and row["e2el_ms"]["p99"] >= row["ttft_ms"]["p99"]
    assert "E2EL ms mean/median/p99" in capsys.readouterr().out


def test_bench_modes_reject_the_other_modes_flags():
    with pytest.raises(SystemExit, match="--batch"):
        cli.main(["bench", "--serve", "--batch", "2"])
    with pytest.raises(SystemExit, match="--requests.*add --serve"):
        cli.main(["bench", "--requests", "5"])


def test_python_m_entry_point_takes_the_bench_serve_flags():
    proc = subprocess.run([sys.executable, "-m", "jaxdecode.cli.bench.loadtest", "--help"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "python -m jaxdecode.cli.bench.loadtest" in proc.stdout
    assert "--served-model-name" in proc.stdout and "--workload" in proc.stdout


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
    assert "TTFT ms mean/median/p99" in proc.stdout


def test_bench_serve_random_workload_end_to_end(tmp_path):
    if not os.path.exists(os.path.join(ROOT, "models", "demo", "main.safetensors")):
        pytest.skip("demo weights are not present")
    out = tmp_path / "random.json"
    proc = subprocess.run(
        [sys.executable, "-m", "jaxdecode.cli", "bench", "--serve", "--workload", "random",
         "--input-len", "16", "--output-len", "8", "--requests", "8", "--max-concurrency", "4",
         "--request-rate", "50", "--max-slots", "4", "--max-len", "128",
         "--server-arg=--no-prefix-cache", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert "--no-prefix-cache" in report["server"]["argv"]
    (row,) = report["levels"]
    assert (row["concurrency"], row["request_rate"]) == (4, 50.0)
    assert row["completed"] == 8 and row["errors"] == 0, row["error_kinds"]
    assert (row["input_tokens"], row["output_tokens"]) == (8 * 16, 8 * 8)
    assert row["total_tokens_per_s"] > row["output_tokens_per_s"] > 0
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        assert 0 < row[key]["median"] <= row[key]["p99"], key
    assert row["e2el_ms"]["mean"] > row["ttft_ms"]["mean"]
    assert row["prefix_cache"] is None or row["prefix_cache"]["hits"] == 0
    assert report["requests_running_at_end"] == 0
