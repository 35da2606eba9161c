# Server warm-up, back to back on an idle machine (2026-12-05): before = 8523af8 (a worktree), after = 154facc;
# llama-512, --max-slots 16 --max-len 2048 --warmup 256 --row-tile 16, compilation cache /work/jaxcache (warm)
# or a fresh directory with JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 (min0-cold, then min0-warm, min0-warm2).
# usage: warm.sh NAME CACHE_DIR [MIN_SECS]; the 'before' runs used a copy with cd /work/base.
cd /work/main
export JAX_COMPILATION_CACHE_DIR=$2
[ -n "$3" ] && export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=$3
(JAX_PLATFORMS=cpu timeout 900 .venv/bin/python -m jaxdecode.cli serve --model /work/ckpt512 --max-slots 16 --max-len 2048 --warmup 256 --row-tile 16 --port 8124 > /work/exp/warm-$1.log 2>&1 &)
for i in $(seq 900); do curl -s localhost:8124/v1/models >/dev/null && break; sleep 1; done
pkill -f "jaxdecode.cli serve"; sleep 3
head -1 /work/exp/warm-$1.log | cut -c1-170
