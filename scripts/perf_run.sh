#!/usr/bin/env bash
# The serving comparison of docs/performance.md ("Against vLLM"): start a server, warm it with one
# load test (not counted), run the counted load test (and `vllm bench serve` with VB=1), stop it.
# One script for every dated run under docs/performance/ (they differed only in their settings).
#
# Usage: scripts/perf_run.sh OUT STEP...
#   OUT                  folder for the records (lscpu.txt, commit.txt, loadtest-NAME.json, logs)
#   STEP "vllm NAME"     vLLM's CPU server (fp32, 16 sequences) named vllm-NAME
#   STEP "jd NAME [ARG...]"  `jaxdecode serve` named jaxdecode-NAME, ARGs added to its flags
#                        (e.g. "jd tile16-1 --row-tile 16", "jd tile4-1")
# Environment: TREE (the jaxdecode tree to serve, default this repository), CKPT (the HF
# checkpoint, default /work/ckpt512), PY (default TREE/.venv/bin/python, else /work/main's),
# VLLM (vllm's executable, default /work/vllm-venv/bin/vllm), VB=1 (also `vllm bench serve`:
# random 128 in / 64 out), JAX_COMPILATION_CACHE_DIR (default /work/jaxcache).
# Example (the 2026-12-05 run): VB=1 scripts/perf_run.sh /tmp/run "vllm 1" "jd tile16-1 --row-tile 16" \
#   "vllm 2" "jd tile16-2 --row-tile 16" "vllm 3" "jd tile16-3 --row-tile 16" "jd tile4-1"
set -u
[ $# -ge 2 ] || { sed -n 2,17p "$0"; exit 2; }
out=$(mkdir -p "$1" && cd "$1" && pwd); shift
repo=$(cd "$(dirname "$0")/.." && pwd)
TREE=${TREE:-$repo}; CKPT=${CKPT:-/work/ckpt512}; VLLM=${VLLM:-/work/vllm-venv/bin/vllm}
PY=${PY:-$TREE/.venv/bin/python}; [ -x "$PY" ] || PY=/work/main/.venv/bin/python
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/work/jaxcache}
lscpu > "$out/lscpu.txt"
git -C "$TREE" rev-parse HEAD > "$out/commit.txt"

wait_up() {  # port tries
  for _ in $(seq "$2"); do curl -s "localhost:$1/v1/models" >/dev/null && return 0; sleep 2; done
  echo "server on port $1 did not start" >&2; return 1
}
bench() {  # name port
  for run in "$1-warm" "$1"; do  # the first load test warms the server and is not counted
    (cd "$TREE" && JAX_PLATFORMS=cpu "$PY" -m jaxdecode.cli.bench.loadtest --url "http://127.0.0.1:$2" \
      --served-model-name ckpt512 --requests 64 --concurrency 16 --max-tokens 64 \
      --json "$out/loadtest-$run.json" > "$out/loadtest-$run.log" 2>&1)
  done
  if [ -n "${VB:-}" ]; then
    VLLM_TARGET_DEVICE=cpu timeout 900 "$VLLM" bench serve --backend openai --base-url "http://127.0.0.1:$2" \
      --model "$CKPT" --served-model-name ckpt512 --dataset-name random --random-input-len 128 \
      --random-output-len 64 --num-prompts 64 --max-concurrency 16 --ignore-eos > "$out/vllm-bench-$1.log" 2>&1
  fi
}
stop() {  # pid: the server's process group
  kill -- -"$1" 2>/dev/null; wait "$1" 2>/dev/null; sleep 5
}
vllm() {  # name
  setsid env VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=4 timeout 1500 "$VLLM" serve "$CKPT" --dtype float32 \
    --max-num-seqs 16 --port 8123 --max-model-len 2048 --served-model-name ckpt512 > "$out/vllm-serve-$1.log" 2>&1 &
  local pid=$!
  wait_up 8123 200 && bench "vllm-$1" 8123
  stop "$pid"
}
jd() {  # name [serve args]
  local name=$1; shift
  (cd "$TREE" && exec setsid env JAX_PLATFORMS=cpu timeout 1800 "$PY" -m jaxdecode.cli serve --model "$CKPT" \
    --max-slots 16 --max-len 2048 --warmup 256 --port 8124 "$@" \
    > "$out/jd-serve-$name.log" 2>&1) &
  local pid=$!
  wait_up 8124 900 && bench "jaxdecode-$name" 8124
  stop "$pid"
}
for step in "$@"; do eval "$step"; done
echo DONE
