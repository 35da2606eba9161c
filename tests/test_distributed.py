"""Multi-host serving (jaxdecode/engine/step_ops.py, serving/distributed.py): the step ops round-trip
exactly; a follower replaying the leader's op stream gets the leader's step outputs bit for bit;
the device broadcast runs under jit on a mesh of 8 simulated CPU devices; and
`jaxdecode serve --distributed` works with two real processes (CPU collectives over gloo)."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import jaxdecode as jd
from jaxdecode.engine import runner, step_ops
from jaxdecode.device.constraints.tables import GrammarTables
from jaxdecode.device.state import RowParams
from serving import distributed as dist
from tests.serve_process import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO_WEIGHTS = os.path.join(ROOT, "models", "demo", "main.safetensors")


def _ops():
    rows = RowParams.build([jd.SamplingParams(temperature=0.7, top_k=5, logit_bias={3: -1.5},
                                              stop_token_ids=(4,)), jd.SamplingParams()],
                           vocab_size=16, eos_token_ids=(2,),
                           keys=np.array([[1, 2], [3, 4]], np.uint32))
    tables = GrammarTables(allowed=np.arange(6, dtype=np.uint32).reshape(3, 2),
                           accepting=np.array([False, True, False]),
                           has_next=np.array([True, False, True]),
                           indptr=np.array([0, 1, 2, 2], np.int32),
                           tokens=np.array([5, 7], np.int32), targets=np.array([1, 2], np.int32),
                           vocab_size=16)
    saved = {"k": np.ones((1, 1, 3, 2), np.float32), "length": np.array(3, np.int32),
             "rows.keys": np.array([9, 9], np.uint32), "grammar_local": np.array(2, np.int32)}
    final = step_ops.NewRows(np.arange(16, dtype=np.int32), 3, np.array([0, 3], np.int32),
                             np.array([[1, 2, 0, 0], [1, 5, 0, 0]], np.int32), rows,
                             copies=(np.array([2], np.int32), np.array([5], np.int32)))
    return [step_ops.init(4, 64, (2, 5), 17, 16),
            step_ops.chunk(np.arange(32, dtype=np.int32).reshape(2, 16), np.array([0, 16]),
                           np.array([3, 16]), np.array([[1, 2, 0, 0], [7, 8, 0, 0]]), 256,
                           [(0, final)]),
            step_ops.chunk(np.zeros((1, 16), np.int32), np.array([16]), np.array([1]),
                           np.array([[3, 4, 0, 0]]), 256),
            step_ops.restore(saved, 2, np.array([6], np.int32),
                             np.array([6, 7, 0, 0], np.int32), grammar_state=5),
            step_ops.grammar(np.array([True, False]), np.array([3, 0], np.int32), tables),
            step_ops.grammar(np.array([True, True]), np.array([0, 0], np.int32), None),
            step_ops.flags(np.array([True, False]), np.array([False, True])),
            step_ops.step(512, 3), step_ops.reset(), step_ops.warmup(64, 5), step_ops.stop(),
            step_ops.beam([[5, 6, 7], [9]], [2, 3],
                          {"max_new_tokens": 8, "eos_token_ids": (2,), "early_stopping": "never",
                           "response_format": {"type": "regex", "pattern": "[a-z]+"}})]


def test_step_ops_round_trip_exactly():
    ops = _ops()
    assert {op.code for op in ops} == set(step_ops.NAMES)
    for op in ops:
        back = step_ops.from_bytes(step_ops.to_bytes(op))
        assert back.equals(op), op.name
        assert all(back.arrays[k].dtype == v.dtype for k, v in op.arrays.items())
    first = ops[1]
    assert first.arrays["final0.rows.bias"][0, 3] == np.float32(-1.5)
    assert first.arrays["final0.copy_dst"].tolist() == [5] and first.scalar("final0.row") == 0
    assert "final0.row" not in ops[2].arrays
    assert "grammar_local" not in ops[3].arrays and ops[3].scalar("grammar_state") == 5
    assert not ops[1].equals(ops[2]) and not ops[7].equals(step_ops.step(512, 0))
    assert ops[-1].arrays["tokens"].tolist() == [[5, 6, 7], [9, 0, 0]]


def test_step_ops_errors_name_the_field():
    with pytest.raises(ValueError, match="code"):
        step_ops.StepOp(99)
    with pytest.raises(ValueError, match=r"arrays\['x'\]"):
        step_ops.StepOp(step_ops.STEP, {"x": np.array(["text"], object)})
    with pytest.raises(ValueError, match="payload: not a step op"):
        step_ops.from_bytes(b"not a zip")
    import io

    buf = io.BytesIO()
    np.savez(buf, __version__=np.int32(step_ops.VERSION + 1), __code__=np.int32(step_ops.STOP))
    with pytest.raises(ValueError, match="payload: step op format"):
        step_ops.from_bytes(buf.getvalue())
    ctx = runner.Context(None, None, max_slots=4, max_len=64, eos_token_ids=(2,))
    with pytest.raises(ValueError, match="max_len: the leader uses 128"):
        runner.apply(ctx, None, step_ops.init(4, 128, (2,), ctx.num_pages, ctx.page_size))
    with pytest.raises(ValueError, match="num_pages: the leader uses 9"):
        runner.apply(ctx, None, step_ops.init(4, 64, (2,), 9, ctx.page_size))
    with pytest.raises(ValueError, match="stop is not applied"):
        runner.apply(ctx, None, step_ops.stop())


def test_payload_buckets_are_powers_of_two():
    assert [dist.payload_bucket(n) for n in (0, 1, 4096, 4097, 70000)] == [4096, 4096, 4096,
                                                                           8192, 131072]


class _Recorder:
    """Wraps runner.apply: the STEP outputs of each thread (engine, follower), in order."""

    def __init__(self, monkeypatch):
        self.outputs: dict = {}
        real = runner.apply

        def apply(ctx, state, op):
            state, out = real(ctx, state, op)
            if op.code == step_ops.STEP:
                self.outputs.setdefault(threading.current_thread().name, []).append(
                    tuple(np.asarray(x) for x in (out.token, out.finish, out.logprob,
                                                  out.top_ids, out.top_logprobs)))
            if op.code == step_ops.BEAM:
                self.outputs.setdefault(threading.current_thread().name, []).append(
                    (np.asarray(json.dumps(out.beams)),))
            return state, out

        monkeypatch.setattr(runner, "apply", apply)


@pytest.mark.skipif(not os.path.exists(DEMO_WEIGHTS), reason="demo weights are not present")
def test_follower_replays_the_leader_bit_for_bit(monkeypatch, tmp_path):
    """Greedy, seeded sampling, logprobs, stop strings, two grammars arriving apart (table
    rebuild and rebase), a cancel mid-way, slot reuse, a beam search, a request saved and
    restored: the follower's step and beam outputs equal the leader's."""
    import models

    model, params, tok = models.demo()
    rec = _Recorder(monkeypatch)
    channel = dist.QueueBroadcaster()
    applied: list = []
    with jd.LLM(model, params, tok, max_slots=3, max_len=128, step_hook=channel) as llm:
        follower = threading.Thread(name="follower", target=lambda: applied.append(
            dist.run_follower(model, params, channel, max_slots=3, max_len=128,
                              eos_token_ids=llm.eos_token_ids)))
        follower.start()
        hs = [llm.submit("def main():", jd.SamplingParams(temperature=0, max_tokens=12)),
              llm.submit("x = ", jd.SamplingParams(seed=7, max_tokens=10, stop=("\n",))),
              llm.submit("name = '", jd.SamplingParams(
                  seed=3, max_tokens=8, response_format={"type": "regex", "pattern": "[a-z]+"}))]
        long = llm.submit("class A:", jd.SamplingParams(seed=5, max_tokens=100, ignore_eos=True))
        next(e for e in long.events() if e.kind == "delta")
        long.cancel()
        hs.append(llm.submit("answer = ", jd.SamplingParams(
            seed=11, max_tokens=6, response_format={"type": "choice", "choices": ["yes", "no"]})))
        hs.append(llm.submit("import ", jd.SamplingParams(seed=1, max_tokens=9, top_p=0.9,
                                                          logprobs=2)))
        hs.append(llm.submit("def g():", jd.SamplingParams(num_beams=3, max_tokens=6)))
        done = [h.result(timeout=300) for h in hs]
        saved = llm.submit("def f(x):", jd.SamplingParams(seed=2, max_tokens=40, ignore_eos=True))
        next(e for e in saved.events() if e.kind == "delta")
        llm.save_request(saved, str(tmp_path / "saved"))
        saved.cancel()
        restored = llm.restore_request(str(tmp_path / "saved")).result(timeout=300)
        [whole] = llm.generate("def f(x):", jd.SamplingParams(seed=2, max_tokens=40,
                                                              ignore_eos=True))
    channel.publish(step_ops.stop())
    follower.join(120)
    assert not follower.is_alive() and applied and applied[0] > 0
    assert long.result().state == jd.RequestState.CANCELLED
    assert all(c.error is None for c in done), [c.error for c in done]
    assert done[3].text in ("yes", "no")
    assert restored.token_ids == whole.token_ids and len(whole.token_ids) == 40
    lead, follow = rec.outputs["jaxdecode-engine"], rec.outputs["follower"]
    assert len(lead) == len(follow) > 10
    for t, (a, b) in enumerate(zip(lead, follow)):
        for x, y in zip(a, b):
            assert x.tobytes() == y.tobytes(), f"step {t}"


MESH_SCRIPT = textwrap.dedent(r"""
    import json
    import jax
    import numpy as np
    import jaxdecode as jd
    import models
    from jaxdecode.engine import runner, step_ops
    from models import Llama, LlamaConfig
    from serving import distributed as dist
    from tests.host_fixtures import byte_level_from_table

    assert jax.device_count() == 8 and jax.process_count() == 1
    cfg = LlamaConfig(vocab_size=256, num_layers=2, num_heads=8, num_kv_heads=4, head_dim=4,
                      max_len=64, hidden_size=32, intermediate_size=36, eos_token_ids=(1,))
    model = Llama(cfg)
    params = model.init_params(jax.random.key(0), scale=0.3)
    tok = byte_level_from_table({})
    mesh = models.make_mesh(2, 4)
    sp = models.shard_params(params, mesh)

    out = {"zeros": dist.broadcast(np.arange(5, dtype=np.int32), False).tolist(),
           "same": dist.broadcast(np.arange(5, dtype=np.int32), True).tolist()}
    collective = dist.CollectiveBroadcaster(is_source=True)
    replay = dist.QueueBroadcaster()
    sizes = []

    class Hook:  # the collective path, then what it delivered into a queue for a follower
        def publish(self, op):
            got = collective.publish(op)
            assert got.equals(op), op.name
            sizes.append(dist.payload_bucket(len(step_ops.to_bytes(op))))
            replay.publish(got)

    reqs = [jd.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                              utf8_errors="replace"),
            jd.SamplingParams(max_tokens=8, temperature=1.0, seed=3, ignore_eos=True,
                              utf8_errors="replace")] * 3
    prompts = [[5, 6, 7], [9, 10], [40, 41, 42, 43], [3], [8, 8], [1, 2, 3, 4, 5]]
    steps = []
    real = runner.apply
    def apply(ctx, state, op):
        state, o = real(ctx, state, op)
        if op.code == step_ops.STEP:
            steps.append((ctx.replicate_outputs, np.asarray(o.token).tolist(),
                          o.token.sharding.is_fully_replicated))
        return state, o
    runner.apply = apply
    with jd.LLM(model, sp, tok, max_slots=4, max_len=64, mesh=mesh, step_hook=Hook()) as llm:
        outs = [list(c.token_ids) for c in llm.generate(prompts, reqs)]
    replay.publish(step_ops.stop())
    lead = [s for s in steps if s[0]]
    n = len(lead)
    dist.run_follower(model, sp, replay, max_slots=4, max_len=64, eos_token_ids=(1,), mesh=mesh)
    follow = [s for s in steps[n:] if s[0]]
    with jd.LLM(model, params, tok, max_slots=4, max_len=64) as plain:
        ref = [list(c.token_ids) for c in plain.generate(prompts, reqs)]
    out.update(outs=outs, ref=ref, lead=[s[1] for s in lead], follow=[s[1] for s in follow],
               replicated=all(s[2] for s in lead + follow), sizes=sorted(set(sizes)))
    print("RESULT" + json.dumps(out))
""")


def _env(devices: int) -> dict:
    return dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT,
                XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") +
                           f" --xla_force_host_platform_device_count={devices}").strip())


def test_collective_broadcast_on_a_mesh_of_8_devices():
    """One process, 8 devices, mesh data=2 x model=4: every op goes through the jitted
    broadcast (header, then the bucketed payload) and comes back equal; the follower fed with
    what it delivered gets the leader's step outputs; tokens equal the unsharded engine's."""
    proc = subprocess.run([sys.executable, "-c", MESH_SCRIPT], cwd=ROOT, env=_env(8),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads([x for x in proc.stdout.splitlines() if x.startswith("RESULT")][-1][6:])
    assert out["zeros"] == [0] * 5 and out["same"] == list(range(5))
    assert out["lead"] == out["follow"] and len(out["lead"]) >= 8
    assert out["outs"] == out["ref"]
    assert out["replicated"]
    assert all(s & (s - 1) == 0 for s in out["sizes"]) and len(out["sizes"]) <= 3


def _serve_cmd(pid: int, n: int, coord: int, http: int, mesh: str) -> list:
    return [sys.executable, "-m", "jaxdecode.cli", "serve", "--model", "demo", "--port", str(http),
            "--max-slots", "2", "--max-len", "128", "--distributed",
            "--coordinator-address", f"127.0.0.1:{coord}", "--num-processes", str(n),
            "--process-id", str(pid), "--mesh", mesh, "--log-level", "info"]


def _serve(pid: int, n: int, coord: int, http: int, mesh: str, env: dict) -> subprocess.Popen:
    return subprocess.Popen(_serve_cmd(pid, n, coord, http, mesh), cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_http(url: str, procs: list, timeout: float = 300) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in procs:
            if p.poll() is not None:
                raise AssertionError(p.stderr.read()[-4000:])
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.5)
    raise AssertionError("the server did not come up")


@pytest.mark.skipif(not os.path.exists(DEMO_WEIGHTS), reason="demo weights are not present")
def test_serve_distributed_processes_on_cpu():
    """`jaxdecode serve --distributed` in two processes (process 0 serves HTTP, process 1
    follows; the mesh spans both; gloo CPU collectives) answers greedy, sampled (n=2), beam, and
    constrained requests with logprobs -- greedy and beams like the single-process engine -- and
    SIGINT to process 0 stops the follower too. (One process, a loopback, runs the same code
    with no follower; it is not repeated here, for the suite's time.)"""
    import httpx

    import models

    processes = 2
    coord, http = free_port(), free_port()
    env = dict(_env(8 // processes), JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo")
    procs = [_serve(i, processes, coord, http, "data=2,model=4", env) for i in range(processes)]
    try:
        url = f"http://127.0.0.1:{http}"
        _wait_http(url, procs)
        body = {"model": "demo", "prompt": "def main():", "max_tokens": 12, "temperature": 0}
        r = httpx.post(url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        text = r.json()["choices"][0]["text"]
        body = dict(body, temperature=0.8, seed=5, n=2)
        r2 = httpx.post(url + "/v1/completions", json=body, timeout=120)
        assert r2.status_code == 200 and len(r2.json()["choices"]) == 2
        body = {"model": "demo", "prompt": "def main():", "max_tokens": 6, "num_beams": 3, "n": 2}
        r3 = httpx.post(url + "/v1/completions", json=body, timeout=120)
        assert r3.status_code == 200 and len(r3.json()["choices"]) == 2, r3.text
        beams = [c["text"] for c in r3.json()["choices"]]
        schema = {"type": "json_schema",
                  "json_schema": {"name": "flag", "schema": {"type": "boolean"}}}
        body = {"model": "demo", "prompt": "ok = ", "max_tokens": 8, "seed": 1, "logprobs": 2,
                "response_format": schema}
        r4 = httpx.post(url + "/v1/completions", json=body, timeout=120)
        assert r4.status_code == 200, r4.text
        assert r4.json()["choices"][0]["text"] in ("true", "false"), r4.text
        assert r4.json()["choices"][0]["logprobs"]["top_logprobs"], r4.text
    finally:
        procs[0].send_signal(signal.SIGINT)
        codes = [p.wait(timeout=120) for p in procs]
        errs = [p.stderr.read() for p in procs]
    assert codes == [0] * processes, [e[-2000:] for e in errs]
    events = [json.loads(x) for x in errs[1].splitlines() if x.startswith("{")]
    start = [e for e in events if e["event"] == "follower.start"]
    stop = [e for e in events if e["event"] == "follower.stop"]
    assert start and start[0]["process"] == 1 and start[0]["devices"] == 8, errs[1][-2000:]
    assert stop and stop[0]["ops"] > 10, errs[1][-2000:]
    model, params, tok = models.demo()
    with jd.LLM(model, params, tok, max_slots=2, max_len=128) as llm:
        [ref] = llm.generate("def main():", jd.SamplingParams(temperature=0, max_tokens=12))
        ref_beams = llm.generate("def main():", jd.SamplingParams(num_beams=3, n=2, max_tokens=6))
    assert ref.text == text
    assert beams == [c.text for c in ref_beams]


def test_coordinator_flags_all_three_or_none():
    from jaxdecode.cli import build_parser

    args = build_parser().parse_args(["serve", "--distributed", "--num-processes", "2"])
    assert args.distributed and args.coordinator_address is None and args.process_id is None
    with pytest.raises(SystemExit, match="give all three or none"):
        dist.initialize(args)


@pytest.mark.skipif(not os.path.exists(DEMO_WEIGHTS), reason="demo weights are not present")
def test_serve_distributed_bad_flag_exits_every_process():
    """Each process builds the engine before the split: a bad flag ends all of them (no
    follower is left waiting for a leader that never started)."""
    coord, http = free_port(), free_port()
    env = dict(_env(4), JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo")
    procs = [subprocess.Popen(_serve_cmd(i, 2, coord, http, "data=2,model=4")
                              + ["--speculative", "prompt_lookup"], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    codes = [p.wait(timeout=300) for p in procs]
    errs = [p.stderr.read() for p in procs]
    assert all(c not in (0, None) for c in codes), codes
    assert all("--speculative" in e and "mesh" in e for e in errs), [e[-1000:] for e in errs]
