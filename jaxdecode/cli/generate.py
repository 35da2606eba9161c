"""`jaxdecode generate`: one prompt through the engine `jd.LLM`, streamed to the terminal (or
beam search through the engine's beam lane with --num-beams)."""

from __future__ import annotations

import dataclasses
import json
import sys
import time

from serving.loading import (add_batch_invariance_argument, add_kv_cache_dtype_argument,
                             add_quantization_argument, add_speculative_arguments, flag_error,
                             load_model, speculative_from_args)


def sampling_from_args(args):
    from jaxdecode.config import SamplingParams

    try:
        return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                              min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                              max_tokens=args.max_tokens, stop=tuple(args.stop or ()),
                              seed=args.seed, ignore_eos=args.ignore_eos)
    except ValueError as e:
        raise flag_error(e)


def _prompt(args) -> str:
    if args.prompt_file:
        with open(args.prompt_file, encoding="utf-8") as f:
            return f.read()
    if args.prompt is not None:
        return args.prompt
    raise SystemExit("--prompt or --prompt-file is required")


def cmd_generate(args) -> int:
    from jaxdecode.device.decode import bucket
    from jaxdecode.engine import LLM
    from jaxdecode.tokenization import encode

    prompt = _prompt(args)
    sp = sampling_from_args(args)
    if args.speculative is not None and args.num_beams > 1:
        raise SystemExit("--speculative: not with --num-beams (beam search runs its own lane)")
    if args.speculative is not None and args.record:
        raise SystemExit("--record: not with --speculative (a record does not pin the "
                         "speculative setting, so replay would run a plain engine)")
    model, params, tokenizer = load_model(args.model, quantization=args.quantization)
    speculative, _ = speculative_from_args(args, model, tokenizer)
    prompt_ids = encode(tokenizer, prompt)
    if args.num_beams > 1:
        return _generate_beams(args, model, params, tokenizer, prompt, prompt_ids, sp)
    max_len = min(model.config.max_len, bucket(len(prompt_ids) + sp.max_tokens + 1))
    stream = not (args.no_stream or args.json)
    t0 = time.perf_counter()
    first_delta_s = None
    try:
        with LLM(model, params, tokenizer, max_slots=1, max_len=max_len,
                 model_source=args.model, speculative=speculative,
                 batch_invariant=args.batch_invariant,
                 kv_cache_dtype=args.kv_cache_dtype) as llm:
            handle = llm.submit(prompt, sp)
            if stream:
                sys.stdout.write(prompt)
                for event in handle.events():
                    if event.kind == "delta":
                        first_delta_s = first_delta_s or time.perf_counter() - t0
                        sys.stdout.write(event.data["text"])
                        sys.stdout.flush()
            done = handle.result()
            spec_stats = llm.speculative_stats() if speculative else None
    except ValueError as e:
        raise flag_error(e)
    elapsed = time.perf_counter() - t0
    if args.record:
        done.record.save(args.record)
    _print_result(args, done, stream, elapsed, first_delta_s, spec_stats)
    return 0 if done.error is None else 1


def _print_result(args, done, stream: bool, elapsed: float, first_delta_s, spec_stats) -> None:
    """The JSON result (--json), the text (--no-stream), or the streamed text's status line."""
    if args.json:
        print(json.dumps({"text": done.text, "token_ids": list(done.token_ids),
                          "finish_reason": done.finish_reason and done.finish_reason.value,
                          "error": done.error and done.error.value,
                          "usage": dataclasses.asdict(done.usage),
                          "seconds": round(elapsed, 3),
                          **({"speculative": spec_stats} if spec_stats else {})},
                         ensure_ascii=False))
    elif not stream:
        print(done.text)
    else:
        sys.stdout.write("\n")
        status = done.finish_reason.value if done.finish_reason else f"failed: {done.error.value}"
        accepted = (f", mean accepted length {spec_stats['mean_accepted_length']:.2f}"
                    if spec_stats else "")
        print(f"[{status}; {done.usage.selected_tokens} tokens in {elapsed:.2f}s, "
              f"first text after {first_delta_s or 0:.2f}s{accepted}]", file=sys.stderr)


def _generate_beams(args, model, params, tokenizer, prompt, prompt_ids, sp) -> int:
    """Beam search through the engine's beam lane (`SamplingParams(num_beams=...)`): the best
    hypothesis, or every beam with its score under --json. Not streamed (beams are final only
    at the end); --temperature does not apply (beams rank raw log-probabilities)."""
    from jaxdecode.device.decode import bucket
    from jaxdecode.engine import LLM

    early = {"true": True, "false": False, "never": "never"}[args.early_stopping]
    try:
        sp = dataclasses.replace(sp, temperature=0.0, num_beams=args.num_beams, n=args.num_beams,
                                 length_penalty=args.length_penalty, early_stopping=early)
        max_len = min(model.config.max_len, bucket(len(prompt_ids) + sp.max_tokens + 1))
        with LLM(model, params, tokenizer, max_slots=1, max_len=max_len,
                 model_source=args.model, batch_invariant=args.batch_invariant,
                 kv_cache_dtype=args.kv_cache_dtype) as llm:
            done = llm.generate(prompt, sp)
    except ValueError as e:
        raise flag_error(e)
    if args.record:
        done[0].record.save(args.record)
    beams = [{"text": c.text, "token_ids": list(c.token_ids), "score": c.score,
              "finish_reason": c.finish_reason and c.finish_reason.value} for c in done]
    if args.json:
        print(json.dumps({"beams": beams, "finish_reason": beams[0]["finish_reason"]},
                         ensure_ascii=False))
    else:
        print(prompt + beams[0]["text"])
    return 0 if all(c.error is None for c in done) else 1


def add_parser(sub) -> None:
    g = sub.add_parser("generate", help="stream a completion to the terminal")
    g.add_argument("--model", default="demo", help="a local HF checkpoint directory, or 'demo'")
    src = g.add_mutually_exclusive_group()
    src.add_argument("--prompt")
    src.add_argument("--prompt-file")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.8)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", help="a stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--num-beams", type=int, default=1,
                   help="beam search with this width, all beams returned (printed at the end)")
    g.add_argument("--length-penalty", type=float, default=1.0,
                   help="beam scores: sum logprob / length ** this (with --num-beams)")
    g.add_argument("--early-stopping", choices=("true", "false", "never"), default="false",
                   help="when a beam search ends, with HF's meaning (with --num-beams)")
    g.add_argument("--no-stream", action="store_true", help="print the text once at the end")
    g.add_argument("--json", action="store_true", help="print one JSON object with text and usage")
    g.add_argument("--record", help="write the generation record (contract §11) to this JSON file")
    add_speculative_arguments(g)
    add_batch_invariance_argument(g)
    add_quantization_argument(g)
    add_kv_cache_dtype_argument(g)
    g.set_defaults(func=cmd_generate)
