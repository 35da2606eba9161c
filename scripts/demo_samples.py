#!/usr/bin/env python
"""Sample the demo model and count the samples that parse as Python (the model card's figure).

    python scripts/demo_samples.py                      # the shipped models/demo
    python scripts/demo_samples.py --dir /tmp/run --show 3

Each sample starts a new file (the prompt is `<|endoftext|>`, the document separator the model
was trained with) and is drawn at --temperature with seeds 0..n-1. A sample counts as parsing
when `ast.parse` accepts it:
- whole: the sample exactly as generated;
- cut: a sample that stopped at --max-tokens without ending its file is cut before its last
  top-level line (the statement the length limit may have cut), then parsed.
"""

from __future__ import annotations

import argparse
import ast
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def parses(text: str) -> bool:
    try:
        ast.parse(text)
    except (SyntaxError, ValueError):
        return False
    return True


def cut_unfinished(text: str) -> str:
    """`text` without its last top-level line and what follows it (an unfinished statement)."""
    lines = text.split("\n")
    starts = [i for i, line in enumerate(lines) if line[:1] not in ("", " ", "\t", ")", "]", "}")]
    return "\n".join(lines[:starts[-1]]) if starts and starts[-1] > 0 else ""


def samples(directory: str | None, n: int, max_tokens: int, temperature: float) -> list:
    """[(text, finished)] for seeds 0..n-1."""
    import jaxdecode as jd
    from models.demo import load

    model, params, tok = load("main", directory)
    sp = [jd.SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=s,
                            utf8_errors="replace") for s in range(n)]
    out = jd.generate(model, params, [[0]] * n, sp)
    result = []
    for ids, length in zip(out.token_ids, out.lengths):
        ids = [int(i) for i in ids[:int(length)]]
        finished = bool(ids) and ids[-1] == 0
        result.append((tok.decode([i for i in ids if i != 0]), finished))
    return result


def count(drawn: list) -> dict:
    whole = sum(parses(t) for t, _ in drawn)
    cut = sum(parses(t if done else cut_unfinished(t)) for t, done in drawn)
    return {"samples": len(drawn), "whole": whole, "cut": cut,
            "finished": sum(done for _, done in drawn)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default=None, help="a models/demo-like directory (default: shipped)")
    ap.add_argument("-n", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--show", type=int, default=0, help="print this many samples")
    args = ap.parse_args(argv)
    drawn = samples(args.dir, args.n, args.max_tokens, args.temperature)
    for i, (text, done) in enumerate(drawn[:args.show]):
        print(f"--- seed {i} ({'ended its file' if done else 'cut at max_tokens'}) ---\n{text}")
    c = count(drawn)
    print(f"{c['whole']} of {c['samples']} samples parse whole, {c['cut']} once an unfinished "
          f"last statement is cut ({c['finished']} ended their file before --max-tokens)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
