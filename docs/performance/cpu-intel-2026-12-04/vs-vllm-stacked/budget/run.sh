out=/work/exp/budget; cd /work/xp
export JAX_COMPILATION_CACHE_DIR=/work/jaxcache
bench() {
  JAX_PLATFORMS=cpu .venv/bin/python -m jaxdecode.cli.bench.loadtest --url http://127.0.0.1:$2 --served-model-name ckpt512 --requests 64 --concurrency 16 --max-tokens 64 --json $out/loadtest-$1-warm.json > $out/loadtest-$1-warm.log 2>&1
  JAX_PLATFORMS=cpu .venv/bin/python -m jaxdecode.cli.bench.loadtest --url http://127.0.0.1:$2 --served-model-name ckpt512 --requests 64 --concurrency 16 --max-tokens 64 --json $out/loadtest-$1.json > $out/loadtest-$1.log 2>&1
}
jd_run() {  # name budget
  (JD_BUDGET=$2 JAX_PLATFORMS=cpu timeout 1800 .venv/bin/python -m jaxdecode.cli serve --model /work/ckpt512 --max-slots 16 --max-len 2048 --warmup 256 --row-tile 16 --port 8124 > $out/jd-serve-$1.log 2>&1 &)
  for i in $(seq 900); do curl -s localhost:8124/v1/models >/dev/null && break; sleep 2; done
  bench jaxdecode-$1 8124
  pkill -f "jaxdecode.cli serve"; sleep 5
}
for step in "$@"; do eval "$step"; done
echo DONE
