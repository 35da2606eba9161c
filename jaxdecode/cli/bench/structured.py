"""Structured output (jaxdecode/device/constraints): decode-step time with every row constrained
against none, and the index compile time per schema."""

from __future__ import annotations

import functools
import time
from typing import Sequence

import jax
import jax.numpy as jnp

from jaxdecode.cli.bench.timing import machine, median_time, step_times
from jaxdecode.config import SamplingParams


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


def _compile_times(tokenizer, cfg) -> dict:
    """Per schema: a cold outlines-core compile (private cache) -> states, edges, seconds, and
    the device table build."""
    from jaxdecode.device import constraints

    vocab = constraints.vocab_for(tokenizer, cfg.vocab_size,
                                  exclude_ids=tuple(cfg.eos_token_ids))
    cache = constraints.IndexCache()
    out = {}
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
        out[name] = {
            "schema_to_regex_ms": (t1 - t0) * 1e3, "index_compile_s": compiled.compile_seconds,
            "compile_total_s": t2 - t1, "table_build_ms": (t3 - t2) * 1e3,
            "states": compiled.num_states, "edges": compiled.num_edges,
            "table_states": int(bundle.tables.num_states),
            "lookup": "dense" if bundle.tables.dense else "csr",
            "device_bytes": int(sum(x.nbytes for x in jax.tree.leaves(bundle.tables)))}
    return out


def _grammar_ops_ms(st, batch: int, vocab_size: int) -> float:
    """The grammar work alone (mask + next state), jitted, on one batch's tables and states."""
    from jaxdecode.device import constraints

    logits = jax.random.normal(jax.random.key(0), (batch, vocab_size), jnp.float32)
    tok = jnp.zeros((batch,), jnp.int32)
    ops = jax.jit(lambda x, g, s, e, t: (constraints.mask_logits(x, g, s, e),
                                         constraints.next_state(g, s, t)))
    args = (logits, st.grammar, st.grammar_state, st.rows.eos_mask, tok)
    jax.block_until_ready(ops(*args))
    return median_time(lambda: jax.block_until_ready(ops(*args)), 50) * 1e3


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
    from jaxdecode.device.decode import StepConfig, decode_step_jit, prepare
    from jaxdecode.tokenization import encode

    cfg = model.config
    report: dict = {"machine": machine(), "steps": steps, "repeats": repeats,
                    "compile": _compile_times(tokenizer, cfg), "rows": []}
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

        step = functools.partial(decode_step_jit, params=params, config=StepConfig(model))
        row = {"batch": batch, **step_times({m: (step, states[m]) for m in modes}, steps,
                                            repeats)}
        for mode in modes[1:]:
            row[f"{mode}_grammar_ops_ms"] = _grammar_ops_ms(states[mode], batch, cfg.vocab_size)
        report["rows"].append(row)
    return report
