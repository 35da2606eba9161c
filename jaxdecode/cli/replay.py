"""`jaxdecode replay FILE`: re-run a generation record (contract §11)."""

from __future__ import annotations

from serving.loading import load_model


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
    model, params, tokenizer = load_model(spec,
                                          quantization=record.data["model"].get("quantization"))
    layout = record.data["layout"]
    pinned = record.data.get("batch_invariance") or {}
    with LLM(model, params, tokenizer, max_slots=layout["max_slots"], max_len=layout["max_len"],
             model_source=spec, row_tile=pinned.get("row_tile"),
             batch_invariant=pinned.get("mode") != "none",
             kv_cache_dtype=layout.get("kv_cache_dtype", "auto")) as llm:
        try:
            report = replay(record, llm, allow_params_mismatch=args.allow_params_mismatch)
        except ValueError as e:
            raise SystemExit(f"replay: {e}")
    print(report.describe())
    return 0 if report.identical else 1


def add_parser(sub) -> None:
    r = sub.add_parser("replay", help="re-run a generation record; exit 1 on a divergence")
    r.add_argument("file")
    r.add_argument("--model", help="DIR or demo (default: the source named in the record)")
    r.add_argument("--allow-params-mismatch", action="store_true",
                   help="replay a record made with other weights (refused by default)")
    r.set_defaults(func=cmd_replay)
