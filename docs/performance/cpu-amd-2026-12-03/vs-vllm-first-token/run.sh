set -x
out=/work/p21/cmp2; cd /work/main
lscpu > $out/lscpu.txt
export JAX_COMPILATION_CACHE_DIR=/work/p21/jaxcache
bench() {  # name port
  JAX_PLATFORMS=cpu .venv/bin/python -m jaxdecode.cli.bench.loadtest --url http://127.0.0.1:$2 --served-model-name ckpt512 --requests 64 --concurrency 16 --max-tokens 64 --json $out/loadtest-$1.json > $out/loadtest-$1.log 2>&1
  if [ -n "$VB" ]; then VLLM_TARGET_DEVICE=cpu timeout 900 /work/vllm-venv/bin/vllm bench serve --backend openai --base-url http://127.0.0.1:$2 --model /work/ckpt512 --served-model-name ckpt512 --dataset-name random --random-input-len 128 --random-output-len 64 --num-prompts 64 --max-concurrency 16 --ignore-eos > $out/vllm-bench-$1.log 2>&1; fi
}
vllm_run() {
  (VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=4 timeout 1500 /work/vllm-venv/bin/vllm serve /work/ckpt512 --dtype float32 --max-num-seqs 16 --port 8123 --max-model-len 2048 --served-model-name ckpt512 > $out/vllm-serve-$1.log 2>&1 &)
  for i in $(seq 200); do curl -s localhost:8123/v1/models >/dev/null && break; sleep 2; done
  bench vllm-$1 8123
  pkill -f "vllm serve"; pkill -f EngineCore; sleep 10
}
jd_run() {  # name tree
  (cd $2 && JAX_PLATFORMS=cpu timeout 1800 /work/main/.venv/bin/python -m jaxdecode.cli serve --model /work/ckpt512 --max-slots 16 --max-len 2048 --warmup 256 --port 8124 > $out/jd-serve-$1.log 2>&1 &)
  for i in $(seq 900); do curl -s localhost:8124/v1/models >/dev/null && break; sleep 2; done
  bench jaxdecode-$1 8124
  pkill -f "jaxdecode.cli serve"; sleep 5
}
for step in "$@"; do eval "$step"; done
echo DONE
