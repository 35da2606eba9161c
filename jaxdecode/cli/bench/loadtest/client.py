"""The client: request bodies, one streaming request read to its end, one concurrency level
under its arrivals, and the whole run (warm-up, levels, the server's counters).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any, Optional, Sequence

from jaxdecode.cli.bench.loadtest.config import (PROMPTS, SHAREGPT_MAX_TOTAL, LoadConfig,
                                                 auth_headers)
from jaxdecode.cli.bench.loadtest.results import RequestResult, SSEParser, apply_event
from jaxdecode.cli.bench.loadtest.server import (prefix_cache_delta, requests_running, rss_mb,
                                                 server_max_model_len, try_scrape)
from jaxdecode.cli.bench.loadtest.stats import summarize
from jaxdecode.cli.bench.loadtest.workload import WorkItem, arrival_offsets, make_workload

def request_body(i: int, cfg: LoadConfig, item: Optional[WorkItem] = None) -> dict:
    """Request i of a level: `item`'s prompt and output length (default: snippet i mod
    len(PROMPTS) and cfg.max_tokens), seed cfg.seed + i; only fields vLLM accepts too, and
    `model` only when cfg.model_name is set."""
    if item is None:
        item = WorkItem(PROMPTS[i % len(PROMPTS)], cfg.max_tokens)
    body: dict[str, Any] = {"max_tokens": item.max_tokens,
                            "temperature": cfg.sampling_temperature,
                            "seed": cfg.seed + i, "stream": True,
                            "stream_options": {"include_usage": True},
                            "ignore_eos": cfg.ignore_eos}
    if cfg.model_name:
        body["model"] = cfg.model_name
    if cfg.chat:
        body["messages"] = [{"role": "user", "content": item.prompt}]
    else:
        body["prompt"] = item.prompt
    return body


async def stream_one(client: Any, body: dict, chat: bool) -> RequestResult:
    """Send one streaming request and read it to the end (times from sending it)."""
    import httpx

    result = RequestResult()
    path = "/v1/chat/completions" if chat else "/v1/completions"
    parser = SSEParser()
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", path, json=body) as response:
            result.status = response.status_code
            if response.status_code != 200:
                await response.aread()
                return result
            async for line in response.aiter_lines():
                data = parser.feed(line)
                if data is not None:
                    apply_event(result, data, time.perf_counter() - t0)
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
        result.error = type(e).__name__
    return result


async def run_level(url: str, cfg: LoadConfig, items: Sequence[WorkItem], concurrency: int,
                    offsets: Optional[Sequence[float]] = None
                    ) -> tuple[list[RequestResult], float]:
    """Request i (`request_body(i, cfg, items[i])`) arrives `offsets[i]` seconds after the
    start (default: all at once) and waits until fewer than `concurrency` are in flight (its
    times start when it is sent, as in `vllm bench serve`); (results, wall seconds)."""
    import httpx

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    results: list[Optional[RequestResult]] = [None] * len(items)
    slots = asyncio.Semaphore(concurrency)  # waiters get a slot first come, first served

    async with httpx.AsyncClient(base_url=url, headers=auth_headers(cfg), limits=limits,
                                 timeout=httpx.Timeout(cfg.timeout_s)) as client:
        async def one(i: int) -> None:
            if offsets is not None:
                delay = t0 + offsets[i] - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
            async with slots:
                r = await stream_one(client, request_body(i, cfg, items[i]), cfg.chat)
            if r.prompt_tokens is None:  # a server without usage.prompt_tokens
                r.prompt_tokens = items[i].prompt_len
            results[i] = r

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(len(items))))
        wall = time.perf_counter() - t0
    return [r for r in results if r is not None], wall


def run(url: str, cfg: LoadConfig, server_pid: Optional[int] = None,
        progress=None) -> dict:
    """Warm up, then every concurrency level in turn; the report (see `format_table`)."""
    if cfg.workload == "sharegpt" and cfg.max_total_len is None:
        served = server_max_model_len(url, cfg)
        cfg = dataclasses.replace(cfg, max_total_len=min(SHAREGPT_MAX_TOTAL, served or
                                                         SHAREGPT_MAX_TOTAL))
    if cfg.warmup_requests:
        warm, _ = asyncio.run(run_level(url, cfg, make_workload(cfg, cfg.warmup_requests, -1),
                                        min(cfg.warmup_requests, max(cfg.concurrency))))
        failed = [r.failure() for r in warm if not r.ok]
        if failed:
            raise RuntimeError(f"{len(failed)} warm-up requests failed (first: {failed[0]}); "
                               "is it an OpenAI-compatible server, is --api-key right, and "
                               "does it need --served-model-name?")
    before = try_scrape(url, cfg.api_key)
    report: dict[str, Any] = {
        "url": url, "config": {**dataclasses.asdict(cfg), "api_key": cfg.api_key is not None,
                               "temperature": cfg.sampling_temperature},
        "metrics_available": bool(before),
        "rss_mb_before": rss_mb(server_pid) if server_pid else None, "levels": []}
    for level, c in enumerate(cfg.concurrency):
        items = make_workload(cfg, cfg.requests, level)
        offsets = arrival_offsets(cfg.requests, cfg.request_rate, cfg.burstiness, cfg.seed,
                                  level)
        m0 = try_scrape(url, cfg.api_key) if before else {}
        results, wall = asyncio.run(run_level(url, cfg, items, c, offsets))
        row = summarize(results, c, wall, cfg.request_rate)
        row["prefix_cache"] = prefix_cache_delta(m0, try_scrape(url, cfg.api_key)) \
            if before else None
        row["rss_mb_after"] = rss_mb(server_pid) if server_pid else None
        report["levels"].append(row)
        if progress is not None:
            progress(row)
    # the engine frees a slot just after the request's last event: allow it a moment
    deadline = time.monotonic() + 2.0
    after = try_scrape(url, cfg.api_key)
    while requests_running(after) and time.monotonic() < deadline:
        time.sleep(0.05)
        after = try_scrape(url, cfg.api_key)
    report["requests_running_at_end"] = requests_running(after)
    compiles = "jaxdecode_compilations_total"
    report["compilations_during_run"] = (after[compiles] - before[compiles]
                                         if compiles in after and compiles in before else None)
    report["prefix_cache"] = prefix_cache_delta(before, after)
    return report
