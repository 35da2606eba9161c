"""`jaxdecode bench`: the flags and the command that runs the sections and prints / writes the
report; `bench --serve` is the HTTP load test of `jaxdecode.cli.bench.loadtest`."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from jaxdecode.cli.bench import host, lora, paged, report as report_mod, research, search
from jaxdecode.cli.bench import structured
from jaxdecode.cli.bench import throughput
from jaxdecode.cli.bench.configs import BENCH_CONFIGS, bench_model, hf_comparable, host_model
from jaxdecode.cli.bench.timing import BenchConfig
from serving.loading import (add_batch_invariance_argument, add_kv_cache_dtype_argument,
                             add_quantization_argument)


def add_parser(sub) -> None:
    b = sub.add_parser("bench", help="decode throughput, side by side with HF PyTorch")
    bench_arguments(b)
    b.set_defaults(func=cmd_bench)


def bench_arguments(b) -> None:
    b.add_argument("--model", default=None,
                   help=f"DIR, 'demo', or a named config: {', '.join(BENCH_CONFIGS)} (default: "
                        "llama-512 on CPU, llama-1b in bf16 on an accelerator)")
    b.add_argument("--batch", type=int, action="append", help="batch size (repeatable)")
    b.add_argument("--prompt-len", type=int, default=16)
    b.add_argument("--row-tile", type=int, default=None,
                   help="rows per weight-product tile of the model (default: the model's, 4; "
                        "docs/batch_invariance.md \"Row tiles as a setting\")")
    add_batch_invariance_argument(b)
    add_quantization_argument(b)
    add_kv_cache_dtype_argument(b)
    b.add_argument("--invariance-tax", action="store_true",
                   help="also time the fast path (--no-batch-invariant's model) beside the "
                        "batch-invariant one, per batch size: the invariance tax")
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
    b.add_argument("--paged", action="store_true",
                   help="also the decode step over KV pages against a contiguous cache, and "
                        "the ITL of 8 streams while 2048-token prompts arrive, prefill in "
                        "chunks vs whole (issue #15)")
    b.add_argument("--lora", action="store_true",
                   help="also the decode step with 2 LoRA adapters (ranks 8 and 16, every "
                        "projection) in the batch against none (issue #42)")
    b.add_argument("--json", help="write the report as JSON")
    b.add_argument("--report", metavar="DIR",
                   help="every section (HF side by side, time to first token, host cost, "
                        "engine): report.json, report.md and PNG plots in DIR")
    b.add_argument("--quick", action="store_true", help="a smoke run in well under 2 minutes")
    b.add_argument("--quality", action="store_true",
                   help="held-out loss of the demo model with float and int8 weights, and "
                        "first greedy token agreement over 16 prompts (a section on its own; "
                        "with --quick on the first 4096 held-out tokens)")
    b.add_argument("--device-check", action="store_true",
                   help="instead: the accelerator check (decode at batch 1/16/64 with and without "
                        "batch invariance beside HF, the Pallas kernels against the XLA path, "
                        "X1 at logit level, the load test), each section in a process of its "
                        "own under a time budget; report.md/report.json and the environment in "
                        "--out DIR (docs/performance.md \"The device check\")")
    b.add_argument("--out", metavar="DIR", help="the device check's directory")
    b.add_argument("--serve", action="store_true",
                   help="instead: the HTTP load test (cli/bench/loadtest/) -- streaming requests "
                        "against `jaxdecode serve` (started with --warmup for the longest "
                        "prompt and every --server-arg) or any OpenAI-compatible --url, at "
                        "several concurrency levels, with the metrics of `vllm bench serve`")
    _add_loadtest_arguments(b.add_argument_group(
        "load test (with --serve; workloads, --request-rate and the metrics: docs/serving.md)"))


def _add_loadtest_arguments(p) -> None:
    # the load test imports only the standard library at module level
    from jaxdecode.cli.bench.loadtest import add_arguments

    add_arguments(p)


def check_bench_mode(args) -> None:
    """`bench`, `bench --serve` and `bench --device-check` take different flags: one of another
    mode's is an error naming it, never silently ignored."""
    probe = argparse.ArgumentParser(add_help=False)
    _add_loadtest_arguments(probe)
    load_flags = set(vars(probe.parse_args([])))
    bench = argparse.ArgumentParser(add_help=False)
    bench_arguments(bench)
    defaults = vars(bench.parse_args([]))
    if args.device_check or args.out:
        if not (args.device_check and args.out):
            raise SystemExit("--device-check and --out DIR go together")
        allowed, why = {"device_check", "out", "quick"}, "not used by --device-check"
    elif args.serve:
        allowed, why = load_flags | {"model", "json", "serve"}, ("not used by the HTTP load "
                                                                 "test (bench --serve)")
    elif args.quality:
        allowed, why = {"quality", "quick", "json"}, "not used by --quality (the demo model)"
    else:
        allowed, why = set(defaults) - load_flags, "load-test flags; add --serve"
    bad = sorted(n for n in defaults if n not in allowed and getattr(args, n) != defaults[n])
    if bad:
        flag_of = {a.dest: a.option_strings[0] for a in bench._actions}
        raise SystemExit(f"{', '.join(flag_of[n] for n in bad)}: {why}")


def _device_check(args) -> int:
    """`--device-check --out DIR [--quick]` (flags checked by `check_bench_mode`)."""
    from jaxdecode.cli.bench import devicecheck

    report = devicecheck.run(args.out, args.quick)
    print(devicecheck.format_report(report))
    print(f"wrote {os.path.join(args.out, 'report.md')}")
    return 0 if all(s["status"] == "ok" for s in report["sections"].values()) else 1


def _quality(args) -> int:
    """`--quality [--quick] [--json FILE]`: float against int8 weights on the demo model."""
    from jaxdecode.cli.bench import quality

    report = quality.run(args.quick)
    print(quality.format_quality(report))
    _write_json(args.json, report)
    return 0


def _write_json(path, report: dict) -> None:
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(report, f, indent=2, default=str)


def _settle(args) -> None:
    """Fill in what depends on the backend and on --report."""
    import jax

    if args.kv_cache_dtype != "auto" and not (args.paged or args.engine or args.report):
        raise SystemExit("--kv-cache-dtype: times the page pool, add --paged or --engine")
    if args.invariance_tax and not args.batch_invariant:
        raise SystemExit("--invariance-tax: not with --no-batch-invariant (the tax is the "
                         "batch-invariant model's time against the fast path's)")
    if args.model is None:  # size the configuration to the backend
        args.model = "llama-512" if jax.default_backend() == "cpu" else "llama-1b"
    if args.compare_hf and not hf_comparable():
        print(f"--compare-hf: PyTorch cannot run on this {jax.default_backend()} backend (it "
              "runs HF on the CPU, or on the GPU with a CUDA build): no HF column", file=sys.stderr)
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
            args.compare_hf = hf_comparable()
        except ImportError:
            print("torch is not installed: the report has no HF column", file=sys.stderr)


def _decode_sections(args, cfg: BenchConfig) -> tuple[dict, list]:
    """Throughput (HF side by side), time to first token, beam search on the bench model."""
    import tempfile

    from jaxdecode.engine.config import row_tiled

    progress = lambda row: print(json.dumps(row), file=sys.stderr)  # noqa: E731
    with tempfile.TemporaryDirectory() as workdir:
        model, params, hf = bench_model(args.model, args.compare_hf, workdir, args.quantization)
        fast = row_tiled(model, args.row_tile, False) if args.invariance_tax else None
        model = row_tiled(model, args.row_tile, args.batch_invariant)
        report = throughput.run(model, params, cfg, hf_model=hf, hf_threads=args.hf_threads,
                                progress=progress, fast_model=fast)
        if args.report:
            lengths = (128, 256) if args.quick else (128, 256, 512, 1024, 2048)
            report["ttft"] = throughput.ttft(model, params, lengths, hf, args.hf_threads,
                                             repeats=cfg.repeats)
        if args.report or args.speculative:
            report["beam"] = search.time_beam_search(model, params, cfg, num_beams=4)
        text = [report_mod.format_table(report)]
        if args.research:
            report["research"] = research.time_research(model, params, cfg.batches,
                                                        repeats=max(cfg.repeats, 5))
            text.append(research.format_research_table(report["research"]))
        if args.paged:
            report["paged"] = paged.time_paged(model, params, cfg.batches,
                                               repeats=max(cfg.repeats, 5),
                                               kv_cache_dtype=args.kv_cache_dtype)
            text.append(paged.format_paged_table(report["paged"]))
        if args.lora:
            report["lora"] = lora.time_lora(model, params, cfg.batches,
                                            repeats=max(cfg.repeats, 5))
            text.append(lora.format_lora_table(report["lora"]))
    return report, text


def _demo_sections(args, cfg: BenchConfig, report: dict, text: list) -> None:
    """Speculative decoding on the demo model and its draft; structured output (full report)."""
    import models
    from models.demo import DEMO_DIR

    target, target_params, tokenizer = models.demo()
    draft = (models.demo("draft")
             if os.path.exists(os.path.join(DEMO_DIR, "draft.safetensors")) else None)
    ids = [tokenizer.encode(search.CODE_EDIT_PROMPT).ids]
    report["speculative"] = search.time_speculative(
        target, target_params, *(draft[:2] if draft else (None, None)),
        cfg=dataclasses.replace(cfg, new_tokens=96, repeats=max(cfg.repeats, 5)),
        prompt_ids=ids)
    text.append(report_mod.format_search(report["beam"], report["speculative"]))
    if args.report and not args.quick:
        report["constraints"] = structured.time_constraints(target, target_params, tokenizer)
        text.append(report_mod.format_constraints_table(report["constraints"]))


def _host_sections(args, cfg: BenchConfig, report: dict, text: list) -> None:
    """Host pipeline cost per token; the engine with streaming against the raw loop."""
    import sysconfig

    from jaxdecode.engine.config import row_tiled

    model, params, tokenizer, spec = host_model(args.model, args.quantization)
    model = row_tiled(model, args.row_tile, args.batch_invariant)
    if args.host_cost:
        with open(os.path.join(sysconfig.get_paths()["stdlib"], "json", "decoder.py"),
                  encoding="utf-8") as f:
            ids = tokenizer.encode(f.read()).ids[:2000] if hasattr(
                tokenizer, "encode_batch") else tokenizer(f.read())["input_ids"][:2000]
        report["host_cost"] = host.host_cost(tokenizer, ids)
        text.append("host cost per token (detokenize + stop match + stream), "
                    f"{len(ids)} tokens of json/decoder.py:")
        text += [f"  {r['stops']:>2} stop strings: jaxdecode {r['jaxdecode_us_per_token']:.2f} us"
                 f" | HF DecodeStream + fixed hold-back {r['hf_decodestream_us_per_token']:.2f} us"
                 for r in report["host_cost"]]
    if args.paged:
        report["chunked_prefill_itl"] = paged.chunked_prefill_itl(
            model, params, tokenizer, new_tokens=64 if args.quick else 256,
            long_len=min(512 if args.quick else 2048, model.config.max_len // 2),
            chunk=64 if args.quick else 256)
        text.append(paged.format_itl_table(report["chunked_prefill_itl"]))
    if args.engine:
        dtypes = tuple(dict.fromkeys(("auto", args.kv_cache_dtype)))
        report["engine"] = [row for b in cfg.batches for row in host.engine_vs_raw(
            model, params, tokenizer, b, cfg.new_tokens, repeats=max(cfg.repeats, 5),
            kv_cache_dtypes=dtypes)]
        if args.report:
            report["recompiles"] = host.recompiles_after_warmup(
                model, params, tokenizer, requests=100 if args.quick else 1000)
            text.append(f"compilations after warm-up across {report['recompiles']['requests']}"
                        f" mixed engine requests: {report['recompiles']['compiles_after_warmup']}")
        text += [f"engine with streaming vs raw loop ({spec}, batch {r['batch']}"
                 f"{', int8 KV' if r['kv_cache_dtype'] == 'int8' else ''}): "
                 f"{r['engine_tokens_per_s']:.0f} vs {r['raw_tokens_per_s']:.0f} tok/s = "
                 f"{r['fraction'] * 100:.0f}%" for r in report["engine"]]


def cmd_bench(args) -> int:
    check_bench_mode(args)
    if args.device_check:
        return _device_check(args)
    if args.quality:
        return _quality(args)
    if args.serve:
        from jaxdecode.cli.bench import loadtest

        return loadtest.main(args)
    from jaxdecode.device.decode import compilation_count

    _settle(args)
    default_batches = (1, 4) if args.quick else ((1, 4, 16, 32) if args.report else (1, 16))
    cfg = BenchConfig(batches=tuple(args.batch or default_batches), prompt_len=args.prompt_len,
                      new_tokens=16 if args.quick else args.new_tokens,
                      repeats=1 if args.quick else args.repeats)
    c0 = compilation_count()
    report, text = _decode_sections(args, cfg)
    if (args.report and not args.quick) or args.speculative:
        _demo_sections(args, cfg, report, text)
    report["model_spec"] = args.model
    if args.host_cost or args.engine or args.paged:
        _host_sections(args, cfg, report, text)
    report["compiles"] = {"total_in_run": compilation_count() - c0,
                          "after_warmup": [r["jaxdecode"]["compiles_after_warmup"]
                                           for r in report["rows"]]}
    print("\n".join(text))
    if args.report:
        for path in report_mod.write_report(report, args.report):
            print(f"wrote {path}")
    _write_json(args.json, report)
    return 0
