out=/work/p19/cmp; cd /work/main
(JAX_PLATFORMS=cpu timeout 1200 .venv/bin/python -m jaxdecode.cli serve --model /work/ckpt512 --max-slots 16 --max-len 2048 --warmup --port 8124 > $out/jd-serve-vb.log 2>&1 &)
for i in $(seq 600); do curl -s localhost:8124/v1/models >/dev/null && break; sleep 2; done
VLLM_TARGET_DEVICE=cpu timeout 600 /work/vllm-venv/bin/vllm bench serve --backend openai --base-url http://127.0.0.1:8124 --model /work/ckpt512 --served-model-name ckpt512 --dataset-name random --random-input-len 128 --random-output-len 64 --num-prompts 64 --max-concurrency 16 --ignore-eos > $out/vllm-bench-vs-jaxdecode.log 2>&1
pkill -f "jaxdecode.cli serve"
echo DONE
