"""An HTTP load test of OpenAI-compatible servers with the metrics of `vllm bench serve`.

Streaming requests at several concurrency levels (issue #6):

    python -m jaxdecode.cli.bench.loadtest [--model demo] [--max-slots 8] [--max-len 512]
                                           [--workload snippets|random|prefix-repetition|sharegpt]
                                           [--requests 200] [--concurrency 8 --concurrency 32 ...]
                                           [--request-rate inf] [--max-tokens 64]
                                           [--url URL [--server-pid PID] [--served-model-name NAME]]
                                           [--server-arg=--no-prefix-cache ...] [--json FILE]
    jaxdecode bench --serve ...            (the same flags)

Without `--url` it starts the server (`python -m serving --warmup N`, N the longest prompt of a
token-id workload, the flags of `jaxdecode serve`, plus every `--server-arg`) as a subprocess on
a free loopback port, waits for /health, sends a few warm-up requests that are not counted, and
stops the server at the end. With `--url` it tests any OpenAI-compatible server (vLLM
included): it sends only fields vLLM accepts too, puts `--served-model-name` in the body's
`model` field when given, and reads /metrics only when the server has one.

Workloads (every one deterministic given `--seed`; docs/serving.md "Load test"):

- `snippets` (default): one of 16 short Python snippets as a text prompt, `--max-tokens` out;
- `random`: `--input-len` token ids drawn uniformly from [`--token-min`, `--token-max`),
  `--output-len` (= `--max-tokens`) out;
- `prefix-repetition`: `--num-prefixes` shared prefixes of `--prefix-len` random tokens, each
  request one of them plus its own `--suffix-len` random tokens (vLLM's prefix_repetition);
- `sharegpt`: ShareGPT-like input and output lengths from two lognormals generated locally
  (`SHAREGPT_INPUT` and `SHAREGPT_OUTPUT`), prompts of random token ids.

Arrivals: `--request-rate R` requests/s, gaps drawn from a gamma distribution of shape
`--burstiness` (1: a Poisson process; `inf`, the default, sends every request at once), and
at most C in flight for each level C of `--concurrency` / `--max-concurrency`.

Metrics per level (client side, like `vllm bench serve`): completed and failed requests,
duration, request, output-token and total-token (input + output) throughput, and mean /
median / p99 (std in the JSON) of

- TTFT: request sent -> first chunk with non-empty text;
- TPOT: (E2EL - TTFT) / (output tokens - 1) per request with more than one output token;
- ITL: the gaps between successive chunks with text. A chunk is one server delta: usually one
  token but it may carry several, so these are per chunk; `tokens_per_chunk` reports the ratio;
- E2EL: request sent -> `[DONE]`.

Token counts are the usage chunk's (`stream_options.include_usage`): `completion_tokens`,
`prompt_tokens` and `prompt_tokens_details.cached_tokens` (summed, when the server reports it).
Errors: HTTP status != 200, an error event, no usage chunk, no `[DONE]`, or an exception.

Server memory is the server process's resident set (VmRSS of /proc/<pid>/status; with `--url`
only when `--server-pid` is given) after warm-up and after each level. When /metrics answers,
it gives the compilations during the run, the requests running at the end (which must be 0) and
the prefix-cache hits per level (jaxdecode's or vLLM's counters).
Module imports are the standard library only, so the CLI can add these flags cheaply; numpy and
httpx (the dev extra) are imported when a test runs.
"""

from jaxdecode.cli.bench.loadtest.client import request_body, run, run_level, stream_one
from jaxdecode.cli.bench.loadtest.command import (add_arguments, build_parser, config_from_args,
                                                  main)
from jaxdecode.cli.bench.loadtest.config import (PROMPTS, SHAREGPT_INPUT, SHAREGPT_MAX_TOTAL,
                                                 SHAREGPT_MIN_LEN, SHAREGPT_OUTPUT, WORKLOADS,
                                                 LoadConfig)
from jaxdecode.cli.bench.loadtest.report import format_table, markdown_table
from jaxdecode.cli.bench.loadtest.results import (RequestResult, SSEParser, apply_event,
                                                  chunk_text, sse_events)
from jaxdecode.cli.bench.loadtest.server import (ServerProcess, free_port, parse_metrics,
                                                 prefix_cache_delta, requests_running, rss_mb,
                                                 scrape_metrics, server_max_model_len,
                                                 try_scrape, warmup_tokens)
from jaxdecode.cli.bench.loadtest.stats import percentiles, stats_ms, summarize
from jaxdecode.cli.bench.loadtest.workload import (WorkItem, arrival_offsets, make_workload,
                                                   sharegpt_lengths)

__all__ = ["PROMPTS", "SHAREGPT_INPUT", "SHAREGPT_MAX_TOTAL", "SHAREGPT_MIN_LEN",
           "SHAREGPT_OUTPUT", "WORKLOADS", "LoadConfig", "RequestResult", "SSEParser",
           "ServerProcess", "WorkItem", "add_arguments", "apply_event", "arrival_offsets",
           "build_parser", "chunk_text", "config_from_args", "format_table", "free_port",
           "main", "make_workload", "markdown_table", "parse_metrics", "percentiles",
           "prefix_cache_delta", "request_body", "requests_running", "rss_mb", "run",
           "run_level", "scrape_metrics", "server_max_model_len", "sharegpt_lengths",
           "sse_events", "stats_ms", "stream_one", "summarize", "try_scrape", "warmup_tokens"]
