#!/usr/bin/env bash
# Issue #17 on a lent accelerator, as one prepared command (the device tool's `run`): train the
# demo `main` from scratch on the card's corpus, distil the `draft` from it, and measure what
# the model card reports (held-out loss, draft acceptance and speed-up at k = 2 / 4 / 6 beside
# plain decoding, samples that parse).
#
# Here, first (the corpus is this machine's Python 3.11 text; the accelerator has another Python):
#   python scripts/train_demo.py --save-corpus corpus.npz --out models/demo   (7 MB, git-ignored)
# There (run, carry ["corpus.npz"], timeout_s ~ MAIN + DRAFT minutes + 3):
#   bash scripts/accelerator_demo_training.sh MAIN_MINUTES DRAFT_MINUTES
# The weights, records and one log (6 files: the device returns at most 8) come back under
# $OUT/demo; copy them to models/demo and update MODEL_CARD.md and the README's `make demo`
# output from them. Run on CPU with tiny budgets (`OUT=/tmp/x BATCH=8 ... 0.05 0.05`) it
# exercises every step in ~1.5 minutes.
set -euo pipefail
main_minutes=${1:-6}
draft_minutes=${2:-3}
batch=${BATCH:-256}
out=${OUT:-/tmp/demo-run}/demo
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python3 -c "import jax; print(jax.__version__, jax.devices())"

python3 scripts/train_demo.py --kind main --corpus corpus.npz --minutes "$main_minutes" \
    --batch "$batch" --eval-every 1 --save-every 2 --out "$out" 2>&1 | tee -a "$out/run.log"
python3 scripts/train_demo.py --kind draft --corpus corpus.npz --teacher "$out" \
    --minutes "$draft_minutes" --batch "$batch" --eval-every 1 --save-every 2 --out "$out" \
    2>&1 | tee -a "$out/run.log"

python3 - "$out" <<'EOF' 2>&1 | tee -a "$out/run.log"
import importlib, json, sys

from jaxdecode.cli.bench import CODE_EDIT_PROMPT, BenchConfig, time_speculative

demo = importlib.import_module("models.demo")
main, main_params, tok = demo.load("main", sys.argv[1])
draft, draft_params, _ = demo.load("draft", sys.argv[1])
print("held-out loss", demo.load_config("main", sys.argv[1])["training"]["val_loss"])
# the model card's figures: `jaxdecode bench --speculative`, on this directory's pair
print(json.dumps(time_speculative(main, main_params, draft, draft_params,
                                  BenchConfig(new_tokens=96, repeats=5),
                                  prompt_ids=[tok.encode(CODE_EDIT_PROMPT).ids]), indent=1))
EOF
python3 scripts/demo_samples.py --dir "$out" 2>&1 | tee -a "$out/run.log"
