#!/usr/bin/env bash
# Issue #17 on a lent accelerator, as one prepared command (the device tool's `run`): train the
# demo `main` from scratch on the card's corpus, then distil the `draft` from it on `main`'s own
# greedy continuations (scripts/draft_corpus.py). Loss, acceptance, speed-up and samples are
# measured afterwards on the CPU (where users run the demo) from the files that come back.
# Weights are saved as float16: the device returns files of at most 16 MiB (the f32 `main` is
# 29 MB; the 2026-12-04 run lost it that way). Products use TF32 (`--matmul-precision`): that
# run trained f32 at 0.64 M tokens/s on an H200, about 28 TFLOP/s, i.e. without tensor cores.
# The greedy corpus is 4096 prompts: the cached forward runs 4-row tiles (batch invariance),
# so its time grows with the batch; 16384 prompts at batch 2048 did not finish in 4 minutes.
#
# Here, first (the corpus is this machine's Python 3.11 text; the accelerator has another Python):
#   python scripts/train_demo.py --save-corpus corpus.npz --out models/demo \
#       --extra-packages jax,numpy,flax,optax,orbax,transformers   (17 MB, git-ignored)
# There (run, carry ["corpus.npz"], timeout_s ~ MAIN + DRAFT minutes + 2):
#   bash scripts/accelerator_demo_training.sh MAIN_MINUTES DRAFT_MINUTES
# The weights, records and one log (6 files: the device returns at most 8) come back under
# $OUT/demo; copy them to models/demo and update MODEL_CARD.md and the README's `make demo`
# output from them. Run on CPU with tiny budgets (`OUT=/tmp/x BATCH=8 PROMPTS=64 ... 0.05 0.05`)
# it exercises every step in about a minute.
# Sizes (bigger than the CPU-trained models, whose defaults stay in train_demo.py's SIZES):
# main 7.34 M parameters (d 256, 8 layers, 8 query / 4 KV heads x 32, 256-token context),
# draft 1.53 M (d 160, 3 layers, 4 / 2 heads x 40). The 2026-12-04 H200 run of `main` (f32,
# 4.5 min): held-out 2.47 (docs/performance/gpu/2026-12-04-h200/).
set -euo pipefail
main_size=hidden_size=256,num_layers=8,head_dim=32,intermediate_size=768
draft_size=hidden_size=160,num_layers=3,head_dim=40,intermediate_size=448
main_minutes=${1:-4.5}
draft_minutes=${2:-1.75}
batch=${BATCH:-256}
prompts=${PROMPTS:-4096}
out=${OUT:-/tmp/demo-run}/demo
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python3 -c "import jax; print(jax.__version__, jax.devices())" 2>&1 | tee -a "$out/run.log"

python3 scripts/train_demo.py --kind main --corpus corpus.npz --minutes "$main_minutes" \
    --size "$main_size" --ctx 256 --lr 2e-3 --batch "$batch" --eval-every 1 --save-every 1 \
    --log-every 200 --save-dtype float16 --matmul-precision tensorfloat32 --out "$out" \
    2>&1 | tee -a "$out/run.log"
python3 scripts/draft_corpus.py --corpus corpus.npz --teacher "$out" --out /tmp/draft.npz \
    --prompts "$prompts" --batch 512 2>&1 | tee -a "$out/run.log"
python3 scripts/train_demo.py --kind draft --corpus /tmp/draft.npz --teacher "$out" \
    --size "$draft_size" --minutes "$draft_minutes" --batch "$batch" --eval-every 1 \
    --save-every 1 --log-every 200 --save-dtype float16 --matmul-precision tensorfloat32 \
    --out "$out" 2>&1 | tee -a "$out/run.log"
