"""Write a Hugging Face checkpoint directory of a `jaxdecode bench` configuration (random
weights, seed 0, fp32) with a byte-level BPE tokenizer of exactly its vocabulary size, trained
on the standard library's Python sources -- one checkpoint that `jaxdecode serve` and other
servers (vLLM's CPU build) both load, and whose every token id decodes.

    python scripts/make_bench_checkpoint.py DIR [--config llama-512]

The comparison it serves is in docs/serving.md ("Against vLLM") and docs/performance.md.
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
import sysconfig
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

EOT = "<|endoftext|>"


def train_tokenizer(vocab_size: int, path: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))[:400]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train(files, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOT], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if tok.get_vocab_size() != vocab_size:
        raise SystemExit(f"the tokenizer has {tok.get_vocab_size()} tokens, not {vocab_size}")
    tok.save(path)


def main() -> None:
    from jaxdecode.cli.bench.configs import BENCH_CONFIGS

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="the checkpoint directory to write")
    p.add_argument("--config", default="llama-512", choices=sorted(BENCH_CONFIGS))
    args = p.parse_args()

    import torch
    import transformers

    config = BENCH_CONFIGS[args.config]
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **config, bos_token_id=0, eos_token_id=0, pad_token_id=0))
    hf.to(torch.float32).eval().save_pretrained(args.out, safe_serialization=True)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "tokenizer.json")
        train_tokenizer(config["vocab_size"], path)
        transformers.PreTrainedTokenizerFast(
            tokenizer_file=path, eos_token=EOT, bos_token=EOT, pad_token=EOT,
        ).save_pretrained(args.out)
    print(f"wrote {args.out} ({args.config}, vocabulary {config['vocab_size']})")


if __name__ == "__main__":
    main()
