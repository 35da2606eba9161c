"""The `jaxdecode` command: the composition root that wires `jaxdecode`, `models` and `serving`
together. Only this module of `jaxdecode` imports `models` / `serving`, inside the subcommands.

    jaxdecode generate [--model DIR|demo] [--prompt TEXT | --prompt-file F] [--max-tokens N] ...
        [--speculative prompt_lookup|demo-draft|DIR] [--num-speculative-tokens K]
        (streams through the engine `jd.LLM`: detokenizer, stop matcher, ordered stream)
    jaxdecode replay FILE [--model DIR|demo]
    jaxdecode serve [--model DIR|demo] [--host 127.0.0.1] [--port 8000] [--max-slots N] [--max-len N]
        [--api-key KEY] [--on-disconnect cancel|continue] [--max-queue N]
        [--speculative prompt_lookup|demo-draft|DIR] [--num-speculative-tokens K]
        [--mesh data=N,model=M] [--distributed]
        (the OpenAI-compatible HTTP server of `serving/`; multi-host: serving/README.md)
    jaxdecode bench [--model DIR|demo|CONFIG] [--batch N]... [--compare-hf] [--json FILE]
    jaxdecode bench --serve [--model DIR|demo | --url URL] [--requests N] [--concurrency C]...
        [--max-tokens N] [--max-slots N] [--json FILE]
        (the HTTP load test of `serving.loadtest`: streaming requests against `jaxdecode serve`)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from typing import Optional, Sequence

# Named random-weight configurations for `bench --model CONFIG` (HF LlamaConfig keywords).
BENCH_CONFIGS = {
    # The reference configuration of issue #2: Llama-like, ~29M parameters, fp32.
    "llama-512": dict(vocab_size=8192, hidden_size=512, intermediate_size=1376,
                      num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8,
                      max_position_embeddings=4096, rms_norm_eps=1e-5),
    # For accelerators (the default there): TinyLlama-like, ~1.1B parameters, run in bf16.
    "llama-1b": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                     num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4,
                     max_position_embeddings=2048, rms_norm_eps=1e-5),
    "llama-tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=256, rms_norm_eps=1e-5),
}


def load_model(spec: str, dtype: Optional[str] = None):
    """(model, params, tokenizer) from "demo" or a local Hugging Face directory."""
    import models

    if spec == "demo":
        return models.demo()
    if not os.path.isdir(spec):
        raise SystemExit(f"--model: {spec!r} is neither 'demo' nor a checkpoint directory")
    return models.load(spec, dtype=dtype)


# the engine's `speculative=` fields (SpeculativeConfig.parse errors) -> the flags setting them
SPECULATIVE_FLAGS = {"speculative": "--speculative", "speculative.draft": "--speculative",
                     "speculative.k": "--num-speculative-tokens",
                     "speculative.ngram_max": "--ngram-max", "speculative.ngram_min": "--ngram-min"}


def flag_error(e: ValueError) -> SystemExit:
    """An engine or SamplingParams ValueError ("field: ...") as an exit naming the flag."""
    field = str(e).split(":")[0]
    return SystemExit(f"{SPECULATIVE_FLAGS.get(field, '--' + field.replace('_', '-'))}: {e}")


def _vocab(tokenizer) -> Optional[dict]:
    return None if tokenizer is None else tokenizer.get_vocab()


def speculative_from_args(args, model, tokenizer) -> tuple[Optional[dict], Optional[dict]]:
    """(the engine's `speculative=` option, the setting to report) from --speculative,
    --num-speculative-tokens, --ngram-max, --ngram-min; (None, None) without --speculative.
    The engine validates the numbers (errors mapped to the flags by `flag_error`)."""
    spec = args.speculative
    if spec is None:
        for flag in ("num_speculative_tokens", "ngram_max", "ngram_min"):
            if getattr(args, flag) is not None:
                raise SystemExit(f"--{flag.replace('_', '-')}: needs --speculative")
        return None, None
    setting = {"draft": spec, "k": 4 if args.num_speculative_tokens is None
               else args.num_speculative_tokens}
    if spec == "prompt_lookup":
        setting.update(ngram_max=3 if args.ngram_max is None else args.ngram_max,
                       ngram_min=1 if args.ngram_min is None else args.ngram_min)
        return dict(setting), setting
    for flag in ("ngram_max", "ngram_min"):
        if getattr(args, flag) is not None:
            raise SystemExit(f"--{flag.replace('_', '-')}: only with --speculative prompt_lookup")
    import models

    if spec == "demo-draft":
        draft, draft_params, draft_tokenizer = models.demo("draft")
    elif os.path.isdir(spec):
        try:
            draft, draft_params, draft_tokenizer = models.load(spec)
        except models.CheckpointError as e:
            raise SystemExit(f"--speculative: {e}")
    else:
        raise SystemExit(f"--speculative: {spec!r} is neither 'prompt_lookup', 'demo-draft' nor "
                         "a checkpoint directory")
    if draft.config.vocab_size != model.config.vocab_size:
        raise SystemExit(f"--speculative: the draft {spec!r} has {draft.config.vocab_size} "
                         f"token ids, the target {model.config.vocab_size}; a draft must share "
                         "the target's tokenizer")
    vocab, draft_vocab = _vocab(tokenizer), _vocab(draft_tokenizer)
    if None not in (vocab, draft_vocab) and vocab != draft_vocab:
        raise SystemExit(f"--speculative: the draft {spec!r} has another tokenizer than the "
                         "target; a draft must share the target's vocabulary")
    return dict(setting, draft=(draft, draft_params)), setting


def sampling_from_args(args):
    from jaxdecode.config import SamplingParams

    try:
        return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                              min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                              max_tokens=args.max_tokens, stop=tuple(args.stop or ()),
                              seed=args.seed, ignore_eos=args.ignore_eos)
    except ValueError as e:
        raise flag_error(e)


def cmd_generate(args) -> int:
    from jaxdecode.decode import bucket
    from jaxdecode.engine import LLM
    from jaxdecode.tokenization import encode

    if args.prompt_file:
        with open(args.prompt_file, encoding="utf-8") as f:
            prompt = f.read()
    elif args.prompt is not None:
        prompt = args.prompt
    else:
        raise SystemExit("--prompt or --prompt-file is required")
    sp = sampling_from_args(args)
    if args.speculative is not None and args.num_beams > 1:
        raise SystemExit("--speculative: not with --num-beams (beam search runs its own lane)")
    if args.speculative is not None and args.record:
        raise SystemExit("--record: not with --speculative (a record does not pin the "
                         "speculative setting, so replay would run a plain engine)")
    model, params, tokenizer = load_model(args.model)
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
                 model_source=args.model, speculative=speculative) as llm:
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
    return 0 if done.error is None else 1


def _generate_beams(args, model, params, tokenizer, prompt, prompt_ids, sp) -> int:
    """Beam search through the engine's beam lane (`SamplingParams(num_beams=...)`): the best
    hypothesis, or every beam with its score under --json. Not streamed (beams are final only
    at the end); --temperature does not apply (beams rank raw log-probabilities)."""
    from jaxdecode.decode import bucket
    from jaxdecode.engine import LLM

    early = {"true": True, "false": False, "never": "never"}[args.early_stopping]
    try:
        sp = dataclasses.replace(sp, temperature=0.0, num_beams=args.num_beams, n=args.num_beams,
                                 length_penalty=args.length_penalty, early_stopping=early)
        max_len = min(model.config.max_len, bucket(len(prompt_ids) + sp.max_tokens + 1))
        with LLM(model, params, tokenizer, max_slots=1, max_len=max_len,
                 model_source=args.model) as llm:
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


def cmd_replay(args) -> int:
    """Exit 0 when the replay is identical, 1 (with the first divergent step) otherwise."""
    from jaxdecode.engine import LLM
    from jaxdecode.replay import GenerationRecord, replay

    try:
        record = GenerationRecord.load(args.file)
    except (OSError, ValueError) as e:
        raise SystemExit(f"replay: {args.file}: {e}")
    spec = args.model or record.data["model"].get("source")
    if not spec:
        raise SystemExit("--model: the record names no model source; pass --model DIR|demo")
    model, params, tokenizer = load_model(spec)
    layout = record.data["layout"]
    with LLM(model, params, tokenizer, max_slots=layout["max_slots"], max_len=layout["max_len"],
             model_source=spec) as llm:
        report = replay(record, llm)
    print(report.describe())
    return 0 if report.identical else 1


def _llama_config(name: str):
    import models

    c = BENCH_CONFIGS[name]
    return models.LlamaConfig(
        vocab_size=c["vocab_size"], num_layers=c["num_hidden_layers"],
        num_heads=c["num_attention_heads"], num_kv_heads=c["num_key_value_heads"],
        head_dim=c["hidden_size"] // c["num_attention_heads"],
        max_len=c["max_position_embeddings"], hidden_size=c["hidden_size"],
        intermediate_size=c["intermediate_size"], rms_norm_eps=c["rms_norm_eps"])


def _bench_model(spec: str, compare_hf: bool, workdir: str):
    """(model, params, hf_model or None) on the same weights."""
    import models

    if spec in BENCH_CONFIGS:
        if not compare_hf:
            import jax

            model = models.Llama(_llama_config(spec))
            dtype = jax.numpy.bfloat16 if spec == "llama-1b" else jax.numpy.float32
            return model, model.init_params(jax.random.key(0), dtype=dtype), None
        import torch
        import transformers

        torch.manual_seed(0)
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**BENCH_CONFIGS[spec]))
        hf = hf.to(torch.float32).eval()
        hf.save_pretrained(workdir, safe_serialization=True)
        model, params, _ = models.load(workdir)
        return model, params, hf
    model, params, _ = load_model(spec)
    hf = None
    if compare_hf:
        if spec == "demo":
            raise SystemExit("--compare-hf: needs a Hugging Face directory or a named config")
        import torch
        import transformers

        hf = transformers.AutoModelForCausalLM.from_pretrained(spec, dtype=torch.float32).eval()
    return model, params, hf


def cmd_serve(args) -> int:
    from serving import server

    return server.main(args)


def _check_bench_mode(args) -> None:
    """`bench` and `bench --serve` take different flags: one of the other mode's is an error
    naming it, never silently ignored."""
    from serving.loadtest import add_arguments

    probe = argparse.ArgumentParser(add_help=False)
    add_arguments(probe)
    load_flags = set(vars(probe.parse_args([])))
    defaults = vars(build_parser().parse_args(["bench"]))
    bench_flags = set(defaults) - load_flags - {"command", "func", "model", "json", "serve"}
    bad = sorted(n for n in (bench_flags if args.serve else load_flags)
                 if getattr(args, n) != defaults[n])
    if bad:
        flags = ", ".join("--" + n.replace("_", "-") for n in bad)
        raise SystemExit(f"{flags}: not used by the HTTP load test (bench --serve)" if args.serve
                         else f"{flags}: load-test flags; add --serve")


def cmd_bench(args) -> int:
    _check_bench_mode(args)
    if args.serve:
        from serving import loadtest

        return loadtest.main(args)
    import sysconfig
    import tempfile

    import jax

    from jaxdecode import bench
    from jaxdecode.decode import compilation_count

    if args.model is None:  # size the configuration to the backend
        args.model = "llama-512" if jax.default_backend() == "cpu" else "llama-1b"
    if args.compare_hf and jax.default_backend() != "cpu":
        print("--compare-hf: the HF column runs PyTorch on the CPU only", file=sys.stderr)
        args.compare_hf = False
    if args.report:  # the full report: every section, HF side by side when torch is there
        try:
            import matplotlib  # noqa: F401  (checked before minutes of measuring, not after)
        except ImportError:
            raise SystemExit("--report: the plots need matplotlib (pip install matplotlib, or "
                             "the project's dev extra)") from None
        args.host_cost = args.engine = True
        try:
            import torch  # noqa: F401
            args.compare_hf = jax.default_backend() == "cpu"
        except ImportError:
            print("torch is not installed: the report has no HF column", file=sys.stderr)
    default_batches = (1, 4) if args.quick else ((1, 4, 16, 32) if args.report else (1, 16))
    cfg = bench.BenchConfig(batches=tuple(args.batch or default_batches),
                            prompt_len=args.prompt_len,
                            new_tokens=16 if args.quick else args.new_tokens,
                            repeats=1 if args.quick else args.repeats)
    progress = lambda row: print(json.dumps(row), file=sys.stderr)  # noqa: E731
    c0 = compilation_count()
    with tempfile.TemporaryDirectory() as workdir:
        model, params, hf = _bench_model(args.model, args.compare_hf, workdir)
        report = bench.run(model, params, cfg, hf_model=hf, hf_threads=args.hf_threads,
                           progress=progress)
        if args.report:
            lengths = (128, 256) if args.quick else (128, 256, 512, 1024, 2048)
            report["ttft"] = bench.ttft(model, params, lengths, hf, args.hf_threads,
                                        repeats=cfg.repeats)
        if args.report or args.speculative:
            report["beam"] = bench.time_beam_search(model, params, cfg, num_beams=4)
        if args.research:
            report["research"] = bench.time_research(model, params, cfg.batches,
                                                     repeats=max(cfg.repeats, 5))
    text = [bench.format_table(report)]
    if args.research:
        text.append(bench.format_research_table(report["research"]))
    if (args.report and not args.quick) or args.speculative:
        import models
        from models.demo import DEMO_DIR

        target, target_params, tokenizer = models.demo()
        draft = (models.demo("draft")
                 if os.path.exists(os.path.join(DEMO_DIR, "draft.safetensors")) else None)
        ids = [tokenizer.encode(bench.CODE_EDIT_PROMPT).ids]
        report["speculative"] = bench.time_speculative(
            target, target_params, *(draft[:2] if draft else (None, None)),
            cfg=dataclasses.replace(cfg, new_tokens=96, repeats=max(cfg.repeats, 5)),
            prompt_ids=ids)
        text.append(bench.format_search(report["beam"], report["speculative"]))
    if args.report and not args.quick:
        report["constraints"] = bench.time_constraints(target, target_params, tokenizer)
        text.append(bench.format_constraints_table(report["constraints"]))
    report["model_spec"] = args.model
    if args.host_cost or args.engine:
        # the host pipeline needs a real tokenizer: the checkpoint's, else the demo model's; a
        # named config is rebuilt with the demo tokenizer's vocabulary (same shapes otherwise)
        spec = args.model if os.path.isdir(args.model) else "demo"
        model, params, tokenizer = load_model(spec)
        if args.model in BENCH_CONFIGS:
            import jax

            import models

            model = models.Llama(dataclasses.replace(
                _llama_config(args.model), vocab_size=model.config.vocab_size,
                eos_token_ids=model.config.eos_token_ids))
            params = model.init_params(jax.random.key(0))
            spec = f"{args.model}, vocab {model.config.vocab_size}"
        if args.host_cost:
            with open(os.path.join(sysconfig.get_paths()["stdlib"], "json", "decoder.py"),
                      encoding="utf-8") as f:
                ids = tokenizer.encode(f.read()).ids[:2000] if hasattr(
                    tokenizer, "encode_batch") else tokenizer(f.read())["input_ids"][:2000]
            report["host_cost"] = bench.host_cost(tokenizer, ids)
            text.append("host cost per token (detokenize + stop match + stream), "
                        f"{len(ids)} tokens of json/decoder.py:")
            text += [f"  {r['stops']:>2} stop strings: jaxdecode {r['jaxdecode_us_per_token']:.2f} us"
                     f" | HF DecodeStream + fixed hold-back {r['hf_decodestream_us_per_token']:.2f} us"
                     for r in report["host_cost"]]
        if args.engine:
            report["engine"] = [bench.engine_vs_raw(model, params, tokenizer, b, cfg.new_tokens,
                                                    repeats=max(cfg.repeats, 5))
                                for b in cfg.batches]
            if args.report:
                report["recompiles"] = bench.recompiles_after_warmup(
                    model, params, tokenizer, requests=100 if args.quick else 1000)
                text.append(f"compilations after warm-up across {report['recompiles']['requests']}"
                            f" mixed engine requests: {report['recompiles']['compiles_after_warmup']}")
            text += [f"engine with streaming vs raw loop ({spec}, batch {r['batch']}): "
                     f"{r['engine_tokens_per_s']:.0f} vs {r['raw_tokens_per_s']:.0f} tok/s = "
                     f"{r['fraction'] * 100:.0f}%" for r in report["engine"]]
    report["compiles"] = {"total_in_run": compilation_count() - c0,
                          "after_warmup": [r["jaxdecode"]["compiles_after_warmup"]
                                           for r in report["rows"]]}
    print("\n".join(text))
    if args.report:
        for path in bench.write_report(report, args.report):
            print(f"wrote {path}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2, default=str)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxdecode", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

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
    g.add_argument("--record", help="write the generation record (SPEC §11) to this JSON file")
    add_speculative_arguments(g)
    g.set_defaults(func=cmd_generate)

    r = sub.add_parser("replay", help="re-run a generation record; exit 1 on a divergence")
    r.add_argument("file")
    r.add_argument("--model", help="DIR or demo (default: the source named in the record)")
    r.set_defaults(func=cmd_replay)

    s = sub.add_parser("serve", help="the OpenAI-compatible HTTP server (SSE streaming)")
    _add_serve_arguments(s)
    add_speculative_arguments(s)
    s.set_defaults(func=cmd_serve)

    b = sub.add_parser("bench", help="decode throughput, side by side with HF PyTorch")
    b.add_argument("--model", default=None,
                   help=f"DIR, 'demo', or a named config: {', '.join(BENCH_CONFIGS)} (default: "
                        "llama-512 on CPU, llama-1b in bf16 on an accelerator)")
    b.add_argument("--batch", type=int, action="append", help="batch size (repeatable)")
    b.add_argument("--prompt-len", type=int, default=16)
    b.add_argument("--new-tokens", type=int, default=64)
    b.add_argument("--repeats", type=int, default=3)
    b.add_argument("--compare-hf", action="store_true",
                   help="time HF PyTorch generate on the same weights in the same run")
    b.add_argument("--hf-threads", type=int, default=None)
    b.add_argument("--host-cost", action="store_true",
                   help="also time the host pipeline per token against HF DecodeStream")
    b.add_argument("--engine", action="store_true",
                   help="also time the engine with streaming against the raw jitted loop")
    b.add_argument("--speculative", action="store_true",
                   help="also beam search (width 4 vs greedy) and speculative decoding on the "
                        "demo model and its draft (k = 2, 4, 6 and prompt lookup, T = 0, a "
                        "code-editing prompt) against plain decoding")
    b.add_argument("--research", action="store_true",
                   help="also the decode step with one trivial custom processor and with the "
                        "capture of one layer's hidden state, against none (issue #16)")
    b.add_argument("--json", help="write the report as JSON")
    b.add_argument("--report", metavar="DIR",
                   help="every section (HF side by side, time to first token, host cost, "
                        "engine): report.json, report.md and PNG plots in DIR")
    b.add_argument("--quick", action="store_true", help="a smoke run in well under 2 minutes")
    b.add_argument("--serve", action="store_true",
                   help="instead: the HTTP load test (serving/loadtest.py) -- streaming requests "
                        "against `jaxdecode serve` at several concurrency levels")
    _add_loadtest_arguments(b.add_argument_group("load test (with --serve)"))
    b.set_defaults(func=cmd_bench)
    return parser


def add_speculative_arguments(p) -> None:
    """`generate` and `serve`: speculative decoding (SPEC §10, docs/decoding.md)."""
    p.add_argument("--speculative", default=None, metavar="prompt_lookup|demo-draft|DIR",
                   help="speculative decoding with this drafter: 'prompt_lookup' (n-grams of "
                        "the prompt and output), 'demo-draft' (the demo model's draft) or a "
                        "local HF checkpoint directory sharing the model's tokenizer")
    p.add_argument("--num-speculative-tokens", type=int, default=None, metavar="K",
                   help="tokens proposed per round (default 4; with --speculative)")
    p.add_argument("--ngram-max", type=int, default=None,
                   help="longest n-gram matched (default 3; with --speculative prompt_lookup)")
    p.add_argument("--ngram-min", type=int, default=None,
                   help="shortest n-gram matched (default 1; with --speculative prompt_lookup)")


def _add_serve_arguments(p) -> None:
    # the flags live next to the server; importing serving.server is cheap (no FastAPI import)
    from serving.server import add_arguments

    add_arguments(p)


def _add_loadtest_arguments(p) -> None:
    # serving.loadtest imports only the standard library at module level
    from serving.loadtest import add_arguments

    add_arguments(p)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
