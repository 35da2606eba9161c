"""The sections of the device check (`devicecheck.py`), each `fn(quick, out) -> figures` run in
a process of its own, and the goals of issue #38 read off their figures.

- environment: the device, driver, library versions, CPU, commit and XLA options.
- decode: the bench model (`llama-1b` bf16 on an accelerator, `llama-tiny` with --quick) at
  batches 1, 16 and 64 with batch invariance on and off, beside HF `generate` on the same
  device; and what the lowered decode step contains (weight products, while loops).
- kernels: the Pallas paged-attention kernels against the XLA path on the device (compiled on
  a GPU or TPU, in Pallas interpret mode on the CPU).
- invariance: contract X1 at logit level on the device: a probe row's raw logits, prefill and
  decode steps, bitwise alone and in batches, in both modes (the fast path's differences are
  reported, not required to be zero).
- serving: the HTTP load test (`bench --serve`) against `jaxdecode serve --model demo`.
"""

from __future__ import annotations

import math
import os
import platform
import subprocess
import sys
import tempfile

SECTIONS = {name: f"{__name__}:{name}"
            for name in ("environment", "decode", "kernels", "invariance", "serving")}


def _run(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _version(name: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def environment(quick: bool, out: str) -> dict:
    import jax

    from jaxdecode import invariance

    devices = jax.devices()
    lscpu = _run(["lscpu"])
    cpu = next((line.split(":", 1)[1].strip() for line in lscpu.splitlines()
                if line.startswith("Model name")), platform.processor())
    env = {"backend": jax.default_backend(), "devices": [d.device_kind for d in devices],
           "cpu": cpu, "cpus": os.cpu_count(), "python": sys.version.split()[0],
           "versions": {n: _version(n) for n in ("jax", "jaxlib", "flax", "numpy", "torch",
                                                  "transformers", "jax-cuda13-plugin",
                                                  "jax-cuda12-plugin")},
           "construction": invariance.construction(),
           "compiler_options": invariance.compiler_options(),
           "xla_flags": os.environ.get("XLA_FLAGS", ""),
           "commit": _run(["git", "rev-parse", "HEAD"]),
           "uncommitted_files": len(_run(["git", "status", "--porcelain"]).splitlines())}
    smi = _run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                "--format=csv,noheader"])
    if smi:
        env["nvidia_smi"] = smi
        with open(os.path.join(out, "nvidia-smi.txt"), "w") as f:
            f.write(_run(["nvidia-smi"]) + "\n")
    with open(os.path.join(out, "lscpu.txt"), "w") as f:
        f.write(lscpu + "\n")
    try:
        import torch

        env["torch_cuda"] = torch.version.cuda
        env["torch_sees_gpu"] = torch.cuda.is_available()
    except ImportError:
        pass
    return env


def _spec(quick: bool) -> str:
    import jax

    return "llama-tiny" if quick else ("llama-512" if jax.default_backend() == "cpu"
                                       else "llama-1b")


def decode(quick: bool, out: str) -> dict:
    from jaxdecode.cli.bench import throughput
    from jaxdecode.cli.bench.configs import bench_model, hf_comparable
    from jaxdecode.cli.bench.timing import BenchConfig
    from jaxdecode.engine.config import row_tiled

    try:
        compare_hf = hf_comparable()
    except Exception:  # noqa: BLE001 -- no usable torch: the rows carry no HF column
        compare_hf = False
    cfg = BenchConfig(batches=(1, 4) if quick else (1, 16, 64),
                      new_tokens=16 if quick else 64, repeats=1 if quick else 3)
    with tempfile.TemporaryDirectory() as workdir:
        model, params, hf = bench_model(_spec(quick), compare_hf, workdir)
        fast = row_tiled(model, None, False)
        model = row_tiled(model, None, True)
        report = throughput.run(model, params, cfg, hf_model=hf, fast_model=fast)
    report["spec"] = _spec(quick)
    rows = 4 if quick else 16
    report["lowered"] = {"rows": rows, "invariant": lowered_step(model, params, rows),
                         "fast": lowered_step(fast, params, rows)}
    return report


def lowered_step(model, params, rows: int) -> dict:
    """What one decode step of `rows` rows contains once traced: its weight products (products
    with a matrix, by rows of the other operand), its while loops, and its optimization barriers."""
    import jax
    import jax.numpy as jnp

    cache = model.init_cache(rows, 128)
    jaxpr = jax.make_jaxpr(
        lambda p, t, pos, c: model.forward(p, t, pos, c, lengths=jnp.ones((rows,), jnp.int32))
    )(params, jnp.ones((rows, 1), jnp.int32), jnp.full((rows, 1), 3, jnp.int32), cache)
    counts = {"dots": {}, "while": 0, "optimization_barrier": 0}
    _count(jaxpr.jaxpr, counts)
    return {"weight_products": sum(counts["dots"].values()),
            "product_rows": {str(k): v for k, v in sorted(counts["dots"].items())},
            "while_loops": counts["while"], "optimization_barriers":
                counts["optimization_barrier"],
            "weight_matrices": 7 * model.config.num_layers + 1}


def _count(jaxpr, counts: dict) -> None:
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "dot_general" and eqn.invars[1].aval.ndim == 2:  # x [..., K] @ a weight
            rows = math.prod(eqn.invars[0].aval.shape[:-1])
            counts["dots"][rows] = counts["dots"].get(rows, 0) + 1
        elif name in ("while", "optimization_barrier"):
            counts[name] += 1
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    _count(inner, counts)


def kernels(quick: bool, out: str) -> dict:
    """Each Pallas decode kernel of this backend against the XLA path (gathered pages and the
    attention of models/layers.py) on one pool: max |difference| and time per call."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxdecode.cli.bench.timing import median_time
    from jaxdecode.model_api import PagedKVCache
    from models import layers, paged_attention

    backend = jax.default_backend()
    b, h, kvh, d, ps, kv_len = (3, 4, 2, 16, 16, 128) if quick else (16, 32, 4, 64, 16, 1024)
    dtype = jnp.float32 if backend == "cpu" else jnp.bfloat16
    per_row = kv_len // ps
    n = b * per_row + 1
    rng = np.random.default_rng(0)
    k, v = (jnp.asarray(rng.normal(size=(kvh, 2, n, ps, d)), dtype) for _ in range(2))
    table = jnp.asarray(1 + rng.permutation(b * per_row).reshape(b, per_row), jnp.int32)
    lengths = jnp.asarray(rng.integers(1, kv_len + 1, b), jnp.int32)
    cache = PagedKVCache(k=k, v=v, page_table=table, lengths=lengths, max_len=kv_len)
    q = jnp.asarray(rng.normal(size=(b, 1, h, d)), dtype)
    pos = (lengths - 1)[:, None]

    def xla_path(q, cache):
        keys, values = cache.read(1, kv_len)
        return layers.attention(q, keys, values, pos, jnp.arange(kv_len), None)

    want = jax.jit(xla_path)(q, cache)
    timed = lambda f: median_time(lambda: f(q, cache).block_until_ready(), 5) * 1e3  # noqa: E731
    result = {"backend": backend, "shape": dict(batch=b, heads=h, kv_heads=kvh, head_dim=d,
                                                page_size=ps, kv_len=kv_len),
              "dtype": jnp.dtype(dtype).name, "xla_ms": timed(jax.jit(xla_path)), "kernels": {}}
    interpret = backend == "cpu"
    names = ("gpu", "tpu") if interpret else (backend,)
    for name in names:
        kernel = paged_attention.KERNELS[name]
        fn = jax.jit(lambda q, cache, kernel=kernel: kernel(q, cache, 1, lengths, kv_len,
                                                           interpret=interpret))
        got = fn(q, cache)
        err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32))))
        result["kernels"][name] = {"max_abs_diff": err, "interpret": interpret,
                                   "ms": timed(fn), "within_tolerance": err < (
                                       1e-2 if dtype == jnp.float32 else 5e-2)}
    return result


def invariance(quick: bool, out: str) -> dict:
    """Contract X1 on the device: the raw logits of a probe row at every step (the prefill's
    last position first) alone, and at a random slot among random neighbours in batches of
    the sizes below; per mode, how many batches gave the lone row's bits, and the largest
    difference."""
    import jax
    import numpy as np

    import jaxdecode as jd
    from jaxdecode import invariance as construction
    from jaxdecode.cli.bench.configs import named_model
    from jaxdecode.engine.config import row_tiled
    import models

    if quick:
        model, params, _ = models.demo()
        sizes = (3,)
    else:
        model = named_model("llama-512")
        params = model.init_params(jax.random.key(0), dtype=jax.numpy.bfloat16)
        sizes = (3, 16, 64)
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size
    probe = rng.integers(3, vocab, 7).tolist()
    sp = jd.SamplingParams(temperature=0.9, top_k=50, seed=1234, max_tokens=4, ignore_eos=True)
    result = {"model": "demo" if quick else "llama-512 bf16", "sizes": list(sizes), "modes": {}}
    for mode, invariant in (("invariant", True), ("fast", False)):
        m = row_tiled(model, None, invariant)
        alone = _probe_logits(m, params, [probe], [sp], 0)
        same, worst = 0, 0.0
        for size in sizes:
            prompts = [rng.integers(3, vocab, int(rng.integers(1, 40))).tolist()
                       for _ in range(size)]
            sps = [jd.SamplingParams(temperature=0.7, seed=int(rng.integers(1 << 30)),
                                     max_tokens=4, ignore_eos=True) for _ in range(size)]
            slot = int(rng.integers(size))
            prompts[slot], sps[slot] = probe, sp
            got = _probe_logits(m, params, prompts, sps, slot)
            same += bool(np.array_equal(alone, got))
            worst = max(worst, float(np.max(np.abs(alone - got))))
        result["modes"][mode] = {"construction": construction.mode_of(m),
                                 "bitwise_batches": same, "batches": len(sizes),
                                 "max_abs_diff": worst}
    return result


def _probe_logits(model, params, prompts, sps, slot):
    import numpy as np

    import jaxdecode as jd

    out = jd.generate(model, params, prompts, sps, return_logits=True,
                      batch_invariant=model.batch_invariant)
    return np.asarray(out.logits[slot])


def serving(quick: bool, out: str) -> dict:
    """`jaxdecode bench --serve` (which starts `jaxdecode serve --model demo`) at one
    concurrency level; the load test's report."""
    import json

    path = os.path.join(out, "serving-loadtest.json")
    cmd = [sys.executable, "-m", "jaxdecode.cli", "bench", "--serve", "--model", "demo",
           "--max-slots", "2" if quick else "16", "--max-len", "128" if quick else "512",
           "--requests", "4" if quick else "64", "--concurrency", "2" if quick else "16",
           "--max-tokens", "8" if quick else "64", "--warmup-requests", "1" if quick else "4",
           "--json", path]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    sys.stdout.write(proc.stdout)
    sys.stderr.write(proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"the load test exited {proc.returncode}: "
                           f"{(proc.stderr or proc.stdout).strip().splitlines()[-1:]}")
    with open(path) as f:
        report = json.load(f)
    return {"levels": report["levels"], "table": proc.stdout.strip()}


# -- goals and the report's text ----------------------------------------------------------------

def goals(sections: dict) -> list[dict]:
    """Issue #38's goals, from the decode section where it ran: on a GPU, batch 1 at most 2 ms
    a step, batch 16 at least 2x HF, an invariance tax at most 10% at batch 16; on the CPU
    the fast path at least 2.0x HF at batch 1 and 1.5x at batch 16, the invariant mode within
    15% of it. Kernels within tolerance and X1 bitwise in the invariant mode, everywhere."""
    found = []
    dec = sections.get("decode", {})
    if dec.get("status") == "ok":
        fig = dec["figures"]
        rows = {r["batch"]: r for r in fig["rows"]}
        gpu = fig["machine"]["backend"] != "cpu"
        add = lambda goal, figure, met: found.append(  # noqa: E731
            {"goal": goal, "figure": figure, "met": bool(met)})
        if gpu and 1 in rows:
            ms = rows[1]["jaxdecode"]["step_ms"]
            add("batch 1 step <= 2 ms", f"{ms:.2f} ms", ms <= 2.0)
        for batch, want_fast in ((1, 2.0), (16, 1.5)):
            row = rows.get(batch)
            if row is None:
                continue
            if gpu and batch == 16 and "ratio" in row:
                add("batch 16 >= 2x HF", f"{row['ratio']:.2f}x", row["ratio"] >= 2.0)
            if not gpu and "fast_ratio" in row:
                add(f"fast path batch {batch} >= {want_fast}x HF", f"{row['fast_ratio']:.2f}x",
                    row["fast_ratio"] >= want_fast)
            if "tax" in row:
                limit = 0.10 if gpu else 0.15
                if gpu and batch != 16:
                    continue
                add(f"invariance tax batch {batch} <= {limit:.0%}", f"{row['tax']:.1%}",
                    row["tax"] <= limit)
    ker = sections.get("kernels", {})
    if ker.get("status") == "ok":
        for name, k in ker["figures"]["kernels"].items():
            found.append({"goal": f"{name} kernel matches the XLA path",
                          "figure": f"max |diff| {k['max_abs_diff']:.2g}",
                          "met": k["within_tolerance"]})
    inv = sections.get("invariance", {})
    if inv.get("status") == "ok":
        m = inv["figures"]["modes"]["invariant"]
        found.append({"goal": "X1: probe logits bitwise in every batch (invariant mode)",
                      "figure": f"{m['bitwise_batches']}/{m['batches']}",
                      "met": m["bitwise_batches"] == m["batches"]})
    return found


def format_section(name: str, fig: dict) -> list[str]:
    if name == "environment":
        return [f"- {k}: {v}" for k, v in fig.items()]
    if name == "decode":
        from jaxdecode.cli.bench import report as report_mod

        lines = [f"Model `{fig['spec']}`, {fig['dtype']}.", "", report_mod.format_table(fig), ""]
        for mode in ("invariant", "fast"):
            low = fig["lowered"][mode]
            lines.append(f"- lowered decode step, {fig['lowered']['rows']} rows, {mode}: "
                         f"{low['weight_products']} weight products (rows: "
                         f"{low['product_rows']}) for {low['weight_matrices']} weight "
                         f"matrices, {low['while_loops']} while loops, "
                         f"{low['optimization_barriers']} optimization barriers")
        return lines
    if name == "kernels":
        lines = [f"{fig['backend']}, {fig['dtype']}, {fig['shape']}; XLA path "
                 f"{fig['xla_ms']:.3f} ms", ""]
        lines += [f"- {k}{' (interpret mode)' if v['interpret'] else ''}: max |diff| "
                  f"{v['max_abs_diff']:.3g}, {v['ms']:.3f} ms" for k, v in fig["kernels"].items()]
        return lines
    if name == "invariance":
        return [f"Model {fig['model']}, batches {fig['sizes']}:", ""] + [
            f"- {mode} ({m['construction']}): {m['bitwise_batches']}/{m['batches']} batches "
            f"bitwise, max |diff| {m['max_abs_diff']:.3g}" for mode, m in fig["modes"].items()]
    if name == "serving":
        return ["```", fig["table"], "```"]
    return [f"```\n{fig}\n```"]
