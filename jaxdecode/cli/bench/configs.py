"""The models `jaxdecode bench` measures: named random-weight configurations (`--model CONFIG`)
or a checkpoint, with the same weights in HF PyTorch for `--compare-hf`."""

from __future__ import annotations

from typing import Optional

from serving.loading import load_model

# Named random-weight configurations for `bench --model CONFIG`: HF config keywords (of
# LlamaConfig, or of the `model_type` given).
BENCH_CONFIGS = {
    # The reference configuration of issue #2: Llama-like, ~29M parameters, fp32.
    "llama-512": dict(vocab_size=8192, hidden_size=512, intermediate_size=1376,
                      num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8,
                      max_position_embeddings=4096, rms_norm_eps=1e-5),
    # For accelerators (the default there): TinyLlama-like, ~1.1B parameters, run in bf16.
    "llama-1b": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                     num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4,
                     max_position_embeddings=2048, rms_norm_eps=1e-5),
    # Gemma-2-shaped at llama-512's size: alternating sliding (512) and global layers, both
    # soft-caps, GeGLU, pre/post norms, tied embeddings -- its decode cost beside llama-512's.
    "gemma-512": dict(model_type="gemma2", vocab_size=8192, hidden_size=512,
                      intermediate_size=1376, num_hidden_layers=8, num_attention_heads=8,
                      num_key_value_heads=8, head_dim=64, max_position_embeddings=4096,
                      rms_norm_eps=1e-6, sliding_window=512, query_pre_attn_scalar=64,
                      attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
    # Mixtral-shaped at llama-512's active size: 8 experts, top 2, experts of 688 (half of
    # llama-512's 1376), so a token's active MLP weights equal llama-512's (4x its total).
    "moe-512": dict(model_type="mixtral", vocab_size=8192, hidden_size=512,
                    intermediate_size=688, num_hidden_layers=8, num_attention_heads=8,
                    num_key_value_heads=8, max_position_embeddings=4096, rms_norm_eps=1e-5,
                    rope_theta=10000.0, num_local_experts=8, num_experts_per_tok=2),
    "llama-tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=256, rms_norm_eps=1e-5),
}


def named_model(name: str, **replace):
    """The jaxdecode model of a named configuration (config fields overridden by `replace`)."""
    import dataclasses

    import models

    c = BENCH_CONFIGS[name]
    common = dict(
        vocab_size=c["vocab_size"], num_layers=c["num_hidden_layers"],
        num_heads=c["num_attention_heads"], num_kv_heads=c["num_key_value_heads"],
        head_dim=c.get("head_dim", c["hidden_size"] // c["num_attention_heads"]),
        max_len=c["max_position_embeddings"], hidden_size=c["hidden_size"],
        intermediate_size=c["intermediate_size"], rms_norm_eps=c["rms_norm_eps"])
    if c.get("model_type") == "gemma2":
        n = c["num_hidden_layers"]
        config = models.GemmaConfig(
            **common, sliding_window=c["sliding_window"],
            layer_types=tuple("sliding_attention" if i % 2 == 0 else "full_attention"
                              for i in range(n)),
            query_pre_attn_scalar=c["query_pre_attn_scalar"],
            attn_logit_softcapping=c["attn_logit_softcapping"],
            final_logit_softcapping=c["final_logit_softcapping"])
        return models.Gemma(dataclasses.replace(config, **replace))
    if c.get("model_type") == "mixtral":
        config = models.MoeConfig(
            **common, rope_theta=c["rope_theta"], num_experts=c["num_local_experts"],
            num_experts_per_tok=c["num_experts_per_tok"],
            moe_intermediate_size=c["intermediate_size"])
        return models.Moe(dataclasses.replace(config, **replace))
    return models.Llama(dataclasses.replace(models.LlamaConfig(**common), **replace))


def _hf_model(name: str):
    """HF PyTorch model of a named configuration (random weights, seeded by the caller)."""
    import transformers

    c = dict(BENCH_CONFIGS[name])
    model_type = c.pop("model_type", None)
    if model_type is None:
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**c))
    return transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(model_type, **c), attn_implementation="eager")


def bench_model(spec: str, compare_hf: bool, workdir: str, quantization: Optional[str] = None):
    """(model, params, hf_model or None) on the same weights (int8 in jaxdecode with
    `quantization` "int8"; HF keeps the float ones)."""
    import models

    if spec in BENCH_CONFIGS:
        bf16 = spec == "llama-1b"  # the accelerator configuration runs in bf16, HF too
        if not compare_hf:
            import jax

            model = named_model(spec)
            dtype = jax.numpy.bfloat16 if bf16 else jax.numpy.float32
            params = model.init_params(jax.random.key(0), dtype=dtype)
            return model, models.quantize_params(params, quantization,
                                                 model.config.tie_word_embeddings), None
        import torch

        torch.manual_seed(0)
        with torch.device(hf_device()):  # initialised where it runs: 1B weights init fast there
            hf = _hf_model(spec)
        hf = hf.to(torch.bfloat16 if bf16 else torch.float32).eval()
        hf.save_pretrained(workdir, safe_serialization=True)
        model, params, _ = models.load(workdir, quantization=quantization)
        return model, params, hf
    model, params, _ = load_model(spec, quantization=quantization)
    hf = None
    if compare_hf:
        if spec == "demo":
            raise SystemExit("--compare-hf: needs a Hugging Face directory or a named config")
        import torch
        import transformers

        hf = transformers.AutoModelForCausalLM.from_pretrained(spec, dtype=torch.float32)
        hf = hf.to(hf_device()).eval()
    return model, params, hf


def hf_device() -> str:
    """Where the HF column runs: the GPU when jax runs on one and torch sees CUDA, else the
    CPU (each framework on the same kind of device, so the ratio compares like with like)."""
    import jax
    import torch

    return "cuda" if jax.default_backend() == "gpu" and torch.cuda.is_available() else "cpu"


def hf_comparable() -> bool:
    """Whether `--compare-hf` can put HF on jax's kind of device (CPU, or GPU with CUDA torch)."""
    import jax

    try:
        return jax.default_backend() == "cpu" or hf_device() == "cuda"
    except ImportError:  # no torch: only the CPU path, which reports the import itself
        return jax.default_backend() == "cpu"


def host_model(spec: str, quantization: Optional[str] = None):
    """(model, params, tokenizer, label) for the host-side sections, which need a real
    tokenizer: the checkpoint's, else the demo model's; a named config is rebuilt with the demo
    tokenizer's vocabulary (same shapes otherwise)."""
    import os

    import models

    label = spec if os.path.isdir(spec) else "demo"
    model, params, tokenizer = load_model(label, quantization=quantization)
    if spec in BENCH_CONFIGS:
        import jax

        model = named_model(spec, vocab_size=model.config.vocab_size,
                            eos_token_ids=model.config.eos_token_ids)
        params = models.quantize_params(model.init_params(jax.random.key(0)), quantization,
                                        model.config.tie_word_embeddings)
        label = f"{spec}, vocab {model.config.vocab_size}"
    return model, params, tokenizer, label
