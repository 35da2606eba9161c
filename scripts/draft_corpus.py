"""Write a corpus of the `main` demo model's own greedy continuations, for distilling the draft
where speculative decoding at T = 0 needs it to agree: on `main`'s greedy paths.

    python scripts/draft_corpus.py --corpus corpus.npz --teacher models/demo --out draft.npz
    python scripts/train_demo.py --kind draft --teacher models/demo --init-from models/demo \\
        --corpus draft.npz --minutes 30 --out models/demo

Prompts are windows of `--prompt-len` tokens at random offsets of the corpus's training stream
(seeded); each continues for `--new-tokens` greedy tokens, and prompt + continuation + EOT is
one document of the new training stream. The held-out stream is the corpus's own, so the
draft's held-out loss stays comparable. The file has `train_demo.py --save-corpus`'s layout;
its record adds `generated_by` (the teacher file's SHA-256 and the generation settings).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def greedy_documents(model, params, train: np.ndarray, *, prompts: int, prompt_len: int,
                     new_tokens: int, batch: int, seed: int, eot: int,
                     seconds: float = float("inf")) -> np.ndarray:
    """prompt + `main`'s greedy continuation + EOT for `prompts` random windows of `train`,
    in batches, no batch after the first started once `seconds` have passed (a fixed-time run
    on an accelerator).

    Greedy by full recompute (`model.logits`, plain products): one jitted loop per batch, each
    step the whole window's causal forward. A distillation corpus needs `main`'s argmax, not the
    decoder's batch-invariant numerics, whose 4-row product tiles make a batch of 2048 rows
    minutes long on a GPU (docs/performance/gpu/2026-12-04-h200/)."""
    import jax
    import jax.numpy as jnp

    from train_demo import log

    total = prompt_len + new_tokens

    @jax.jit
    def continue_greedy(p, buf):
        def step(t, buf):
            logits = model.logits(p, buf)                                  # [B, total, V]
            nxt = jnp.argmax(jax.lax.dynamic_index_in_dim(logits, t - 1, 1, False), -1)
            return jax.lax.dynamic_update_index_in_dim(buf, nxt.astype(buf.dtype), t, 1)
        return jax.lax.fori_loop(prompt_len, total, step, buf)

    rng = np.random.default_rng(seed)
    starts = rng.integers(0, len(train) - prompt_len, size=prompts)
    docs, t0 = [], time.time()
    for i in range(0, prompts, batch):
        if i and time.time() - t0 >= seconds:
            log(f"stopped at {i}/{prompts} prompts: the {seconds:.0f} s budget is spent")
            break
        buf = np.zeros((len(starts[i:i + batch]), total), np.int32)
        buf[:, :prompt_len] = [train[s:s + prompt_len] for s in starts[i:i + batch]]
        out = np.asarray(continue_greedy(params, jnp.asarray(buf)))
        docs.extend(np.append(row, np.int32(eot)) for row in out)
        log(f"{min(i + batch, prompts)}/{prompts} prompts, {time.time() - t0:.0f} s")
    return np.concatenate(docs)


def main(argv=None) -> int:
    from train_demo import EOT, file_sha256, load_corpus, save_corpus

    from models.demo import load as load_demo

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--corpus", required=True, help="a train_demo.py --save-corpus file")
    ap.add_argument("--teacher", required=True, help="the directory of the `main` model")
    ap.add_argument("--out", required=True, metavar="FILE.npz")
    ap.add_argument("--prompts", type=int, default=8192)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--seconds", type=float, default=float("inf"),
                    help="start no batch after the first once this many seconds have passed")
    args = ap.parse_args(argv)

    tok, train, val, meta = load_corpus(args.corpus, args.teacher)
    model, params, _ = load_demo("main", args.teacher)
    stream = greedy_documents(model, params, train, prompts=args.prompts,
                              prompt_len=args.prompt_len, new_tokens=args.new_tokens,
                              batch=args.batch, seed=args.seed,
                              eot=tok.token_to_id(EOT), seconds=args.seconds)
    prompts = len(stream) // (args.prompt_len + args.new_tokens + 1)
    meta["generated_by"] = {
        "teacher_sha256": file_sha256(os.path.join(args.teacher, "main.safetensors")),
        "prompts": prompts, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
        "temperature": 0.0, "seed": args.seed}
    save_corpus(args.out, tok, stream, val, meta)
    print(json.dumps({"out": args.out, "train_tokens": int(len(stream))}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
