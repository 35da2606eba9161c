"""A hand-computable DecoderModel: after the token at absolute position p it predicts script[p].

Its logits are `peak` on the scripted id and 0 elsewhere, so greedy decoding replays the script
and a test can compute every step by hand. It keeps a real KVCache (one layer, tiny heads) so
cache lengths follow the protocol exactly.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxdecode.model_api import KVCache, ModelConfig


@dataclasses.dataclass(frozen=True)
class ScriptedModel:
    config: ModelConfig
    script: tuple  # script[p] = the id predicted after position p
    peak: float = 10.0

    @classmethod
    def make(cls, script, vocab_size=16, max_len=64, eos_token_ids=(), peak=10.0):
        cfg = ModelConfig(vocab_size=vocab_size, num_layers=1, num_heads=1, num_kv_heads=1,
                          head_dim=2, max_len=max_len, eos_token_ids=tuple(eos_token_ids))
        return cls(cfg, tuple(script), peak)

    def init_cache(self, batch, max_len, dtype=jnp.float32):
        return KVCache.zeros(1, batch, max_len, 1, 2, dtype)

    def forward(self, params, tokens, positions, cache, *, lengths):
        script = jnp.asarray(self.script, jnp.int32)
        nxt = script[jnp.clip(positions, 0, len(self.script) - 1)]
        logits = jax.nn.one_hot(nxt, self.config.vocab_size, dtype=jnp.float32) * self.peak
        real = jnp.arange(tokens.shape[1])[None, :] < lengths[:, None]
        last = jnp.max(jnp.where(real, positions + 1, 0), axis=1)
        new_len = jnp.where(lengths > 0, last, cache.lengths).astype(jnp.int32)
        return logits, cache.replace(lengths=new_len)


@dataclasses.dataclass(frozen=True)
class Bigram:
    """logits after token x = table[x]: a Markov chain (exact distributions by hand), with a
    real KVCache's lengths."""

    config: ModelConfig
    table: tuple

    @classmethod
    def random(cls, seed, vocab=8, scale=1.5, repeat=2.0):
        import numpy as np

        # `repeat` favours x -> x, so that penalties on y1 change y2's distribution a lot
        table = np.random.default_rng(seed).normal(size=(vocab, vocab)) * scale
        table += repeat * np.eye(vocab)
        cfg = ModelConfig(vocab_size=vocab, num_layers=1, num_heads=1, num_kv_heads=1,
                          head_dim=1, max_len=64, eos_token_ids=())
        return cls(cfg, tuple(map(tuple, table.tolist())))

    def init_cache(self, batch, max_len, dtype=jnp.float32):
        return KVCache.zeros(1, batch, max_len, 1, 1, dtype)

    def forward(self, params, tokens, positions, cache, *, lengths):
        logits = jnp.asarray(self.table, jnp.float32)[tokens]
        real = jnp.arange(tokens.shape[1])[None, :] < lengths[:, None]
        last = jnp.max(jnp.where(real, positions + 1, 0), axis=1)
        return logits, cache.replace(lengths=jnp.where(lengths > 0, last, cache.lengths))


HOOKS: dict = {}


@dataclasses.dataclass(frozen=True)
class HookedModel(ScriptedModel):
    """A ScriptedModel that calls `HOOKS[hook](positions, lengths)` (numpy) inside every forward,
    at run time on the host: tests use it to block a step in flight or to slow steps down."""

    hook: str = ""

    @classmethod
    def make(cls, script, hook, vocab_size=16, max_len=64, eos_token_ids=(), peak=10.0):
        base = ScriptedModel.make(script, vocab_size, max_len, eos_token_ids, peak)
        return cls(base.config, base.script, base.peak, hook)

    def forward(self, params, tokens, positions, cache, *, lengths):
        from jax.experimental import io_callback
        import numpy as np

        logits, cache = super().forward(params, tokens, positions, cache, lengths=lengths)
        hook = self.hook

        def call(pos, lens):
            HOOKS[hook](np.asarray(pos), np.asarray(lens))
            return np.float32(0.0)

        zero = io_callback(call, jax.ShapeDtypeStruct((), jnp.float32), positions, lengths)
        return logits + zero, cache


@dataclasses.dataclass(frozen=True)
class MarkedModel(Bigram):
    """A Bigram whose forward raises -- at run time, inside the jitted call, like a device fault
    -- when a real input token is `mark`: the test model of a request whose data makes the step
    fail. `chain` ids lead to the mark: each row's peak is the next id of the chain, the last
    one's is `mark`; no other row ever selects a chain id or the mark (logits -30), so only a
    request whose prompt ends in chain[0] reaches it, len(chain) steps in."""

    mark: int = -1

    @classmethod
    def make(cls, seed, vocab=24, chain=(16, 17, 18, 19, 20), mark=23, max_len=64):
        import numpy as np

        table = np.random.default_rng(seed).normal(size=(vocab, vocab)) * 1.5
        table[:, list(chain) + [mark]] = -30.0
        for a, b in zip(chain, list(chain[1:]) + [mark]):
            table[a, b] = 30.0
        cfg = ModelConfig(vocab_size=vocab, num_layers=1, num_heads=1, num_kv_heads=1,
                          head_dim=1, max_len=max_len, eos_token_ids=())
        return cls(cfg, tuple(map(tuple, table.tolist())), mark)

    def forward(self, params, tokens, positions, cache, *, lengths):
        from jax.experimental import io_callback
        import numpy as np

        logits, cache = super().forward(params, tokens, positions, cache, lengths=lengths)
        real = jnp.arange(tokens.shape[1])[None, :] < lengths[:, None]
        mark = self.mark

        def check(toks, real):
            if (np.asarray(toks)[np.asarray(real)] == mark).any():
                raise RuntimeError(f"marked token {mark} in the input")
            return np.float32(0.0)

        zero = io_callback(check, jax.ShapeDtypeStruct((), jnp.float32), tokens, real)
        return logits + zero, cache
