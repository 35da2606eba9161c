"""Shared fixtures.

`tiny_hf_checkpoint(name)` builds (once per session, lazily) a tiny randomly initialised Hugging
Face checkpoint directory with transformers + torch on CPU: config.json, generation_config.json,
safetensors weights and a small trained tokenizer, so `models.load(path)` works end to end.
Names: see `HF_CHECKPOINTS`. `demo` is the embedded demo model, loaded once per session.

`_release_compiled_programs` drops compiled programs after each test module: XLA:CPU keeps
every compiled program's machine code mapped (about six memory maps each), and the suite's
thousands of compilations in one process would exhaust `vm.max_map_count` (65530), after which
LLVM fails with "Cannot allocate memory" and the process crashes. `_release_before_map_exhaustion`
does the same after any test that leaves the process past half that limit (a module can compile
enough on its own).

A persistent compilation cache per xdist worker (`JAX_COMPILATION_CACHE_DIR`, set before jax
is imported): the programs that module release drops, and those the many engines of the tests
rebuild, are loaded from disk instead of compiled again. The subprocesses a test starts (CLI,
servers, notebooks) inherit the worker's directory. No size bound, so jax takes no file lock
(a locked cache shared by both workers stalled compiles past request deadlines); an entry read
while another process writes it is a miss (a warning, then a compile). `jd.compilation_count()`
counts cache loads, so the no-recompile tests stay strict. A run that sets the variable itself
keeps it.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import tempfile
import zlib
from pathlib import Path

import pytest

_CACHE_ROOT = os.environ.get("JAXDECODE_TEST_CACHE_ROOT")
_OWN_CACHE_ROOT = _CACHE_ROOT is None and "JAX_COMPILATION_CACHE_DIR" not in os.environ
if _OWN_CACHE_ROOT:  # the controller (or a run without xdist); the workers inherit the root
    _CACHE_ROOT = os.environ["JAXDECODE_TEST_CACHE_ROOT"] = tempfile.mkdtemp(
        prefix="jaxdecode-test-jax-cache-")
if _CACHE_ROOT is not None:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = os.path.join(
        _CACHE_ROOT, os.environ.get("PYTEST_XDIST_WORKER", "main"))
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")


def pytest_unconfigure(config):
    if _OWN_CACHE_ROOT:
        shutil.rmtree(_CACHE_ROOT, ignore_errors=True)


def _release():
    import jax

    jax.clear_caches()
    gc.collect()


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    yield
    _release()


_MAP_BUDGET = 32768  # half of vm.max_map_count's default (65530)


def _memory_maps():
    try:
        with open("/proc/self/maps", "rb") as f:
            return f.read().count(b"\n")
    except OSError:  # not Linux
        return 0


@pytest.fixture(autouse=True)
def _release_before_map_exhaustion():
    """Inside a module whose many parametrised cases compile hundreds of programs (batch
    invariance over every family), drop them after the test that takes the process past half
    of `vm.max_map_count`: past the limit XLA:CPU's compiler crashed the worker (SIGSEGV in
    backend_compile_and_load)."""
    yield
    if _memory_maps() > _MAP_BUDGET:
        _release()


# Tiny sizes: 2 layers, 4 heads (2 KV heads where the family has GQA), vocab 128.
VOCAB = 128
EOS_ID = 2
_LLAMA_GEOMETRY = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                       rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=EOS_ID, pad_token_id=0)

HF_CHECKPOINTS = {
    # name: (transformers config class, model class, config kwargs, extra save kwargs)
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(_LLAMA_GEOMETRY), {}),
    "llama3": ("LlamaConfig", "LlamaForCausalLM",
               dict(_LLAMA_GEOMETRY, rope_theta=500000.0,
                    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
               {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(_LLAMA_GEOMETRY, sliding_window=4), {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM",
              dict(_LLAMA_GEOMETRY, tie_word_embeddings=True, use_sliding_window=False), {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM",
              dict(_LLAMA_GEOMETRY, head_dim=16, use_sliding_window=False), {}),
    # Gemma: windows of 4 on alternating layers (Gemma 3: 2 sliding, then 1 global), both
    # soft-caps low enough to bite, query_pre_attn_scalar != head_dim.
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               dict(_LLAMA_GEOMETRY, num_hidden_layers=3, head_dim=16, sliding_window=4,
                    query_pre_attn_scalar=12, attn_logit_softcapping=2.0,
                    final_logit_softcapping=3.0), {}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(_LLAMA_GEOMETRY, num_hidden_layers=3, head_dim=16, sliding_window=4,
                    sliding_window_pattern=3, query_pre_attn_scalar=12,
                    rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0,
                                                        "rope_theta": 100000.0},
                                     "sliding_attention": {"rope_type": "default",
                                                           "rope_theta": 10.0}},
                    final_logit_softcapping=3.0), {}),
    # Phi-3: fused qkv / gate_up weights, longrope with short factors (prompts stay under
    # original_max_position_embeddings), a sliding window.
    "phi3": ("Phi3Config", "Phi3ForCausalLM",
             dict(_LLAMA_GEOMETRY, sliding_window=6, max_position_embeddings=128,
                  original_max_position_embeddings=64,
                  rope_scaling={"rope_type": "longrope", "short_factor": [1.0, 1.5, 2.0, 3.0],
                                "long_factor": [2.0, 3.0, 4.0, 5.0]}), {}),
    # Mixture of experts: hidden 64, 4 experts, top 2 (Mixtral renormalises the top 2;
    # Qwen3-MoE does not by default, has q/k norms and here one dense layer between sparse ones).
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(_LLAMA_GEOMETRY, hidden_size=64, num_local_experts=4, num_experts_per_tok=2),
                {}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(_LLAMA_GEOMETRY, hidden_size=64, num_hidden_layers=3, head_dim=16,
                       num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                       mlp_only_layers=[1], use_sliding_window=False), {}),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel",
             dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                  bos_token_id=1, eos_token_id=EOS_ID, pad_token_id=0), {}),
    # The plain llama weights again, written as several shards with an index.
    "llama_sharded": ("LlamaConfig", "LlamaForCausalLM", dict(_LLAMA_GEOMETRY),
                      {"max_shard_size": "20KB"}),
}

# The first families' seeds (their sorted order once); a new name's seed is its crc32, so adding
# a checkpoint changes no other checkpoint's weights.
_SEEDS = {"gpt2": 0, "llama": 1, "llama3": 2, "mistral": 4, "qwen2": 5, "qwen3": 6}

# generation_config.json eos ids (merged with config.json's by models.load)
GENERATION_EOS = {"llama": [3, EOS_ID]}

_SENTENCES = [
    "the quick brown fox jumps over the lazy dog",
    "a small model decodes tokens one step at a time",
    "jax compiles the decoder once and runs it many times",
    "hello world this is a tiny tokenizer for tests",
    "sliding windows and rotary positions make attention local",
]


def _randomize(model, seed: int, std: float = 0.15):
    """Replace every parameter with seeded noise (norm weights near 1, biases nonzero), so that
    attention is peaked and biases, norms and positions all matter for parity."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
            is_norm = ("norm" in name or ".ln_" in name) and name.endswith("weight")
            p.copy_(1.0 + 0.1 * noise if is_norm else std * noise)


@pytest.fixture(scope="session")
def demo():
    """The embedded demo model: `(model, params, tokenizer)`."""
    import models

    return models.demo()


@pytest.fixture(scope="session")
def hf_tokenizer_dir(tmp_path_factory) -> Path:
    """A small BPE tokenizer (trained here) saved as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["<pad>", "<s>", "</s>", "<unk>"],
                                  show_progress=False)
    tok.train_from_iterator(_SENTENCES, trainer)
    assert tok.get_vocab_size() <= VOCAB and tok.token_to_id("</s>") == EOS_ID
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>", unk_token="<unk>")
    out = tmp_path_factory.mktemp("hf_tokenizer")
    fast.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_hf_checkpoint(tmp_path_factory, hf_tokenizer_dir):
    """`tiny_hf_checkpoint(name) -> Path` of a saved tiny HF checkpoint (built on first use)."""
    import shutil

    built: dict[str, Path] = {}

    def build(name: str) -> Path:
        if name in built:
            return built[name]
        import torch
        import transformers

        config_cls, model_cls, kwargs, save_kwargs = HF_CHECKPOINTS[name]
        config = getattr(transformers, config_cls)(**kwargs)
        torch.manual_seed(0)
        model = getattr(transformers, model_cls)(config).to(torch.float32).eval()
        base = name.replace("_sharded", "")
        seed = _SEEDS.get(base, zlib.crc32(base.encode()) % 2**31)
        _randomize(model, seed)
        out = tmp_path_factory.mktemp(f"hf_{name}")
        model.save_pretrained(out, safe_serialization=True, **save_kwargs)
        if name in GENERATION_EOS:
            gen_file = out / "generation_config.json"
            gen = json.loads(gen_file.read_text())
            gen["eos_token_id"] = GENERATION_EOS[name]
            gen_file.write_text(json.dumps(gen))
        for f in hf_tokenizer_dir.iterdir():
            shutil.copy(f, out / f.name)
        built[name] = out
        return out

    return build
