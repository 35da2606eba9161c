"""A prompt's `n`, expanded in one place: `LLM.generate`, `LLM.submit_n` and the HTTP server
(serving/app.py) all build their n requests here, so one seed rule and one page-sharing rule
hold everywhere (docs/batch_invariance.md "Choices of n", rule X1).

Sample 0 of n is the request alone (its key is `key(seed)`); sample j >= 1 samples with
`fold_in(key(seed), j)` (`decode.sample_keys`, as `jd.generate` does). Without a seed, one
random seed is drawn for the n samples. Sampled requests j >= 1 share sample 0's prompt pages
(`admission.link_samples`: the prompt is prefilled once); with num_beams > 1 the n requests are
the n best beams of one search row (`beam_lane.link_rows`).
"""

from __future__ import annotations

from typing import Callable, Optional

from jaxdecode.config import SamplingParams
from jaxdecode.engine import admission, beam_lane
from jaxdecode.engine.request import Request


def expand(adm: admission.Admission, prompt: admission.Prompt, sp: SamplingParams, *,
           request_id: Optional[str] = None, prompt_index: int = 0,
           output_kind: Optional[str] = None,
           cancelled: Optional[Callable[[], bool]] = None) -> list[Request]:
    """The n requests of one prompt (module docstring), every one checked before any is
    returned; ids `<request_id>-<j>` when n > 1 (one id for n = 1)."""
    seed = adm.seed_of(sp)
    kind = output_kind or sp.output_kind
    ids = [None] * sp.n if request_id is None else (
        [request_id] if sp.n == 1 else [f"{request_id}-{j}" for j in range(sp.n)])
    reqs = [adm.request(prompt, sp, ids[j], prompt_index=prompt_index, index=j,
                        output_kind=kind, cancelled=cancelled, seed=seed)
            for j in range(sp.n)]
    beam_lane.link_rows(reqs)
    admission.link_samples(reqs)
    return reqs
