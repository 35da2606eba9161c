"""Structured output: regex / JSON-schema / choice constraints as token-level automata that
live on the device (docs/architecture.md `constraints/`; contract §3 step 2, P2, §5 grammar acceptance).

Pipeline

    SamplingParams(response_format=...)   shape checked on construction (formats.py)
      -> regex_for(...)                   JSON schema -> regex via outlines-core (formats.py)
      -> compile_regex(regex, vocab)      outlines-core Index over the tokenizer's token bytes,
                                          renumbered into CSR numpy tables; LRU-cached by
                                          (regex, vocab hash) with compile time (compile.py);
                                          size pre-checks (limits.py); with a CompileBudget
                                          built in a worker process under a deadline, memory
                                          and state cap (worker.py, index_worker.py)
      -> build_tables([...], V)           one device table set per batch: bit-packed masks,
                                          accepting/has_next flags, dense or CSR next-state
                                          lookup, states concatenated with offsets and sizes
                                          bucketed to powers of two (tables.py)
      -> StepState.grammar / .grammar_state   tables + int32[B] per-row state (-1 = free)

Inside the jitted decode step (decode.py): the grammar mask is contract §3 step 2
(`tables.mask_logits`); after selection `tables.next_state` advances each constrained row;
finish codes: every token masked on a constrained row -> GRAMMAR_DEAD_END (FAILED,
ErrorCode.GRAMMAR_DEAD_END, contract P2: never NaN, never an unconstrained token); a token that
reaches an accepting state with no continuation -> GRAMMAR_COMPLETE (FinishReason
.GRAMMAR_COMPLETE; like EOS the final token is selected but not written, contract O1); EOS is
allowed exactly in accepting states and ends the row with `eos`. A row with ignore_eos never gets
EOS from its grammar (it ends by completion, max_tokens or a dead end). min_tokens masks EOS as
usual; completion is not delayed by min_tokens.

Using the state elsewhere (engine, beam search, speculative decoding): the grammar state is one
int32 per row and must move with the KV cache.
  * Engine: compile at submission (`compile_format` within the engine's CompileBudget, in the
    submitting thread; a ValueError is a 400 with param `response_format`). Keep one `build_tables` bundle for the live slots; pass the
    constraints in a stable order and append new ones, so existing offsets never move (else
    the engine moves live rows on device, `step_ops` GRAMMAR). A new row starts at `bundle.initial_state(compiled)`; a free slot is -1.
    Replacing `StepState.grammar` with a bundle of the same bucketed shapes does not recompile.
  * Beam search: the tables are shared (vmap in_axes=None); `grammar_state` is per beam and is
    gathered with the same parent indices that reorder the cache.
  * Speculative decoding: the draft proposes under the mask with its own copy of the state;
    the verifier masks position i with the state after draft tokens 1..i
    (`state_path` over the draft), and on rejection at i the row's state is rolled back
    to the state after the accepted prefix and then advanced by the resampled token -- exactly
    as `cache.lengths` is rolled back. Rollback is setting the int32, never copying tables.
"""

from jaxdecode.device.constraints import limits
from jaxdecode.device.constraints.compile import (CACHE, CompiledIndex, IndexCache, cache_info,
                                           compile_format, compile_regex)
from jaxdecode.device.constraints.worker import CompileBudget, worker_info
from jaxdecode.response_format import regex_for, validate_response_format
from jaxdecode.device.constraints.tables import (DEAD, GrammarTables, TableBundle, build_tables,
                                          completes, mask_logits, next_state,
                                          state_path)
from jaxdecode.device.constraints.vocab import TokenVocab, vocab_for
from jaxdecode.device.constraints.batch import prepare_rows

__all__ = [
    "CACHE", "CompileBudget", "CompiledIndex", "DEAD", "GrammarTables", "IndexCache", "TableBundle", "TokenVocab",
    "build_tables", "cache_info", "compile_format", "compile_regex", "completes", "mask_logits",
    "next_state", "prepare_rows", "regex_for", "state_path", "validate_response_format",
    "vocab_for", "worker_info",
]
