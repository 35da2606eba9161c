"""contract §11 (records, replay, X1 batch invariance) and §7 B1 (pause / save / restore)."""

import dataclasses
import json
import os
import subprocess
import sys
import textwrap

import pytest

import jaxdecode as jd
import models
from jaxdecode.device import numerics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT = "def fibonacci(n):"
SP = jd.SamplingParams(temperature=0.9, seed=7, max_tokens=40, ignore_eos=True,
                       utf8_errors="replace")


@pytest.fixture(scope="module")
def llm(demo):
    model, params, tok = demo
    with jd.LLM(model, params, tok, max_slots=4, max_len=256, model_source="demo") as engine:
        yield engine


def run(*args, **kw):
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"), **kw)


def test_replay_X11_record_layout_is_pinned(llm):
    record = llm.generate([PROMPT], SP)[0].record
    data = json.loads(record.to_json())
    assert data["format"] == "jaxdecode.record/1" and data["processor_order"] == "v1"
    assert set(data["sampling"]) == {f.name for f in dataclasses.fields(jd.SamplingParams)}
    assert data["rng"]["seed"] == 7 and data["rng"]["impl"]
    assert data["model"]["hash"] == llm.params_hash and data["tokenizer"]["hash"]
    assert data["prompt"]["text"] == PROMPT and data["layout"]["prompt_bucket"] == 16
    assert data["output"]["token_ids"] == list(llm.generate([PROMPT], SP)[0].token_ids)
    for key in ("jax", "jaxlib", "backend", "device_kind"):
        assert data["environment"][key]
    assert data["environment"]["compiler_options"] == numerics.compiler_options()
    data["environment"]["compiler_options"] = {"xla_cpu_experimental_ynn_fusion_type": "x"}
    assert any(d.startswith("compiler_options: recorded") for d in
               jd.replay(jd.GenerationRecord(data), llm).environment_differences)


def test_replay_X11_identical_and_tampered_record_reported_at_the_right_step(llm):
    record = llm.generate([PROMPT], SP)[0].record
    assert jd.replay(record, llm).identical
    data = json.loads(record.to_json())
    data["sampling"]["temperature"] = 1.4
    tampered = jd.GenerationRecord(data)
    hot = llm.generate([PROMPT], dataclasses.replace(SP, temperature=1.4))[0].token_ids
    step = next(i + 1 for i, (a, b) in enumerate(zip(record.token_ids, hot)) if a != b)
    report = jd.replay(tampered, llm)
    assert not report.identical and report.first_divergence == step
    assert (report.expected_token, report.actual_token) == (record.token_ids[step - 1],
                                                            hot[step - 1])
    assert f"first divergence at step {step}" in report.describe()
    assert report.details["recorded"]["probability"] > 0


def test_replay_X11_cli_record_then_replay_in_fresh_processes(tmp_path):
    rec = tmp_path / "rec.json"
    gen = run("-m", "jaxdecode.cli", "generate", "--prompt", PROMPT, "--max-tokens", "24",
              "--seed", "3", "--record", str(rec), "--no-stream")
    assert gen.returncode == 0, gen.stderr
    ok = run("-m", "jaxdecode.cli", "replay", str(rec))
    assert ok.returncode == 0 and "identical" in ok.stdout, ok.stdout + ok.stderr
    data = json.loads(rec.read_text())
    data["output"]["token_ids"][5] = (data["output"]["token_ids"][5] + 1) % 4096
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    diverged = run("-m", "jaxdecode.cli", "replay", str(bad))
    assert diverged.returncode == 1 and "first divergence at step 6" in diverged.stdout


def test_sampling_X1_engine_batch_invariance(demo):
    model, params, tok = demo
    with jd.LLM(model, params, tok, max_slots=1, max_len=512) as one:
        alone = one.generate([PROMPT], SP)[0].token_ids
    others = ["import os\n" * k for k in (1, 20, 60)]
    with jd.LLM(model, params, tok, max_slots=6, max_len=512) as many:
        busy = [many.submit(o, jd.SamplingParams(seed=i, max_tokens=80, utf8_errors="replace"))
                for i, o in enumerate(others)]
        beside = many.submit(PROMPT, SP).result().token_ids
        last_slot = many.generate(others + [PROMPT], [SP] * 3 + [SP])[-1].token_ids
        [h.result() for h in busy]
    assert alone == beside == last_slot


def test_sampling_prefix_property_max_tokens_20_and_40(llm):
    short, long = llm.generate([PROMPT, PROMPT], [dataclasses.replace(SP, max_tokens=20),
                                                  dataclasses.replace(SP, max_tokens=40)])
    assert long.token_ids[:20] == short.token_ids


def test_backpressure_B1_save_in_one_process_restore_in_another(llm, tmp_path):
    sp = dataclasses.replace(SP, max_tokens=60, stop=("zzzz",))
    reference = llm.submit(PROMPT, sp).result()
    saved = tmp_path / "req"
    script = textwrap.dedent(f"""
        import time, jaxdecode as jd, models
        m, p, tok = models.demo()
        sp = jd.SamplingParams(temperature=0.9, seed=7, max_tokens=60, ignore_eos=True,
                               utf8_errors="replace", stop=("zzzz",))
        with jd.LLM(m, p, tok, max_slots=2, max_len=256) as llm:
            h = llm.submit({PROMPT!r}, sp)
            while h.selected < 15:
                time.sleep(0.001)
            llm.save_request(h, {str(saved)!r})
            print("saved", h.selected)
            h.cancel()
    """)
    out = run("-c", script)
    assert out.returncode == 0 and out.stdout.startswith("saved"), out.stderr
    at = int(out.stdout.split()[1])
    handle = llm.restore_request(str(saved))
    restored = handle.result(timeout=120)
    assert restored.token_ids == reference.token_ids and restored.text == reference.text
    assert restored.usage == reference.usage
    seqs = [e.seq for e in restored.events if e.seq is not None]
    assert seqs[0] == 1 + at and seqs == sorted(set(seqs))  # the stream continues its numbering


def test_sampling_X1_invariance_with_hypothesis_chosen_neighbours(demo, llm):
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    alone = llm.generate([PROMPT], dataclasses.replace(SP, max_tokens=16))[0].token_ids
    neighbour = st.tuples(st.integers(1, 40), st.integers(1, 30), st.floats(0.0, 1.5),
                          st.integers(0, 2**31))

    @settings(max_examples=6, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.lists(neighbour, max_size=3), st.integers(0, 3))
    def check(neighbours, position):
        prompts = [[(7 * i + j) % 4000 + 1 for j in range(n)]
                   for i, (n, _, _, _) in enumerate(neighbours)]
        settings_ = [jd.SamplingParams(max_tokens=m, temperature=t, seed=s,
                                       utf8_errors="replace") for _, m, t, s in neighbours]
        at = min(position, len(prompts))
        prompts.insert(at, PROMPT)
        settings_.insert(at, dataclasses.replace(SP, max_tokens=16))
        assert llm.generate(prompts, settings_)[at].token_ids == alone

    check()


def test_replay_X11_a_record_without_batch_invariance_replays_as_made_and_says_so(tmp_path):
    """`generate --no-batch-invariant` records mode "none"; `replay` rebuilds the engine without
    invariance (no environment difference), and a divergence says the original ran without it."""
    rec = tmp_path / "fast.json"
    gen = run("-m", "jaxdecode.cli", "generate", "--prompt", PROMPT, "--max-tokens", "12",
              "--seed", "3", "--record", str(rec), "--no-stream", "--no-batch-invariant")
    assert gen.returncode == 0, gen.stderr
    data = json.loads(rec.read_text())
    assert data["batch_invariance"]["mode"] == "none" and not data["batch_invariance"]["bitwise"]
    ok = run("-m", "jaxdecode.cli", "replay", str(rec))
    assert ok.returncode == 0 and "identical" in ok.stdout, ok.stdout + ok.stderr
    assert "batch_invariance" not in ok.stdout
    data["output"]["token_ids"][3] = (data["output"]["token_ids"][3] + 1) % 4096
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    diverged = run("-m", "jaxdecode.cli", "replay", str(bad))
    assert diverged.returncode == 1 and "without batch invariance" in diverged.stdout


def test_replay_X11_names_a_batch_invariance_mode_other_than_recorded(demo, llm):
    """A record of the invariant engine replayed on a `batch_invariant=False` one: the
    environment difference names `batch_invariance` and both modes."""
    model, params, tok = demo
    record = llm.generate([PROMPT], dataclasses.replace(SP, max_tokens=6))[0].record
    with jd.LLM(model, params, tok, max_slots=llm.max_slots, max_len=llm.max_len,
                batch_invariant=False) as fast:
        report = jd.replay(record, fast)
    named = [d for d in report.environment_differences if d.startswith("batch_invariance")]
    assert named and "'none'" in named[0] and "'row_tiles'" in named[0], report.describe()
