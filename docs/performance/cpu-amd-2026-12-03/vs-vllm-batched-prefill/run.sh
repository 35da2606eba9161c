set -x
out=/work/p19/cmp; cd /work/main
lscpu > $out/lscpu.txt
vllm_run() {
  (VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=4 timeout 1200 /work/vllm-venv/bin/vllm serve /work/ckpt512 --dtype float32 --max-num-seqs 16 --port 8123 --max-model-len 2048 --served-model-name ckpt512 > $out/vllm-serve-$1.log 2>&1 &)
  for i in $(seq 200); do curl -s localhost:8123/v1/models >/dev/null && break; sleep 2; done
  JAX_PLATFORMS=cpu .venv/bin/python -m jaxdecode.cli.bench.loadtest --url http://127.0.0.1:8123 --served-model-name ckpt512 --requests 64 --concurrency 16 --max-tokens 64 --json $out/loadtest-vllm-$1.json > $out/loadtest-vllm-$1.log 2>&1
  pkill -f "vllm serve"; pkill -f EngineCore; sleep 10
}
jd_run() {  # name repo
  (cd $2 && JAX_PLATFORMS=cpu timeout 1500 /work/main/.venv/bin/python -m jaxdecode.cli serve --model /work/ckpt512 --max-slots 16 --max-len 2048 --warmup --port 8124 > $out/jd-serve-$1.log 2>&1 &)
  for i in $(seq 600); do curl -s localhost:8124/v1/models >/dev/null && break; sleep 2; done
  JAX_PLATFORMS=cpu .venv/bin/python -m jaxdecode.cli.bench.loadtest --url http://127.0.0.1:8124 --requests 64 --concurrency 16 --max-tokens 64 --json $out/loadtest-jaxdecode-$1.json > $out/loadtest-jaxdecode-$1.log 2>&1
  pkill -f "jaxdecode.cli serve"; sleep 5
}
vllm_run 1
jd_run new1 /work/main
jd_run old1 /work/old69
jd_run new2 /work/main
vllm_run 2
echo DONE
