"""TTFT of a burst of 16 short prompts and of one alone, engine only (no HTTP)."""
import sys, time, threading, json
import numpy as np
from serving.loading import load_model
from jaxdecode.engine import LLM
from jaxdecode.config import SamplingParams

tile = int(sys.argv[1]); ptile = int(sys.argv[2]) if len(sys.argv) > 2 else None
model, params, tok = load_model("/work/ckpt512")
if ptile: model = model.with_prefill_tile(ptile)
llm = LLM(model, params, tok, max_slots=16, max_len=2048, row_tile=tile)
llm.warmup(64)
rng = np.random.default_rng(0)
def burst(n, new=8):
    prompts = [[int(x) for x in rng.integers(1, 8000, 15)] for _ in range(n)]
    sp = SamplingParams(max_tokens=new, ignore_eos=True, temperature=0.0)
    t0 = time.perf_counter(); firsts = [None]*n; ends=[None]*n
    hs = [llm.submit(p, sp) for p in prompts]
    def watch(i):
        for ev in hs[i].events():
            if firsts[i] is None and ev.kind == "delta": firsts[i] = time.perf_counter()-t0
        ends[i] = time.perf_counter()-t0
    ths = [threading.Thread(target=watch, args=(i,)) for i in range(n)]
    [t.start() for t in ths]; [t.join() for t in ths]
    return sorted(firsts), max(ends)
for rep in range(3):
    f, e = burst(16)
    print(f"tile {tile} burst16: ttft min/med/max {f[0]*1e3:.1f}/{f[8]*1e3:.1f}/{f[-1]*1e3:.1f} ms, end {e*1e3:.0f}")
for rep in range(3):
    f, e = burst(1)
    print(f"tile {tile} alone: ttft {f[0]*1e3:.1f} ms, end {e*1e3:.0f}")
llm.close()
