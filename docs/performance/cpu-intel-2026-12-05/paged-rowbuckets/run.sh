# #15's prefix-caching and `random` figures after the chunk-call row buckets (2026-12-05, Intel
# session; the commands of docs/performance.md "Prefix caching", demo model, one run each).
out=$(cd "$(dirname "$0")" && pwd); cd /work/main
lscpu > $out/lscpu.txt
git rev-parse HEAD > $out/commit.txt
export JAX_PLATFORMS=cpu JAX_COMPILATION_CACHE_DIR=/work/jaxcache
jd() { .venv/bin/python -m jaxdecode.cli bench --serve --model demo "$@"; }
prefix="--max-slots 8 --max-len 2048 --workload prefix-repetition --num-prefixes 4 --prefix-len 1024 --suffix-len 64 --output-len 32 --requests 48 --concurrency 1 --concurrency 4"
jd $prefix --json $out/prefix-on.json > $out/prefix-on.log 2>&1
jd $prefix --server-arg=--no-prefix-cache --json $out/prefix-off.json > $out/prefix-off.log 2>&1
random="--max-slots 16 --workload random --input-len 128 --output-len 64 --requests 64 --concurrency 16"
jd $random --json $out/random-on.json > $out/random-on.log 2>&1
jd $random --server-arg=--no-prefix-cache --json $out/random-off.json > $out/random-off.log 2>&1
echo DONE
