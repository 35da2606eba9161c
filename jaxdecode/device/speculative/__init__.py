"""Speculative decoding on device (contract §10): a draft proposes k tokens, the target verifies them
in one forward pass of k + 1 positions.

One loop body, two drivers: `spec_round` (round.py) is one verify round over a `SpecState`
(state.py; a pure function); `speculative_generate` (generate.py) runs it inside one
`lax.while_loop` (the whole generation is one dispatch), and the engine
(`jd.LLM(..., speculative=...)`, the speculative backend of jaxdecode/engine/backend.py) runs
one jitted round per engine step over its slots. Proposals are propose.py's, verification and
the acceptance test verify.py's.

Draft kinds
-----------
- a draft model (any `DecoderModel` with the target's vocabulary): k proposals from a
  `lax.scan` of its own single-token steps, sampled from its processed distribution q;
- `draft="prompt_lookup"` (no draft model): the continuation of the most recent earlier match of
  the last n-gram (n from `ngram_max` down to `ngram_min`) in prompt + output, extended
  periodically when the match is close to the end; the last token repeated when nothing matches.
  It is a deterministic proposal, q = one-hot.

Verification (Leviathan et al. / Chen et al.)
---------------------------------------------
p_i and q_i are the PROCESSED distributions of contract §3 (`processors.process`: penalties, bias,
bans, min_tokens, temperature, top-k/p, min-p), each evaluated with the penalty counts and the
step index of its own position -- the counts are advanced token by token through the proposed
run, so penalties are exact, not only in penalty-free settings. Draft token d_i is accepted with
probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection the token is drawn from
normalize(max(0, p_i - q_i)) (from p_i where that vanishes numerically); when all k are accepted
a bonus token is drawn from p_{k+1}. Greedy rows (temperature 0) accept a draft token exactly
when it is the target's argmax, and take the argmax at the first mismatch: their output equals
plain greedy decoding token for token. A sampled row's output follows the target's distribution
exactly, but is not the same sample as `jd.generate` with the same seed (different streams).

Keys (contract X1)
--------------
The token at output index t (1-based) of a row uses `kt = fold_in(request_key, t)` and then
`fold_in(kt, 0)` to sample the draft proposal, `fold_in(kt, 1)` for the acceptance uniform and
`fold_in(kt, 2)` to sample from the residual or bonus distribution (draws by inverse CDF,
one uniform each, as `sampling.py`; skipped when every row is greedy). Each output index is
decided in exactly one iteration; proposals for later indices that a rejection discards never
influence an emitted token, so reusing their keys afterwards keeps the streams independent.
The stream depends only on the seed and the output index, never on the batch slot.

State, rollback and stops
-------------------------
Invariant at the start of an iteration, for s = prompt + output so far (length L): the target
cache holds s[:-1] (lengths = L - 1) and s[-1] is the pending token -- the verify forward is
[s[-1], d_1 .. d_k] at positions L-1 .. L-1+k. The draft cache holds s[:-1], or s[:-2] after an
iteration that accepted all k tokens (its d_k was never written; the next draft call writes two
tokens). Rollback is setting both caches' `lengths` (never copying). The penalty counts, the
step index (the RNG cursor) and the history advance only by the emitted tokens.
Structured output (jaxdecode/device/constraints): the draft proposes under the grammar mask with its
own copy of the row's state; the verifier masks position i with the state after d_1 .. d_{i-1}
(`constraints.state_path`); after the pass the row's state is the one after its last emitted
token -- rolled back exactly like `cache.lengths` (an int32 per row, tables never copied).
Within an accepted run every emitted token passes the device stop checks of `stops.py` in the
same priority (model error, grammar dead end / all masked, EOS, stop id, grammar completion,
max_tokens, context limit): the first token that ends the row ends the run, and no token past
it is ever emitted.

Branches (`num_branches`, greedy rows only)
-------------------------------------------
`num_branches = N > 1` proposes N continuations per row and verifies them together. Proposals:
prompt lookup -- branch b continues the b-th most recent earlier match whose proposal differs
from branches 0..b-1 (longest n-gram first, then the shorter ones, then the last token
repeated: `_lookup`); a draft model -- branch b starts with the draft's b-th most likely first
token under its processed (masked) q and continues greedily, the draft's scan `vmap`ped over
the branch axis. Branch 0 is the single-branch proposal. Verification: `target.forward` is
`vmap`ped over the branch axis with the cache shared (in_axes None), so each branch writes its
own k + 1 positions into its own copy of the cache, and the grammar path and counts are per
branch. Greedy rule: branch b accepts j_b = the number of leading d_i equal to the target's
argmax; the row takes the branch with the largest j_b (ties: the lowest b, so N = 1 is today's
round) and emits its j_b tokens plus the argmax at j_b + 1 -- tokens that plain greedy decoding
emits, so the output still equals it token for token. Stops, max_tokens, counts and grammar
state then follow the chosen branch exactly as above. Cost: the chosen branch's caches (target
and draft) are taken by a gather after the choice, one copy of each cache per round -- the
price of beam search's reorder by gather; a research option, not a free speed-up.
Sampled rows (temperature > 0) with N > 1 raise ValueError naming num_branches: the
min(1, p/q) test is exact for ONE proposal per position; with several, accepting the best of N
independently-tested branches over-represents drafted tokens. Exactness there needs a
multi-draft rule (SpecInfer's / recursive rejection sampling: test the branches in turn against
successively updated residuals), not implemented.

Custom processors (`processors=`, jaxdecode/device/research.py)
--------------------------------------------------------
They are part of p: the verifier runs them position by position through the proposed run
(a `lax.scan`), position i seeing prompt + output + d_1 .. d_i and step + i, each row's
processor states threaded from one position to the next. After the pass a row keeps the
states after its last emitted token; those of rejected draft positions are dropped -- rolled
back like `cache.lengths`. The draft proposes without them (q stays the draft's own processed
distribution): acceptance min(1, p/q) and the residual keep the output distributed exactly
as p, whatever q is.
"""

from jaxdecode.device.speculative.generate import (check_branches_greedy, check_draft,
                                                   check_num_branches, speculative_generate)
from jaxdecode.device.speculative.round import spec_round
from jaxdecode.device.speculative.state import (COUNTERS, PROMPT_LOOKUP, RoundConfig,
                                                RoundOutput, SpecState, SpeculativeOutput)

__all__ = ["COUNTERS", "PROMPT_LOOKUP", "RoundConfig", "RoundOutput", "SpecState",
           "SpeculativeOutput", "check_branches_greedy", "check_draft", "check_num_branches",
           "spec_round", "speculative_generate"]
