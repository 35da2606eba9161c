"""The host side: the pipeline's cost per token (detokenize + stop match + stream) against HF
`DecodeStream`, the engine with streaming against the raw jitted loop, and recompilations
after `LLM.warmup` across many mixed requests."""

from __future__ import annotations

import statistics
import time
from typing import Sequence

from jaxdecode.cli.bench.timing import median_time, prompts
from jaxdecode.config import SamplingParams
from jaxdecode.device.decode import compilation_count, generate


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
            median_time(fn, 1) for _ in range(repeats)) / len(token_ids) * 1e6
        ours_us, ref_us = per_token(ours), per_token(reference)
        rows.append({"stops": n, "jaxdecode_us_per_token": ours_us,
                     "hf_decodestream_us_per_token": ref_us, "ratio": ref_us / ours_us})
    return rows


# -- engine with streaming vs the raw jitted loop (issue #3) ------------------------------------

def engine_vs_raw(model, params, tokenizer, batch: int, new_tokens: int, prompt_len: int = 16,
                  repeats: int = 3, seed: int = 0,
                  kv_cache_dtypes: Sequence[str] = ("auto",)) -> list[dict]:
    """Tokens/s of `LLM` with every request streamed (deltas read by a consumer thread each),
    one row per page-pool dtype of `kv_cache_dtypes`, against `generate` (timed once) on the
    same model, batch and greedy settings."""
    import threading

    from jaxdecode.engine import LLM

    ids = prompts(batch, prompt_len, model.config.vocab_size, seed)
    sp = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True,
                        utf8_errors="replace")
    raw = lambda: generate(model, params, ids, sp).token_ids  # noqa: E731
    raw()
    raw_s = median_time(raw, repeats)
    max_len = min(model.config.max_len, 1 << (prompt_len + new_tokens).bit_length())
    tokens, rows = batch * new_tokens, []
    for kv_cache_dtype in kv_cache_dtypes:
        with LLM(model, params, tokenizer, max_slots=batch, max_len=max_len,
                 kv_cache_dtype=kv_cache_dtype) as llm:
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
            engine_s = median_time(streamed, repeats)
        rows.append({"batch": batch, "kv_cache_dtype": kv_cache_dtype,
                     "raw_tokens_per_s": tokens / raw_s, "engine_tokens_per_s": tokens / engine_s,
                     "fraction": raw_s / engine_s})
    return rows




def recompiles_after_warmup(model, params, tokenizer, requests: int = 1000, max_slots: int = 8,
                            max_len: int = 512, max_prompt_len: int = 64, seed: int = 0) -> dict:
    """`LLM.warmup`, then `requests` mixed requests (prompt lengths, output lengths, sampling
    settings, stop strings, arrival pattern): the compilations after warm-up must be zero."""
    import random

    from jaxdecode.engine import LLM

    rng = random.Random(seed)
    vocab = model.config.vocab_size
    with LLM(model, params, tokenizer, max_slots=max_slots,
             max_len=min(max_len, model.config.max_len)) as llm:
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
