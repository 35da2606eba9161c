#!/usr/bin/env python
"""Train the embedded demo models of `models/demo/` (docs/architecture.md "models/").

Everything here is reproducible on a fresh machine with no download: the training text is the
Python standard library that ships with the interpreter running this script.

    # 1. the tokenizer alone (byte-level BPE, 4096 tokens, <|endoftext|> = id 0)
    python scripts/train_demo.py --tokenizer-only --out models/demo
    # 2. the main demo model, then the small draft model (same tokenizer), distilled from it
    python scripts/train_demo.py --kind main  --minutes 85 --out models/demo
    python scripts/train_demo.py --kind draft --minutes 25 --teacher models/demo --out models/demo
    # or: start from an earlier run's model (widened to this run's heads when it has fewer)
    python scripts/train_demo.py --kind main --minutes 65 --init-from old_run --out models/demo
    # smoke test: a tiny model for one minute into a scratch directory
    python scripts/train_demo.py --kind main --minutes 1 --tiny --out /tmp/demo-smoke
    # another machine (an accelerator, another Python): encode here, train there on that text
    python scripts/train_demo.py --save-corpus corpus.npz --out models/demo
    python scripts/train_demo.py --kind main --corpus corpus.npz --minutes 6 --out run

Data (deterministic): every `*.py` file under `sysconfig.get_paths()["stdlib"]` in sorted order,
skipping `site-packages/`, `__pycache__/` and test directories (`test/`, `tests/`, `idle_test/`),
except that a few test files are kept for their multilingual text (so that multi-byte UTF-8 is
seen in training): `test/cjkencodings/*-utf8.txt` and test `*.py` files with at least
`MULTILINGUAL_MIN_CHARS` non-ASCII characters. The machine-generated codec tables
(`encodings/*.py` made "with gencodec.py") are skipped too. Files that are not valid UTF-8 are skipped. Each
file is one document; documents are joined with `<|endoftext|>`. A file belongs to the held-out
split when `sha1(relative path) % 100 < 2` (about 2% of files).

Tokenizer: `tokenizers` byte-level BPE (ByteLevel pre-tokenizer with add_prefix_space=False,
ByteLevel decoder), vocabulary 4096 with `<|endoftext|>` at id 0, trained on the training split.
If `<out>/tokenizer.json` already exists it is reused (pass --retrain-tokenizer to replace it), so
the draft model always shares the main model's tokenizer.

Model: `models.llama.Llama` (RoPE, RMSNorm, SwiGLU, tied embeddings), f32. Training: random
windows of `ctx + 1` tokens from the training stream, AdamW (b2=0.95, weight decay 0.1 on
matrices), gradient clipping at 1.0, linear warmup then cosine decay to 10% -- scheduled by
*wall-clock time* (the learning rate is a function of elapsed / budget), so the run ends on
time whatever the machine's speed or load. Every `--save-every` minutes the current weights are
written atomically (temp file + rename) to `<out>/<kind>.safetensors` and `<out>/<kind>.json`,
so an interrupted run still leaves a usable model. The config JSON carries the training record
(`val_loss`, `train_minutes`, `tokens_seen`, `steps`, ...) that the model card refers to.

`--init-from DIR` starts from DIR's model instead of random weights; a model without GQA is
widened to this run's query / KV heads keeping its function (`expand_heads`). `--teacher DIR`
distils: the loss is the cross-entropy against DIR's `main` model's next-token distribution at
every position (the teacher frozen) instead of the data's next token. The training record
names both by SHA-256 (`init_from`, `distilled_from`). MODEL_CARD.md lists the shipped runs.

Output files: `tokenizer.json`, `<kind>.safetensors` (flat names: `embed`, `final_norm`,
`layers.0.q`, ...; float32, or float16 with `--save-dtype float16`, in which case the final
`val_loss` is measured on the rounded weights), `<kind>.json` (LlamaConfig fields + `training`
record).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import sys
import sysconfig
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

EOT = "<|endoftext|>"
VOCAB_SIZE = 4096
VAL_PERCENT = 2
MULTILINGUAL_MIN_CHARS = 40
# Extra training text: the sources of installed runtime dependencies of this project (their
# held-out-hash files are dropped; the held-out loss is measured on the standard library only).
EXTRA_PACKAGES = ["jax", "numpy", "flax", "optax", "orbax"]
SKIP_DIRS = {"site-packages", "__pycache__", "test", "tests", "idle_test"}

# Model sizes. Query and KV head counts of `main` divide by 2 and 4 (tensor-parallel meshes of 2
# and 4 devices shard it by KV head); 8 query heads share 4 KV heads (grouped-query attention).
SIZES = {
    "main": dict(hidden_size=192, num_layers=4, num_heads=8, num_kv_heads=4, head_dim=64,
                 intermediate_size=512, ctx=128, batch=64, lr=3e-3),
    "draft": dict(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
                  intermediate_size=384, ctx=128, batch=64, lr=4e-3),
    "tiny": dict(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=2, head_dim=16,
                 intermediate_size=64, ctx=64, batch=8, lr=3e-3),
}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# -- data ---------------------------------------------------------------------------------------

def corpus_files(stdlib: str | None = None) -> list[tuple[str, str]]:
    """Sorted (relative path, text) of the training corpus; see the module docstring."""
    stdlib = stdlib or sysconfig.get_paths()["stdlib"]
    out = []
    for root, dirs, files in os.walk(stdlib):
        dirs.sort()
        rel_root = os.path.relpath(root, stdlib)
        parts = [] if rel_root == "." else rel_root.split(os.sep)
        if parts and (parts[0] == "site-packages" or "__pycache__" in parts):
            dirs[:] = []
            continue
        in_test = any(p in SKIP_DIRS for p in parts)
        for name in sorted(files):
            rel = os.path.join(rel_root, name) if parts else name
            rel = rel.replace(os.sep, "/")
            multilingual_txt = (in_test and rel.startswith("test/cjkencodings/")
                                and name.endswith("-utf8.txt"))
            if not (name.endswith(".py") or multilingual_txt):
                continue
            try:
                with open(os.path.join(root, name), encoding="utf-8") as f:
                    text = f.read()
            except (UnicodeDecodeError, OSError):
                continue
            if in_test and not multilingual_txt:
                if sum(1 for c in text if ord(c) > 127) < MULTILINGUAL_MIN_CHARS:
                    continue
            if "with gencodec.py" in text[:500]:
                continue  # machine-generated codec tables (encodings/cp*.py etc.)
            if text.strip():
                out.append((rel, text))
    out.sort()
    return out


def package_files(names: list[str]) -> tuple[list[tuple[str, str]], dict[str, str]]:
    """Sorted ("pkg:<name>/<relative path>", text) of installed packages' `*.py` sources
    (test directories skipped), and the versions found. Missing packages are skipped."""
    import importlib.metadata
    import importlib.util

    out, versions = [], {}
    for name in names:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            continue
        base = sorted(spec.submodule_search_locations)[0]
        dist = {"orbax": "orbax-checkpoint"}.get(name, name)
        try:
            versions[name] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "unknown"
        for root, dirs, files in os.walk(base):
            dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and d != "testing")
            for fname in sorted(files):
                if not fname.endswith(".py"):
                    continue
                rel = os.path.relpath(os.path.join(root, fname), base).replace(os.sep, "/")
                try:
                    with open(os.path.join(root, fname), encoding="utf-8") as f:
                        text = f.read()
                except (UnicodeDecodeError, OSError):
                    continue
                if text.strip():
                    out.append((f"pkg:{name}/{rel}", text))
    out.sort()
    return out, versions


def is_validation(rel_path: str) -> bool:
    return int(hashlib.sha1(rel_path.encode()).hexdigest(), 16) % 100 < VAL_PERCENT


def split_corpus(files):
    train = [(p, t) for p, t in files if not is_validation(p)]
    val = [(p, t) for p, t in files if is_validation(p)]
    return train, val


# -- tokenizer ----------------------------------------------------------------------------------

def train_tokenizer(texts: list[str], vocab_size: int = VOCAB_SIZE):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  min_frequency=2, show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    assert tok.token_to_id(EOT) == 0, "<|endoftext|> must be id 0"
    return tok


def get_tokenizer(out_dir: str, train_texts: list[str], retrain: bool):
    from tokenizers import Tokenizer

    path = os.path.join(out_dir, "tokenizer.json")
    if os.path.exists(path) and not retrain:
        log(f"reusing tokenizer {path}")
        return Tokenizer.from_file(path)
    t0 = time.time()
    tok = train_tokenizer(train_texts)
    os.makedirs(out_dir, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out_dir, suffix=".tmp")
    os.close(fd)
    tok.save(tmp, pretty=False)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
    log(f"trained tokenizer (vocab {tok.get_vocab_size()}) in {time.time() - t0:.1f}s -> {path}")
    return tok


def encode_stream(tok, texts: list[str]) -> np.ndarray:
    """All documents as one uint16 stream, each followed by <|endoftext|>."""
    eot = tok.token_to_id(EOT)
    encs = tok.encode_batch(texts, add_special_tokens=False)
    parts = []
    for e in encs:
        parts.append(np.asarray(e.ids, np.uint16))
        parts.append(np.asarray([eot], np.uint16))
    return np.concatenate(parts) if parts else np.zeros((0,), np.uint16)


# -- saving ---------------------------------------------------------------------------------------

def flatten_params(params, dtype=np.float32) -> dict[str, np.ndarray]:
    flat = {}
    for k, v in params.items():
        if k == "layers":
            for i, layer in enumerate(v):
                for name, arr in layer.items():
                    flat[f"layers.{i}.{name}"] = np.asarray(arr, dtype)
        else:
            flat[k] = np.asarray(v, dtype)
    return flat


def config_json(config, training: dict) -> dict:
    d = dataclasses.asdict(config)
    d["eos_token_ids"] = list(d["eos_token_ids"])
    d["rope_scaling"] = [list(x) for x in d["rope_scaling"]]
    d["training"] = training
    return d


def atomic_write(path: str, write_fn) -> None:
    d = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=d, prefix="." + os.path.basename(path), suffix=".tmp")
    os.close(fd)
    try:
        write_fn(tmp)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def save_model(out_dir: str, kind: str, config, params, training: dict,
               dtype: str = "float32") -> None:
    """`dtype` float16 halves the file (the loader casts back to float32)."""
    from safetensors.numpy import save_file

    flat = flatten_params(params, np.dtype(dtype))
    # Weights first, then the config: a reader that sees the new config sees the new weights.
    atomic_write(os.path.join(out_dir, f"{kind}.safetensors"),
                 lambda p: save_file(flat, p, metadata={"format": "np", "kind": kind}))

    def write_json(p):
        with open(p, "w") as f:
            json.dump(config_json(config, training), f, indent=2)
            f.write("\n")
    atomic_write(os.path.join(out_dir, f"{kind}.json"), write_json)


# -- initialisation from an earlier run -----------------------------------------------------------

def expand_heads(params: dict, old, new, rng: np.random.Generator, scale: float = 0.02) -> dict:
    """Widen a model without grouped-query attention (H = KVH) to `new`'s heads, keeping its
    function (Net2Net-style): old head j becomes KV head j and query head j * G (G = new H / new
    KVH); the added query/KV columns are random N(0, scale) and the added rows of `o` are zero,
    so the added heads contribute nothing until training moves them. Everything else must match.
    """
    same = ("hidden_size", "num_layers", "head_dim", "intermediate_size", "vocab_size")
    if old.num_heads != old.num_kv_heads or any(getattr(old, f) != getattr(new, f) for f in same):
        raise ValueError(f"--init-from: cannot expand {old} into {new}")
    g, hd = new.num_heads // new.num_kv_heads, new.head_dim
    if new.num_kv_heads < old.num_kv_heads or new.num_heads % new.num_kv_heads:
        raise ValueError(f"--init-from: {old.num_heads} heads do not fit {new.num_heads} query / "
                         f"{new.num_kv_heads} KV heads")
    d = new.hidden_size

    def widen(w, heads, placed, axis):
        shape = list(w.shape)
        shape[axis] = heads * hd
        out = (rng.normal(0.0, scale, shape) if axis == 1 else np.zeros(shape)).astype(np.float32)
        for j, slot in enumerate(placed):
            src = [slice(None)] * 2
            dst = [slice(None)] * 2
            src[axis], dst[axis] = slice(j * hd, (j + 1) * hd), slice(slot * hd, (slot + 1) * hd)
            out[tuple(dst)] = np.asarray(w)[tuple(src)]
        return out

    kv_slots = list(range(old.num_kv_heads))
    q_slots = [j * g for j in range(old.num_heads)]
    layers = []
    for layer in params["layers"]:
        layer = dict(layer)
        assert layer["q"].shape == (d, old.num_heads * hd)
        layer["q"] = widen(layer["q"], new.num_heads, q_slots, 1)
        layer["k"] = widen(layer["k"], new.num_kv_heads, kv_slots, 1)
        layer["v"] = widen(layer["v"], new.num_kv_heads, kv_slots, 1)
        layer["o"] = widen(layer["o"], new.num_heads, q_slots, 0)
        layers.append(layer)
    return {**params, "layers": layers}


def file_sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


# -- training -------------------------------------------------------------------------------------

def lr_at(frac: float, peak: float, warmup_frac: float, final_frac: float = 0.1) -> float:
    """Linear warmup then cosine decay to final_frac * peak, as a function of time fraction."""
    if frac < warmup_frac:
        return peak * max(frac, 1e-3) / warmup_frac
    p = min(1.0, (frac - warmup_frac) / max(1e-9, 1.0 - warmup_frac))
    return peak * (final_frac + (1 - final_frac) * 0.5 * (1 + math.cos(math.pi * p)))


def build_corpus(args):
    """The tokenizer, the encoded training and held-out streams, and the corpus record, from
    the files of this interpreter and the installed packages (module docstring). The tokenizer
    alone (None for the rest) with --tokenizer-only."""
    files = corpus_files()
    train_files, val_files = split_corpus(files)
    n_chars = sum(len(t) for _, t in files)
    log(f"stdlib corpus: {len(files)} files, {n_chars / 1e6:.2f}M chars "
        f"({len(train_files)} train / {len(val_files)} held-out files) "
        f"from {sysconfig.get_paths()['stdlib']}")
    pkg, pkg_versions = package_files([n for n in args.extra_packages.split(",") if n])
    pkg_train, _ = split_corpus(pkg)
    n_pkg_chars = sum(len(t) for _, t in pkg_train)
    log(f"package corpus: {len(pkg_train)} files, {n_pkg_chars / 1e6:.2f}M chars {pkg_versions}")
    train_files = train_files + pkg_train
    os.makedirs(args.out, exist_ok=True)
    tok = get_tokenizer(args.out, [t for _, t in train_files], args.retrain_tokenizer)
    if args.tokenizer_only:
        return tok, None, None, None
    train_ids = encode_stream(tok, [t for _, t in train_files])
    val_ids = encode_stream(tok, [t for _, t in val_files])
    log(f"tokens: {len(train_ids) / 1e6:.2f}M train, {len(val_ids) / 1e3:.1f}K held-out "
        f"({(n_chars + n_pkg_chars) / (len(train_ids) + len(val_ids)):.2f} chars/token)")
    corpus = {"stdlib_files": len(files), "stdlib_chars": int(n_chars),
              "package_files": len(pkg_train), "package_chars": int(n_pkg_chars),
              "packages": pkg_versions, "python": sys.version.split()[0]}
    return tok, train_ids, val_ids, corpus


def save_corpus(path: str, tok, train_ids: np.ndarray, val_ids: np.ndarray,
                corpus: dict) -> None:
    """The encoded streams, the tokenizer and the corpus record in one .npz (--save-corpus), so
    that another machine (an accelerator with another Python) trains on this very text."""
    meta = dict(corpus, tokenizer=tok.to_str())
    np.savez_compressed(path, train=train_ids, val=val_ids, meta=np.asarray(json.dumps(meta)))


def load_corpus(path: str, out_dir: str):
    """--corpus: the streams, tokenizer and record of a --save-corpus file. The tokenizer goes
    to `out_dir` (an existing different one there is an error: the models must share it)."""
    from tokenizers import Tokenizer

    with np.load(path) as z:
        train_ids, val_ids = z["train"], z["val"]
        meta = json.loads(str(z["meta"]))
    text = meta.pop("tokenizer")
    os.makedirs(out_dir, exist_ok=True)
    tok_path = os.path.join(out_dir, "tokenizer.json")
    if os.path.exists(tok_path):
        if Tokenizer.from_file(tok_path).to_str() != Tokenizer.from_str(text).to_str():
            raise SystemExit(f"--corpus {path}: its tokenizer differs from {tok_path}")
    else:
        with open(tok_path, "w") as f:
            f.write(text)
    log(f"corpus {path}: {len(train_ids) / 1e6:.2f}M train, {len(val_ids) / 1e3:.1f}K held-out "
        f"tokens (Python {meta['python']} standard library, packages {meta['packages']})")
    return Tokenizer.from_str(text), train_ids, val_ids, meta


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kind", choices=["main", "draft"], default="main")
    ap.add_argument("--minutes", type=float, default=85.0, help="wall-clock training budget")
    ap.add_argument("--out", default=os.path.join(ROOT, "models", "demo"))
    ap.add_argument("--extra-packages", default=",".join(EXTRA_PACKAGES),
                    help="installed packages whose .py sources are added to the training text "
                         "('' for the standard library alone)")
    ap.add_argument("--tokenizer-only", action="store_true")
    ap.add_argument("--retrain-tokenizer", action="store_true")
    ap.add_argument("--tiny", action="store_true", help="a tiny model (smoke tests)")
    ap.add_argument("--save-every", type=float, default=5.0, help="minutes between checkpoints")
    ap.add_argument("--eval-every", type=float, default=5.0, help="minutes between val evals")
    ap.add_argument("--log-every", type=int, default=20, help="steps between train-loss lines")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--size", default="",
                    help="override model sizes, e.g. hidden_size=192,num_layers=4,head_dim=48")
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--ctx", type=int, default=None)
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--max-len", type=int, default=2048, help="config max_len (inference)")
    ap.add_argument("--warmup", type=float, default=0.03, help="warmup as a fraction of time")
    ap.add_argument("--val-tokens", type=int, default=200_000,
                    help="cap on held-out tokens evaluated (all when smaller)")
    ap.add_argument("--init-from", default="",
                    help="start from the <kind> model in this directory instead of random weights "
                         "(a model without GQA is widened to this run's heads, see expand_heads)")
    ap.add_argument("--teacher", default="",
                    help="distil: train on the `main` model in this directory's next-token "
                         "distributions (soft cross-entropy) instead of the data's tokens")
    ap.add_argument("--save-corpus", default="", metavar="FILE.npz",
                    help="write the encoded corpus and tokenizer to FILE.npz and exit")
    ap.add_argument("--corpus", default="", metavar="FILE.npz",
                    help="train on a --save-corpus file instead of this machine's files")
    ap.add_argument("--save-dtype", choices=["float32", "float16"], default="float32",
                    help="dtype of the saved weights (float16: half the size, e.g. to fit a "
                         "device's file-size limit; training stays float32)")
    ap.add_argument("--matmul-precision", default=None,
                    choices=["default", "tensorfloat32", "bfloat16", "highest"],
                    help="jax_default_matmul_precision for training (tensorfloat32 runs f32 "
                         "products on a GPU's tensor cores)")
    ap.add_argument("--bench-steps", type=int, default=0,
                    help="only time this many train steps (no saving) and exit")
    args = ap.parse_args(argv)

    t_start = time.time()
    if args.corpus:
        tok, train_ids, val_ids, corpus = load_corpus(args.corpus, args.out)
    else:
        tok, train_ids, val_ids, corpus = build_corpus(args)
        if train_ids is None:  # --tokenizer-only
            return 0
    if args.save_corpus:
        save_corpus(args.save_corpus, tok, train_ids, val_ids, corpus)
        log(f"saved the encoded corpus to {args.save_corpus}")
        return 0

    import jax
    import jax.numpy as jnp
    import optax

    from models.llama import Llama, LlamaConfig

    if args.matmul_precision:
        jax.config.update("jax_default_matmul_precision", args.matmul_precision)

    size = dict(SIZES["tiny" if args.tiny else args.kind])
    for item in filter(None, args.size.split(",")):
        k, v = item.split("=")
        size[k.strip()] = type(size[k.strip()])(v)
    ctx = args.ctx or size.pop("ctx")
    size.pop("ctx", None)
    batch = args.batch or size.pop("batch")
    size.pop("batch", None)
    peak_lr = args.lr or size.pop("lr")
    size.pop("lr", None)
    eot = tok.token_to_id(EOT)
    # Trained on ctx-token windows; at inference a sliding window of ctx keys keeps every
    # query in the trained regime (RoPE is relative), so the model can run past ctx tokens.
    config = LlamaConfig(vocab_size=tok.get_vocab_size(), max_len=args.max_len,
                         sliding_window=ctx, eos_token_ids=(eot,),
                         rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True, **size)
    model = Llama(config)
    key = jax.random.PRNGKey(args.seed)
    from models.demo import load, load_config

    init_record = None
    if args.init_from:
        old_model, old_params, _ = load(args.kind, args.init_from)
        old = dataclasses.replace(old_model.config, max_len=config.max_len,
                                  sliding_window=config.sliding_window)
        params = jax.tree_util.tree_map(np.asarray, old_params)
        if (old.num_heads, old.num_kv_heads) != (config.num_heads, config.num_kv_heads):
            params = expand_heads(params, old, config, np.random.default_rng(args.seed))
        params = jax.tree_util.tree_map(jnp.asarray, params)
        prev = load_config(args.kind, args.init_from).get("training", {})
        init_record = {"sha256": file_sha256(os.path.join(args.init_from,
                                                          f"{args.kind}.safetensors")),
                       "num_heads": old.num_heads, "num_kv_heads": old.num_kv_heads,
                       "val_loss": prev.get("val_loss"), "train_minutes": prev.get("train_minutes"),
                       "tokens_seen": prev.get("tokens_seen")}
        log(f"initialised from {args.init_from}/{args.kind}.safetensors "
            f"({old.num_heads} heads -> {config.num_heads} query / {config.num_kv_heads} KV)")
    else:
        params = model.init_params(key, jnp.float32, scale=0.02)
        # GPT-2 style: residual output projections scaled down by 1/sqrt(2 * layers).
        resid = 1.0 / math.sqrt(2 * config.num_layers)
        for layer in params["layers"]:
            layer["o"] = layer["o"] * resid
            layer["down"] = layer["down"] * resid
    teacher = teacher_params = teacher_record = None
    if args.teacher:
        teacher, teacher_params, _ = load("main", args.teacher)
        teacher_record = {"sha256": file_sha256(os.path.join(args.teacher, "main.safetensors")),
                          "val_loss": load_config("main", args.teacher)
                          .get("training", {}).get("val_loss")}
        log(f"distilling from {args.teacher}/main.safetensors")
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(params))
    log(f"model {args.kind}{' (tiny)' if args.tiny else ''}: {n_params / 1e6:.2f}M params, "
        f"d={config.hidden_size} L={config.num_layers} H={config.num_heads}x{config.head_dim} "
        f"F={config.intermediate_size} V={config.vocab_size} ctx={ctx} batch={batch} "
        f"peak_lr={peak_lr}")

    def decay_mask(p):
        return jax.tree_util.tree_map(lambda x: x.ndim >= 2, p)

    opt = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.inject_hyperparams(optax.adamw)(learning_rate=peak_lr, b1=0.9, b2=0.95,
                                              eps=1e-8, weight_decay=0.1, mask=decay_mask),
    )
    opt_state = opt.init(params)

    def loss_fn(p, x, y):
        logp = jax.nn.log_softmax(model.logits(p, x), axis=-1)
        if teacher is None:
            return -jnp.mean(jnp.take_along_axis(logp, y[..., None], axis=-1))
        # distillation: cross-entropy against the teacher's whole next-token distribution
        target = jax.nn.softmax(jax.lax.stop_gradient(teacher.logits(teacher_params, x)), -1)
        return -jnp.mean(jnp.sum(target * logp, axis=-1))

    @jax.jit
    def train_step(p, s, x, y, lr):
        loss, grads = jax.value_and_grad(loss_fn)(p, x, y)
        s[1].hyperparams["learning_rate"] = lr
        updates, s = opt.update(grads, s, p)
        return optax.apply_updates(p, updates), s, loss

    @jax.jit
    def eval_sum(p, x, y):
        logits = model.logits(p, x)
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.sum(jnp.take_along_axis(logp, y[..., None], axis=-1))

    # Held-out windows: non-overlapping ctx+1 slices of the held-out stream (last one dropped).
    n_val = min(len(val_ids), args.val_tokens)
    nw = max(1, (n_val - 1) // ctx)
    vx = np.stack([val_ids[i * ctx:i * ctx + ctx] for i in range(nw)]).astype(np.int32)
    vy = np.stack([val_ids[i * ctx + 1:i * ctx + ctx + 1] for i in range(nw)]).astype(np.int32)
    eval_bs = 64

    def evaluate(p) -> float:
        total = 0.0
        for i in range(0, nw, eval_bs):
            total += float(eval_sum(p, vx[i:i + eval_bs], vy[i:i + eval_bs]))
        return total / (nw * ctx)

    rng = np.random.default_rng(args.seed)
    max_start = len(train_ids) - ctx - 1

    def get_batch():
        starts = rng.integers(0, max_start, size=batch)
        idx = starts[:, None] + np.arange(ctx + 1)[None, :]
        w = train_ids[idx].astype(np.int32)
        return w[:, :-1], w[:, 1:]

    budget = args.minutes * 60.0
    tokens_per_step = batch * ctx
    step, tokens_seen = 0, 0
    val_loss = None
    history = []

    def record(final: bool) -> dict:
        return {
            "val_loss": None if val_loss is None else round(val_loss, 4),
            "val_tokens": int(nw * ctx),
            "train_minutes": round(train_time / 60, 2),
            "tokens_seen": int(tokens_seen),
            "steps": int(step),
            "tokens_per_second": round(tokens_seen / max(train_time, 1e-9), 1),
            "params": int(n_params),
            "ctx": ctx, "batch": batch, "peak_lr": peak_lr, "seed": args.seed,
            "train_tokens": int(len(train_ids)),
            **corpus,
            "device": jax.devices()[0].device_kind, "jax": jax.__version__,
            "matmul_precision": args.matmul_precision, "saved_dtype": args.save_dtype,
            "finished": final,
            "init_from": init_record,
            "distilled_from": teacher_record,
            "val_history": history,
            "script": "scripts/train_demo.py",
        }

    # Compile outside the budget.
    t0 = time.time()
    x, y = get_batch()
    lowered = train_step.lower(params, opt_state, x, y, jnp.float32(0.0))
    lowered.compile()
    log(f"compiled train step in {time.time() - t0:.1f}s")
    if args.bench_steps:
        x, y = get_batch()
        params, opt_state, loss = train_step(params, opt_state, x, y, jnp.float32(1e-4))
        loss.block_until_ready()
        t0 = time.time()
        for _ in range(args.bench_steps):
            x, y = get_batch()
            params, opt_state, loss = train_step(params, opt_state, x, y, jnp.float32(1e-4))
        loss.block_until_ready()
        dt = (time.time() - t0) / args.bench_steps
        log(f"bench: {dt * 1000:.0f} ms/step, {tokens_per_step / dt:.0f} tokens/s, "
            f"loss {float(loss):.3f}")
        return 0

    train_time = 0.0
    t_train0 = time.time()
    last_save = last_eval = t_train0
    ema = None
    while True:
        train_time = time.time() - t_train0
        if train_time >= budget:
            break
        lr = lr_at(train_time / budget, peak_lr, args.warmup)
        x, y = get_batch()
        params, opt_state, loss = train_step(params, opt_state, x, y, jnp.float32(lr))
        step += 1
        tokens_seen += tokens_per_step
        if step % args.log_every == 0:
            lv = float(loss)
            ema = lv if ema is None else 0.9 * ema + 0.1 * lv
            el = time.time() - t_train0
            log(f"step {step} loss {lv:.3f} (ema {ema:.3f}) lr {lr:.2e} "
                f"tok {tokens_seen / 1e6:.2f}M {tokens_seen / el:.0f} tok/s "
                f"{el / 60:.1f}/{args.minutes:g} min")
        now = time.time()
        if now - last_eval >= args.eval_every * 60:
            train_time = now - t_train0
            val_loss = evaluate(params)
            history.append([round(train_time / 60, 2), int(tokens_seen), round(val_loss, 4)])
            log(f"held-out loss {val_loss:.4f} nats/token at step {step} "
                f"({tokens_seen / 1e6:.2f}M tokens)")
            last_eval = time.time()
        if now - last_save >= args.save_every * 60:
            train_time = now - t_train0
            save_model(args.out, args.kind, config, params, record(False), args.save_dtype)
            log(f"saved checkpoint to {args.out}/{args.kind}.safetensors")
            last_save = time.time()

    train_time = time.time() - t_train0
    if args.save_dtype != "float32":  # the final loss is the saved (rounded) weights' loss
        params = jax.tree_util.tree_map(lambda x: x.astype(args.save_dtype).astype(x.dtype),
                                        params)
    val_loss = evaluate(params)
    history.append([round(train_time / 60, 2), int(tokens_seen), round(val_loss, 4)])
    save_model(args.out, args.kind, config, params, record(True), args.save_dtype)
    log(f"done: {step} steps, {tokens_seen / 1e6:.2f}M tokens in {train_time / 60:.1f} min "
        f"({tokens_seen / train_time:.0f} tok/s); final held-out loss {val_loss:.4f} nats/token "
        f"-> {args.out}/{args.kind}.safetensors (total {(time.time() - t_start) / 60:.1f} min)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
