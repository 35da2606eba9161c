"""A burst of 16 short prompts arrives while 8 streams decode (llama-512, 16 slots): the running
streams' largest inter-token gaps during each burst and the burst's time to first token.
Run from a tree's root: python burst.py CKPT OUT.json"""
import json, sys, threading, time
import numpy as np
import jaxdecode as jd
from models import hf

model, params, tok = hf.load(sys.argv[1])
llm = jd.LLM(model, params, tok, max_slots=16, max_len=2048)
llm.warmup(max_prompt_len=32)
rng = np.random.default_rng(0)
times = {}

def run(name, prompt, sp):
    arrivals = times.setdefault(name, [time.perf_counter()])
    for event in llm.stream(prompt, sp):
        if event.kind not in ("start", "completed", "cancelled", "failed"):
            arrivals.append(time.perf_counter())

long = jd.SamplingParams(temperature=0.8, seed=1, max_tokens=1000, ignore_eos=True, utf8_errors="replace")
streams = [threading.Thread(target=run, args=(f"s{i}", rng.integers(1, 8000, 16).tolist(), long))
           for i in range(8)]
for t in streams: t.start()
time.sleep(4.0)
bursts = []
for b in range(4):
    start = time.perf_counter()
    short = jd.SamplingParams(temperature=0.8, seed=b, max_tokens=4, ignore_eos=True, utf8_errors="replace")
    ts = [threading.Thread(target=run, args=(f"b{b}.{i}", rng.integers(1, 8000, 16).tolist(), short))
          for i in range(16)]
    for t in ts: t.start()
    for t in ts: t.join()
    end = time.perf_counter()
    ttft = [times[f"b{b}.{i}"][1] - times[f"b{b}.{i}"][0] for i in range(16)]
    gaps = []
    print({k: len(v) for k, v in times.items() if k.startswith("s")}, flush=True)
    for i in range(8):
        a = np.array(times[f"s{i}"][1:])
        gaps += np.diff(a[(a >= start) & (a <= end + 0.5)]).tolist()
    bursts.append({"ttft_ms_p50": 1e3 * float(np.median(ttft)), "ttft_ms_max": 1e3 * max(ttft),
                   "stream_gap_ms_max": 1e3 * max(gaps), "stream_gap_ms_p50": 1e3 * float(np.median(gaps)),
                   "burst_s": end - start})
    print(json.dumps(bursts[-1]), flush=True)
    time.sleep(1.0)
llm.close()
json.dump(bursts, open(sys.argv[2], "w"), indent=1)
