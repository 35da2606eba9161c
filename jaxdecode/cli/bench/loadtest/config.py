"""The load test's settings (`LoadConfig`), its workload names and the ShareGPT-like length
mix (docs/serving.md "Load test").
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

# Short, varied Python snippets (each well under the 64-token prompt bucket `--warmup` compiles).
PROMPTS = (
    "def fibonacci(n):\n    ",
    "import os\n\ndef list_files(path):\n    ",
    "class Stack:\n    def __init__(self):\n        ",
    "def is_prime(n: int) -> bool:\n    ",
    "for i in range(10):\n    ",
    "with open('data.txt') as f:\n    ",
    "def merge_sort(items):\n    if len(items) <= 1:\n        ",
    "import json\n\ndef load_config(path):\n    ",
    "try:\n    value = int(text)\nexcept ValueError:\n    ",
    "def binary_search(arr, target):\n    lo, hi = 0, len(arr) - 1\n    ",
    "class Point:\n    def __init__(self, x, y):\n        ",
    "def read_lines(path):\n    with open(path) as f:\n        ",
    "import re\n\npattern = re.compile(",
    "def factorial(n):\n    if n == 0:\n        ",
    "numbers = [1, 2, 3, 4, 5]\nsquares = ",
    "def main():\n    args = parse_args()\n    ",
)

WORKLOADS = ("snippets", "random", "prefix-repetition", "sharegpt")

# The ShareGPT-like length mix: lognormal (median, sigma) of input and output tokens. With the
# clipping of `sharegpt_lengths` (input to [4, 1024], input + output to 2048) the means are
# about 218 input and 192 output tokens per request, near what `vllm bench serve` and SGLang
# print for ShareGPT with a Llama tokenizer (e.g. 229711 input and 203068 generated tokens for
# 1000 prompts, vllm-project/vllm#18566). The shapes are an assumption, not a fit to the data.
SHAREGPT_INPUT = (135.0, 1.05)
SHAREGPT_OUTPUT = (140.0, 0.8)
SHAREGPT_MIN_LEN = 4
SHAREGPT_MAX_TOTAL = 2048  # vLLM's ShareGPT filter: prompt + output <= 2048


@dataclasses.dataclass(frozen=True)
class LoadConfig:
    requests: int = 200
    concurrency: tuple[int, ...] = (8, 32, 64)
    max_tokens: int = 64                      # output tokens (snippets, random, prefix-rep.)
    temperature: Optional[float] = None       # None: 0.8 for snippets, 0 (greedy) otherwise
    ignore_eos: bool = True
    chat: bool = False
    seed: int = 0
    warmup_requests: int = 4
    timeout_s: float = 300.0
    api_key: Optional[str] = None
    model_name: Optional[str] = None          # the body's `model` field (vLLM needs it)
    workload: str = "snippets"
    input_len: int = 128                      # random
    token_min: int = 10                       # token ids of generated prompts: [min, max)
    token_max: int = 4000
    num_prefixes: int = 10                    # prefix-repetition
    prefix_len: int = 256
    suffix_len: int = 64
    max_input_len: int = 1024                 # sharegpt: input lengths clipped to [4, this]
    max_total_len: Optional[int] = None       # sharegpt: input + output at most this (None:
                                              # min(2048, the server's max_model_len))
    sharegpt_output_len: Optional[int] = None  # sharegpt: a fixed output length instead
    request_rate: float = math.inf            # requests/s; inf: all at once
    burstiness: float = 1.0                   # gamma shape of the gaps; 1: Poisson

    def __post_init__(self) -> None:
        if self.requests < 1:
            raise ValueError("requests: must be >= 1")
        if not self.concurrency or min(self.concurrency) < 1:
            raise ValueError("concurrency: every level must be >= 1")
        if self.max_tokens < 1:
            raise ValueError("max_tokens: must be >= 1")
        if self.warmup_requests < 0:
            raise ValueError("warmup_requests: must be >= 0")
        if self.seed < 0:
            raise ValueError("seed: must be >= 0 (request i uses seed + i)")
        if self.workload not in WORKLOADS:
            raise ValueError(f"workload: one of {', '.join(WORKLOADS)}")
        if self.chat and self.workload != "snippets":
            raise ValueError("chat: only with --workload snippets (the others send token ids)")
        for name in ("input_len", "num_prefixes", "prefix_len", "suffix_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1")
        if not 0 <= self.token_min < self.token_max:
            raise ValueError("token_min: must be >= 0 and below --token-max")
        if self.max_input_len < SHAREGPT_MIN_LEN:
            raise ValueError(f"max_input_len: must be >= {SHAREGPT_MIN_LEN}")
        if self.max_total_len is not None and self.max_total_len < 2 * SHAREGPT_MIN_LEN:
            raise ValueError(f"max_total_len: must be >= {2 * SHAREGPT_MIN_LEN}")
        if self.sharegpt_output_len is not None and self.sharegpt_output_len < 1:
            raise ValueError("sharegpt_output_len: must be >= 1")
        if not self.request_rate > 0:
            raise ValueError("request_rate: must be > 0 (inf: all at once)")
        if not (self.burstiness > 0 and math.isfinite(self.burstiness)):
            raise ValueError("burstiness: must be > 0")

    @property
    def sampling_temperature(self) -> float:
        if self.temperature is not None:
            return self.temperature
        return 0.8 if self.workload == "snippets" else 0.0


def auth_headers(cfg: LoadConfig) -> dict:
    return {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
