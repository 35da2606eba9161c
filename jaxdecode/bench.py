"""`jaxdecode bench`: decode throughput measured side by side in one run.

Figures are ratios taken in the same process on the same weights: jaxdecode's on-device loop
against Hugging Face PyTorch `generate`, and the batch-1 step time against the memory-bandwidth
roofline (parameter bytes read per step / a measured GEMV bandwidth). Performance goals live
here, never in timed unit tests.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import platform
import statistics
import sys
import time
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxdecode.config import SamplingParams
from jaxdecode.decode import compilation_count, generate


@dataclasses.dataclass
class BenchConfig:
    batches: Sequence[int] = (1, 16)
    prompt_len: int = 16
    new_tokens: int = 64
    repeats: int = 3
    seed: int = 0


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "backend": jax.default_backend(),
            "device": jax.devices()[0].device_kind, "jax": jax.__version__,
            "jaxlib": jax.lib.__version__ if hasattr(jax.lib, "__version__") else jax.__version__}


def gemv_bandwidth(mbytes: int = 128, repeats: int = 20) -> float:
    """Bytes/s streamed by an f32 matrix-vector product over a matrix of `mbytes` MB."""
    cols = 4096
    rows = mbytes * 2**20 // (4 * cols)
    mat = jax.random.normal(jax.random.key(0), (rows, cols), jnp.float32)
    vec = jnp.ones((cols,), jnp.float32)
    f = jax.jit(lambda m, v: m @ v)
    f(mat, vec).block_until_ready()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        f(mat, vec).block_until_ready()
        times.append(time.perf_counter() - t0)
    return mat.nbytes / min(times)


def step_bytes(params: Any) -> int:
    """Bytes a decode step must read: every parameter except the embedding table's unused rows."""
    total = sum(x.nbytes for x in jax.tree.leaves(params))
    if isinstance(params, dict) and "embed" in params and "lm_head" in params:
        total -= params["embed"].nbytes
    return total


def _median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return rng.integers(3, vocab, size=(batch, length)).tolist()


def time_jaxdecode(model, params, batch: int, cfg: BenchConfig) -> dict:
    ids = prompts(batch, cfg.prompt_len, model.config.vocab_size, cfg.seed)
    sp = SamplingParams(temperature=0.0, max_tokens=cfg.new_tokens, ignore_eos=True)
    short = SamplingParams(temperature=0.0, max_tokens=cfg.new_tokens // 8, ignore_eos=True)
    run = lambda s: generate(model, params, ids, s).token_ids  # noqa: E731
    c0 = compilation_count()
    run(sp), run(short)  # warm-up (compiles)
    warm_compiles = compilation_count() - c0
    c1 = compilation_count()
    total = _median_time(lambda: run(sp), cfg.repeats)
    part = _median_time(lambda: run(short), cfg.repeats)
    step = (total - part) / (cfg.new_tokens - cfg.new_tokens // 8)
    if step <= 0:  # too few tokens to separate the prefill: fall back to the plain average
        step = total / cfg.new_tokens
    return {"seconds": total, "tokens_per_s": batch * cfg.new_tokens / total,
            "step_ms": step * 1e3, "compiles_warmup": warm_compiles,
            "compiles_after_warmup": compilation_count() - c1}


def time_hf(hf_model, batch: int, cfg: BenchConfig, vocab: int, threads: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    ids = torch.tensor(prompts(batch, cfg.prompt_len, vocab, cfg.seed))
    kwargs = dict(max_new_tokens=cfg.new_tokens, min_new_tokens=cfg.new_tokens, do_sample=False,
                  attention_mask=torch.ones_like(ids), pad_token_id=0)

    def run():
        with torch.inference_mode():
            hf_model.generate(ids, **kwargs)

    run()
    total = _median_time(run, cfg.repeats)
    return {"seconds": total, "tokens_per_s": batch * cfg.new_tokens / total}


def run(model, params, cfg: BenchConfig, hf_model=None, hf_threads: Optional[int] = None,
        progress=None) -> dict:
    """Measure every batch size; `hf_model` (same weights) adds the HF column and ratios."""
    report: dict = {"machine": machine(), "config": dataclasses.asdict(cfg),
                    "model": {k: v for k, v in dataclasses.asdict(model.config).items()
                              if not isinstance(v, (tuple, list)) or len(v) < 16},
                    "param_bytes": int(sum(x.nbytes for x in jax.tree.leaves(params))),
                    "step_bytes": int(step_bytes(params))}
    bw = gemv_bandwidth()
    report["gemv_bandwidth_gb_s"] = bw / 1e9
    report["roofline_step_ms"] = report["step_bytes"] / bw * 1e3
    rows = []
    from tqdm.auto import tqdm

    for batch in tqdm(cfg.batches, desc="bench", unit="batch", file=sys.stderr):
        row = {"batch": batch, "jaxdecode": time_jaxdecode(model, params, batch, cfg)}
        if hf_model is not None:
            row["hf"] = time_hf(hf_model, batch, cfg, model.config.vocab_size,
                                hf_threads or os.cpu_count())
            row["ratio"] = row["jaxdecode"]["tokens_per_s"] / row["hf"]["tokens_per_s"]
        if batch == 1:
            report["roofline_fraction_batch1"] = report["roofline_step_ms"] / row["jaxdecode"]["step_ms"]
        rows.append(row)
        if progress:
            progress(row)
    report["rows"] = rows
    return report


def format_table(report: dict) -> str:
    lines = [f"machine: {report['machine']['cpu']} ({report['machine']['cores']} cores), "
             f"{report['machine']['backend']}, jax {report['machine']['jax']}",
             f"params: {report['param_bytes'] / 1e6:.1f} MB; bytes read per step "
             f"{report['step_bytes'] / 1e6:.1f} MB; GEMV bandwidth "
             f"{report['gemv_bandwidth_gb_s']:.2f} GB/s -> roofline step "
             f"{report['roofline_step_ms']:.2f} ms",
             "| batch | jaxdecode tok/s | step ms | HF tok/s | ratio |",
             "|---:|---:|---:|---:|---:|"]
    for row in report["rows"]:
        hf = row.get("hf", {}).get("tokens_per_s")
        hf_cell = "-" if hf is None else f"{hf:.1f}"
        ratio_cell = "-" if hf is None else f"{row['ratio']:.2f}x"
        lines.append(f"| {row['batch']} | {row['jaxdecode']['tokens_per_s']:.1f} | "
                     f"{row['jaxdecode']['step_ms']:.2f} | {hf_cell} | {ratio_cell} |")
    if "roofline_fraction_batch1" in report:
        lines.append(f"batch-1 step time vs roofline: {report['roofline_fraction_batch1'] * 100:.0f}% "
                     f"of the bandwidth limit")
    return "\n".join(lines)


# -- search and speculation (SPEC §10) ----------------------------------------------------------

def _timed(fn, repeats: int) -> tuple[float, Any]:
    result = fn()  # warm-up (compiles)
    return _median_time(fn, repeats), result


def time_beam_search(model, params, cfg: BenchConfig, batch: int = 1, num_beams: int = 4,
                     prompt_ids: Optional[Sequence[Sequence[int]]] = None) -> dict:
    """Beam search against greedy decoding on the same prompts and model.

    EOS is disabled for both (every beam runs to `new_tokens`), so the work is fixed:
    tokens_per_s counts output tokens of the returned sequences (batch * new_tokens / s);
    beam_row_tokens_per_s counts every beam's tokens (x num_beams)."""
    from jaxdecode.beam import beam_search

    ids = [list(p) for p in prompt_ids] if prompt_ids is not None else prompts(
        batch, cfg.prompt_len, model.config.vocab_size, cfg.seed)
    n = cfg.new_tokens
    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    greedy_s, _ = _timed(lambda: generate(model, params, ids, sp).token_ids, cfg.repeats)
    beam_s, _ = _timed(lambda: beam_search(model, params, ids, num_beams=num_beams,
                                           max_new_tokens=n, eos_token_ids=()).token_ids,
                       cfg.repeats)
    b = len(ids)
    return {"batch": b, "num_beams": num_beams, "new_tokens": n,
            "greedy_tokens_per_s": b * n / greedy_s, "beam_tokens_per_s": b * n / beam_s,
            "beam_row_tokens_per_s": b * num_beams * n / beam_s,
            "beam_vs_greedy": greedy_s / beam_s}


# A code-editing prompt: a function, then the start of its edited copy. The continuation can
# reuse long spans of the prompt, the case prompt lookup and small drafts are made for.
CODE_EDIT_PROMPT = '''def moving_average(values, window):
    """Return the moving average of values over window items."""
    result = []
    total = 0
    for index, value in enumerate(values):
        total += value
        if index >= window:
            total -= values[index - window]
        if index >= window - 1:
            result.append(total / window)
    return result


# The same function, with values renamed to items.
def moving_average(items, window):'''


def time_speculative(target, target_params, draft=None, draft_params=None,
                     cfg: Optional[BenchConfig] = None, ks: Sequence[int] = (2, 4, 6),
                     batch: int = 1, prompt_ids: Optional[Sequence[Sequence[int]]] = None,
                     temperature: float = 0.0) -> dict:
    """Speculative decoding (a draft model when given, and prompt lookup) for each k in `ks`
    against plain decoding of the target: same prompts, same settings (greedy by default, so
    the outputs must be identical), one process. Plain decoding is timed before and after the
    speculative runs and the faster of the two is the baseline (drift shows as their gap).

    Reports tokens/s of each, the speed-up, the mean accepted length (tokens per target verify
    pass; 1.0 means the draft never helps) and the acceptance rate (accepted / proposed)."""
    from jaxdecode.speculative import PROMPT_LOOKUP, speculative_generate

    cfg = cfg or BenchConfig()
    ids = [list(p) for p in prompt_ids] if prompt_ids is not None else prompts(
        batch, cfg.prompt_len, target.config.vocab_size, cfg.seed)
    n = cfg.new_tokens
    sp = SamplingParams(temperature=temperature, max_tokens=n, ignore_eos=True, seed=cfg.seed)
    plain = lambda: generate(target, target_params, ids, sp)  # noqa: E731
    first_s, base = _timed(plain, cfg.repeats)
    b = len(ids)
    kinds = [(PROMPT_LOOKUP, PROMPT_LOOKUP, None)]
    if draft is not None:
        kinds.insert(0, ("draft_model", draft, draft_params))
    rows = []
    for name, d, dp in kinds:
        for k in ks:
            secs, out = _timed(lambda: speculative_generate(target, target_params, d, dp, ids,
                                                            sp, k=k), cfg.repeats)
            s = out.stats
            rows.append({"draft": name, "k": k, "seconds": secs,
                         "mean_accepted_length": s["mean_accepted_length"],
                         "acceptance_rate": float(s["accepted"].sum() / max(1, s["proposed"].sum())),
                         "same_tokens_as_plain": bool((out.token_ids == base.token_ids).all())})
    last_s, _ = _timed(plain, cfg.repeats)
    base_s = min(first_s, last_s)
    for r in rows:
        secs = r.pop("seconds")
        r.update(tokens_per_s=b * n / secs, speedup=base_s / secs)
    best = max(rows, key=lambda r: r["speedup"])
    return {"batch": b, "ks": list(ks), "new_tokens": n, "temperature": temperature,
            "prompt_tokens": [len(p) for p in ids], "plain_tokens_per_s": b * n / base_s,
            "plain_drift": max(first_s, last_s) / base_s - 1, "rows": rows,
            "best": {"draft": best["draft"], "k": best["k"], "speedup": best["speedup"]}}


def format_search(beam: Optional[dict] = None, spec: Optional[dict] = None) -> str:
    lines = []
    if beam:
        lines.append(f"beam search (batch {beam['batch']}, {beam['num_beams']} beams, "
                     f"{beam['new_tokens']} tokens): {beam['beam_tokens_per_s']:.1f} tok/s vs "
                     f"greedy {beam['greedy_tokens_per_s']:.1f} tok/s "
                     f"({beam['beam_vs_greedy']:.2f}x); all beams "
                     f"{beam['beam_row_tokens_per_s']:.1f} tok/s")
    if spec:
        lines.append(f"speculative (batch {spec['batch']}, T={spec['temperature']}, "
                     f"{spec['new_tokens']} tokens): plain {spec['plain_tokens_per_s']:.1f} tok/s "
                     f"(drift between its two timings {spec['plain_drift'] * 100:.0f}%)")
        lines.append("| draft | k | tok/s | speed-up | mean accepted length | acceptance | "
                     "same tokens |")
        lines.append("|---|---:|---:|---:|---:|---:|---|")
        for r in spec["rows"]:
            lines.append(f"| {r['draft']} | {r['k']} | {r['tokens_per_s']:.1f} | "
                         f"{r['speedup']:.2f}x | {r['mean_accepted_length']:.2f} | "
                         f"{r['acceptance_rate']:.2f} | {r['same_tokens_as_plain']} |")
    return "\n".join(lines)


# -- host pipeline cost (issue #3) --------------------------------------------------------------

def _stop_strings(n: int) -> list[str]:
    """n stop strings that never occur in source text: the matcher scans the whole stream."""
    return [f"<<STOP{i}>>\u2063" for i in range(n)]


def host_cost(tokenizer, token_ids: Sequence[int], stops_counts: Sequence[int] = (1, 4, 16),
              repeats: int = 5) -> list[dict]:
    """Median µs per token of detokenize + stop match + stream emit, side by side with HF
    `tokenizers.decoders.DecodeStream` plus a fixed `max_len - 1` hold-back check."""
    from tokenizers.decoders import DecodeStream

    from jaxdecode.host import OrderedStream, TextPipeline

    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    rows = []
    for n in stops_counts:
        stops = _stop_strings(n)

        def ours():
            pipe = TextPipeline(tokenizer, stop=stops)
            stream = OrderedStream("bench", max_buffered=len(token_ids) + 8)
            stream.start()
            for tid in token_ids:
                text = pipe.push(tid).text
                if text:
                    stream.emit(text)
            stream.emit(pipe.finish("max_output_tokens").text)

        hold = max(len(s) for s in stops) - 1

        def reference():
            ds = DecodeStream(skip_special_tokens=True)
            buffer, sent = "", []
            for tid in token_ids:
                piece = ds.step(backend, tid)
                if piece:
                    buffer += piece
                    if any(s in buffer for s in stops):
                        break
                    if len(buffer) > hold:
                        sent.append(buffer[:-hold])
                        buffer = buffer[-hold:]
            sent.append(buffer)

        per_token = lambda fn: statistics.median(  # noqa: E731
            _median_time(fn, 1) for _ in range(repeats)) / len(token_ids) * 1e6
        ours_us, ref_us = per_token(ours), per_token(reference)
        rows.append({"stops": n, "jaxdecode_us_per_token": ours_us,
                     "hf_decodestream_us_per_token": ref_us, "ratio": ref_us / ours_us})
    return rows


# -- engine with streaming vs the raw jitted loop (issue #3) ------------------------------------

def engine_vs_raw(model, params, tokenizer, batch: int, new_tokens: int, prompt_len: int = 16,
                  repeats: int = 3, seed: int = 0) -> dict:
    """Tokens/s of `LLM` with every request streamed (deltas read by a consumer thread each)
    against `generate` on the same model, batch and greedy settings."""
    import threading

    from jaxdecode.engine import LLM

    ids = prompts(batch, prompt_len, model.config.vocab_size, seed)
    sp = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True,
                        utf8_errors="replace")
    raw = lambda: generate(model, params, ids, sp).token_ids  # noqa: E731
    raw()
    raw_s = _median_time(raw, repeats)
    max_len = min(model.config.max_len, 1 << (prompt_len + new_tokens).bit_length())
    with LLM(model, params, tokenizer, max_slots=batch, max_len=max_len) as llm:
        llm.warmup(prompt_len)

        def streamed():
            handles = [llm.submit(p, sp) for p in ids]
            readers = [threading.Thread(target=lambda h=h: sum(1 for _ in h.events()))
                       for h in handles]
            for t in readers:
                t.start()
            for t in readers:
                t.join()
            assert all(h.result().usage.selected_tokens == new_tokens for h in handles)

        streamed()
        engine_s = _median_time(streamed, repeats)
    tokens = batch * new_tokens
    return {"batch": batch, "raw_tokens_per_s": tokens / raw_s,
            "engine_tokens_per_s": tokens / engine_s, "fraction": raw_s / engine_s}


# -- constraints (jaxdecode/constraints) -------------------------------------------------------

CONSTRAINT_SCHEMAS = {
    # the three schemas of tests/test_constraints.py, and the generic json_object
    "flat": {"type": "json_schema", "json_schema": {"schema": {
        "type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                         "age": {"type": "integer", "maxDigits": 3},
                                         "ok": {"type": "boolean"}},
        "required": ["name", "age", "ok"]}}},
    "enum": {"type": "json_schema", "json_schema": {"schema": {
        "enum": ["red", "green", "blue", 42, None]}}},
    "nested": {"type": "json_schema", "json_schema": {"schema": {
        "type": "object", "properties": {
            "id": {"type": "integer", "maxDigits": 4},
            "tags": {"type": "array", "items": {"type": "integer", "maxDigits": 3}, "maxItems": 4},
            "meta": {"type": "object", "properties": {"k": {"type": "string", "maxLength": 5}},
                     "required": ["k"]}},
        "required": ["id", "tags", "meta"]}}},
    "json_object": {"type": "json_object"},
}


def time_constraints(model, params, tokenizer, batches: Sequence[int] = (1, 16), steps: int = 32,
                     repeats: int = 5, prompt: str = "config = ",
                     step_modes: Sequence[str] = ("flat", "json_object")) -> dict:
    """Decode-step time with a constraint on every row vs none, and index compile times.

    compile: per schema, a cold outlines-core compile (private cache) -> states, edges, seconds,
    plus the device table build (bucketed sizes, dense or CSR lookup).
    steps: per batch size, the median time of one `decode_step_jit` over `steps` chained steps,
    for "none" and for each of `step_modes` (every row constrained), measured round-robin in the
    same process so that machine load hits every mode alike. Rows that end early keep paying
    the full step (the step is computed for every row), so the figures compare like with like.
    """
    from jaxdecode import constraints
    from jaxdecode.decode import decode_step_jit, prepare
    from jaxdecode.tokenization import encode

    cfg = model.config
    eos = tuple(cfg.eos_token_ids)
    vocab = constraints.vocab_for(tokenizer, cfg.vocab_size, exclude_ids=eos)
    cache = constraints.IndexCache()
    report: dict = {"machine": machine(), "steps": steps, "repeats": repeats, "compile": {},
                    "rows": []}
    for name, rf in CONSTRAINT_SCHEMAS.items():
        t0 = time.perf_counter()
        regex = constraints.regex_for(constraints.validate_response_format(rf))
        t1 = time.perf_counter()
        compiled = constraints.compile_regex(regex, vocab, cache)
        t2 = time.perf_counter()
        bundle = constraints.tables._build([compiled], cfg.vocab_size,
                                           constraints.tables.DENSE_MAX_ENTRIES)
        jax.block_until_ready(bundle.tables)
        t3 = time.perf_counter()
        report["compile"][name] = {
            "schema_to_regex_ms": (t1 - t0) * 1e3, "index_compile_s": compiled.compile_seconds,
            "compile_total_s": t2 - t1, "table_build_ms": (t3 - t2) * 1e3,
            "states": compiled.num_states, "edges": compiled.num_edges,
            "table_states": int(bundle.tables.num_states),
            "lookup": "dense" if bundle.tables.dense else "csr",
            "device_bytes": int(sum(x.nbytes for x in jax.tree.leaves(bundle.tables)))}

    ids = encode(tokenizer, prompt)
    modes = ("none",) + tuple(step_modes) + ("idle",)
    for batch in batches:
        states = {}
        for mode in modes:
            rf = (None if mode == "none" else
                  CONSTRAINT_SCHEMAS[step_modes[0] if mode == "idle" else mode])
            sp = [SamplingParams(seed=r, max_tokens=steps, response_format=rf)
                  for r in range(batch)]
            states[mode] = prepare(model, params, [ids] * batch, sp, steps, None,
                                   tokenizer=tokenizer)[0]
        # "idle": the tables are on the device but no row is constrained (e.g. an engine whose
        # constrained slots are free): the lax.cond skips the grammar work
        states["idle"] = states["idle"].replace(
            grammar_state=jnp.full((batch,), -1, jnp.int32))

        step = functools.partial(decode_step_jit, model, params, top_logprobs=0)
        row = {"batch": batch, **_step_times({m: (step, states[m]) for m in modes}, steps,
                                             repeats)}
        for mode in modes[1:]:
            # the grammar work alone (mask + next state), jitted, on this batch's tables/states
            st = states[mode]
            logits = jax.random.normal(jax.random.key(0), (batch, cfg.vocab_size), jnp.float32)
            tok = jnp.zeros((batch,), jnp.int32)
            ops = jax.jit(lambda x, g, s, e, t: (constraints.mask_logits(x, g, s, e),
                                                 constraints.next_state(g, s, t)))
            args = (logits, st.grammar, st.grammar_state, st.rows.eos_mask, tok)
            jax.block_until_ready(ops(*args))
            row[f"{mode}_grammar_ops_ms"] = _median_time(
                lambda: jax.block_until_ready(ops(*args)), 50) * 1e3
        report["rows"].append(row)
    return report


def _step_times(runs: dict, steps: int, repeats: int) -> dict:
    """Decode-step time per mode: `runs[mode] = (step, state)`, `step(state) -> (state, out)`
    jitted; `steps` chained steps timed (the state copy is not), modes measured round-robin
    in the same process so that machine load hits every mode alike, after one warm-up round.
    Keys: <mode>_step_ms (median), <mode>_step_ms_min (least disturbed by load),
    <mode>_overhead vs the first mode, compiles_warmup, compiles_after_warmup."""
    def chain(step, state) -> float:  # seconds per step
        state = jax.block_until_ready(jax.tree.map(jnp.copy, state))
        t0 = time.perf_counter()
        for _ in range(steps):
            state, out = step(state)
        jax.block_until_ready(out.token)
        return (time.perf_counter() - t0) / steps

    c0 = compilation_count()
    for step, state in runs.values():  # warm-up (compiles)
        chain(step, state)
    c1 = compilation_count()
    times: dict = {m: [] for m in runs}
    for _ in range(repeats):
        for mode, (step, state) in runs.items():
            times[mode].append(chain(step, state))
    row = {"compiles_warmup": c1 - c0, "compiles_after_warmup": compilation_count() - c1}
    for mode in runs:
        row[f"{mode}_step_ms"] = statistics.median(times[mode]) * 1e3
        row[f"{mode}_step_ms_min"] = min(times[mode]) * 1e3
    base = next(iter(runs))
    for mode in list(runs)[1:]:
        row[f"{mode}_overhead"] = row[f"{mode}_step_ms"] / row[f"{base}_step_ms"] - 1
    return row


def _trivial_processor(logits, ctx):
    """The benchmark's custom processor: one elementwise op on the logits."""
    return logits * 1.0001


def time_research(model, params, batches: Sequence[int] = (1, 16), steps: int = 32,
                  repeats: int = 5, capture_layer: int = 1) -> dict:
    """Decode-step time with the research API (issue #16) vs none: one trivial custom
    processor ("processor"), the capture of one layer's hidden state ("capture"), both, with
    the same chained `decode_step_jit` timing as `time_constraints` (rows sampled, T = 1)."""
    from jaxdecode import research
    from jaxdecode.decode import decode_step_jit, prepare

    options = {"none": {},
               "processor": dict(processors=[research.LogitProcessor(_trivial_processor)]),
               "capture": dict(return_hidden_states=(capture_layer,)),
               "both": dict(processors=[research.LogitProcessor(_trivial_processor)],
                            return_hidden_states=(capture_layer,))}
    report: dict = {"machine": machine(), "steps": steps, "repeats": repeats,
                    "capture_layer": capture_layer, "rows": []}
    ids = prompts(max(batches), 16, model.config.vocab_size, 0)
    for batch in batches:
        runs = {}
        sp = [SamplingParams(seed=r, max_tokens=steps + 1, ignore_eos=True)
              for r in range(batch)]
        for mode, kwargs in options.items():
            setup = research.configure(model, **kwargs)
            state = prepare(model, params, ids[:batch], sp, steps + 1, None, research=setup)[0]
            config, args = (None, None) if setup is None else (setup.config, setup.args)
            runs[mode] = (functools.partial(decode_step_jit, model, params, top_logprobs=0,
                                            research=config, research_args=args), state)
        report["rows"].append({"batch": batch, **_step_times(runs, steps, repeats)})
    return report


def format_research_table(report: dict) -> str:
    modes = [k[:-len("_step_ms")] for k in report["rows"][0] if k.endswith("_step_ms")]
    lines = [f"decode step ms with the research API (median of {report['repeats']} x "
             f"{report['steps']} chained steps; capture = layer {report['capture_layer']}):",
             "| batch | " + " | ".join(modes) + " |", "|---:|" + "---:|" * len(modes)]
    for row in report["rows"]:
        cells = [f"{row['none_step_ms']:.3f}"] + [
            f"{row[m + '_step_ms']:.3f} ({row[m + '_overhead'] * 100:+.1f}%)" for m in modes[1:]]
        lines.append(f"| {row['batch']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_constraints_table(report: dict) -> str:
    lines = ["| schema | states | edges | lookup | index compile s | table build ms |",
             "|---|---:|---:|---|---:|---:|"]
    for name, c in report["compile"].items():
        lines.append(f"| {name} | {c['states']} | {c['edges']} | {c['lookup']} | "
                     f"{c['index_compile_s']:.3f} | {c['table_build_ms']:.1f} |")
    modes = [k[:-len("_step_ms")] for k in report["rows"][0] if k.endswith("_step_ms")]
    lines += ["", "| batch | " + " | ".join(f"{m} step ms (median / min)" for m in modes) + " |",
              "|---:|" + "---:|" * len(modes)]
    for row in report["rows"]:
        cells = []
        for m in modes:
            cell = f"{row[m + '_step_ms']:.2f}"
            if m != "none":
                cell += f" ({row[m + '_overhead'] * 100:+.0f}%)"
            cell += f" / min {row[m + '_step_ms_min']:.2f}"
            cells.append(cell)
        lines.append(f"| {row['batch']} | " + " | ".join(cells) + " |")
    lines.append("")
    for row in report["rows"]:
        ops = ", ".join(f"{k[:-len('_grammar_ops_ms')]} {v:.3f} ms" for k, v in row.items()
                        if k.endswith("_grammar_ops_ms"))
        lines.append(f"batch {row['batch']}: grammar mask + next state alone: {ops}")
    return "\n".join(lines)


# -- time to first token (issue #8) -------------------------------------------------------------

def ttft(model, params, lengths: Sequence[int], hf_model=None, hf_threads: Optional[int] = None,
         repeats: int = 3) -> list[dict]:
    """Seconds from a prompt of each length to its first token: prefill + one selection (batch 1,
    greedy), jaxdecode's on-device loop and, when given, HF `generate(max_new_tokens=1)`."""
    rows = []
    sp = SamplingParams(temperature=0.0, max_tokens=1)
    for n in lengths:
        if n >= model.config.max_len:
            continue
        ids = prompts(1, n, model.config.vocab_size, n)
        first = lambda: generate(model, params, ids, sp).token_ids  # noqa: E731
        first()
        row = {"prompt_len": n, "jaxdecode_s": _median_time(first, repeats)}
        if hf_model is not None:
            import torch

            torch.set_num_threads(hf_threads or os.cpu_count())
            tokens = torch.tensor(ids)

            def hf_first():
                with torch.inference_mode():
                    hf_model.generate(tokens, attention_mask=torch.ones_like(tokens),
                                      max_new_tokens=1, do_sample=False, pad_token_id=0)

            hf_first()
            row["hf_s"] = _median_time(hf_first, repeats)
        rows.append(row)
    return rows


# -- the report: JSON + PNG plots + a markdown table (issue #8) --------------------------------

def write_report(report: dict, out_dir: str) -> list[str]:
    """Write report.json, report.md and PNG plots into `out_dir`; returns the paths written."""
    import json

    import matplotlib  # the dev extra; `jaxdecode bench --report` checks for it first
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    written = []
    path = os.path.join(out_dir, "report.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=2, default=str)
    written.append(path)

    rows = report["rows"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    batches = [r["batch"] for r in rows]
    ax.plot(batches, [r["jaxdecode"]["tokens_per_s"] for r in rows], "o-", label="jaxdecode")
    if all("hf" in r for r in rows):
        ax.plot(batches, [r["hf"]["tokens_per_s"] for r in rows], "s--", label="HF PyTorch")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch")
    ax.set_ylabel("decode tokens/s")
    ax.set_title(f"decode throughput ({report['machine']['backend']})")
    ax.legend()
    fig.tight_layout()
    written.append(os.path.join(out_dir, "throughput.png"))
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)

    if report.get("ttft"):
        fig, ax = plt.subplots(figsize=(6, 3.5))
        t = report["ttft"]
        ax.plot([r["prompt_len"] for r in t], [r["jaxdecode_s"] * 1e3 for r in t], "o-",
                label="jaxdecode")
        if all("hf_s" in r for r in t):
            ax.plot([r["prompt_len"] for r in t], [r["hf_s"] * 1e3 for r in t], "s--",
                    label="HF PyTorch")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("time to first token (ms)")
        ax.legend()
        fig.tight_layout()
        written.append(os.path.join(out_dir, "ttft.png"))
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)

    md = ["# jaxdecode performance report", "",
          f"Produced by `jaxdecode bench --report` on {report['machine']['cpu']} "
          f"({report['machine']['cores']} cores), backend `{report['machine']['backend']}` "
          f"({report['machine']['device']}), jax {report['machine']['jax']}. Every figure "
          "comes from this one run; ratios compare measurements taken side by side.", "",
          "## Decode throughput", "", format_table(report), ""]
    if report.get("ttft"):
        md += ["## Time to first token (batch 1)", "", "| prompt | jaxdecode ms | HF ms |",
               "|---:|---:|---:|"]
        md += [f"| {r['prompt_len']} | {r['jaxdecode_s'] * 1e3:.1f} | "
               f"{r['hf_s'] * 1e3:.1f} |" if "hf_s" in r else
               f"| {r['prompt_len']} | {r['jaxdecode_s'] * 1e3:.1f} | - |" for r in report["ttft"]]
        md.append("")
    for key, title in (("host_cost", "Host pipeline cost per token"),
                       ("engine", "Engine with streaming vs the raw jitted loop"),
                       ("recompiles", "Recompilations after warm-up (mixed engine requests)"),
                       ("beam", "Beam search vs greedy"),
                       ("speculative", "Speculative decoding vs plain (demo model and draft)"),
                       ("constraints", "Structured output: step time and index compile time"),
                       ("compiles", "Compilations")):
        if report.get(key) is not None:
            md += [f"## {title}", "", "```", json.dumps(report[key], indent=2, default=str), "```",
                   ""]
    md += ["![throughput](throughput.png)"] + (["![ttft](ttft.png)"] if report.get("ttft") else [])
    path = os.path.join(out_dir, "report.md")
    with open(path, "w") as f:
        f.write("\n".join(md) + "\n")
    written.append(path)
    return written


def recompiles_after_warmup(model, params, tokenizer, requests: int = 1000, max_slots: int = 8,
                            max_len: int = 512, max_prompt_len: int = 64, seed: int = 0) -> dict:
    """`LLM.warmup`, then `requests` mixed requests (prompt lengths, output lengths, sampling
    settings, stop strings, arrival pattern): the compilations after warm-up must be zero."""
    import random

    from jaxdecode.engine import LLM

    rng = random.Random(seed)
    vocab = model.config.vocab_size
    with LLM(model, params, tokenizer, max_slots=max_slots, max_len=max_len) as llm:
        t0 = time.perf_counter()
        warm = llm.warmup(max_prompt_len)
        warm_s = time.perf_counter() - t0
        before = compilation_count()
        handles = []
        for i in range(requests):
            prompt = [rng.randrange(1, vocab) for _ in range(rng.randint(1, max_prompt_len))]
            sp = SamplingParams(max_tokens=rng.randint(1, 24), seed=i, utf8_errors="replace",
                                temperature=rng.choice([0.0, 0.7, 1.0]),
                                top_k=rng.choice([0, 20]), top_p=rng.choice([1.0, 0.9]),
                                repetition_penalty=rng.choice([1.0, 1.1]),
                                stop=rng.choice([(), ("\n\n",)]))
            handles.append(llm.submit(prompt, sp, block=True))
            if rng.random() < 0.05:
                time.sleep(0.002)
        ended = sum(h.result(timeout=600).finish_reason is not None for h in handles)
    return {"requests": requests, "ended": ended, "warmup_compiles": warm,
            "warmup_s": warm_s, "compiles_after_warmup": compilation_count() - before}
