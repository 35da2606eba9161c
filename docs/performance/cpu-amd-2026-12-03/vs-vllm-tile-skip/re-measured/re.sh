set -x
out=. ; cd <checkout of 7911d94>
export JAX_PLATFORMS=cpu JAX_COMPILATION_CACHE_DIR=/work/p20/jaxcache
J=/work/main/.venv/bin/jaxdecode
P="--serve --model demo --max-slots 8 --max-len 2048 --workload prefix-repetition --num-prefixes 4 --prefix-len 1024 --suffix-len 64 --output-len 32 --requests 48 --concurrency 1 --concurrency 4"
$J bench $P --json $out/prefix-on.json > $out/prefix-on.txt 2>&1
$J bench $P --server-arg=--no-prefix-cache --json $out/prefix-off.json > $out/prefix-off.txt 2>&1
R="--serve --model demo --max-slots 8 --max-len 2048 --workload random --input-len 128 --output-len 64 --requests 64 --concurrency 16"
$J bench $R --json $out/random-on-1.json > $out/random-on-1.txt 2>&1
$J bench $R --server-arg=--no-prefix-cache --json $out/random-off-1.json > $out/random-off-1.txt 2>&1
$J bench $R --json $out/random-on-2.json > $out/random-on-2.txt 2>&1
$J bench $R --server-arg=--no-prefix-cache --json $out/random-off-2.json > $out/random-off-2.txt 2>&1
$J bench --batch 1 --batch 16 --paged --json $out/paged.json > $out/paged.txt 2>&1
echo DONE
