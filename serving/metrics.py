"""Prometheus metrics of one server (a per-app `CollectorRegistry`, so tests can build several).

    jaxdecode_requests_total{finish_reason}      counter: engine requests (one per choice) by
                                                 how they ended: a contract §9 finish reason
                                                 (eos, stop_sequence, max_output_tokens, ...,
                                                 cancelled, transport_error for a client that
                                                 went away) or, for a failed request, its
                                                 error code (model_error, decoding_error, ...)
    jaxdecode_requests_rejected_total{reason}    counter: HTTP requests refused before the
                                                 engine (invalid_request, queue_full, ...)
    jaxdecode_requests_running                   gauge: LLM.num_running (requests in slots)
    jaxdecode_requests_waiting                   gauge: LLM.num_waiting (admission queue)
    jaxdecode_prompt_tokens_total                counter: prompt tokens of every engine request
    jaxdecode_generation_tokens_total            counter: selected output tokens (contract §9)
    jaxdecode_time_to_first_token_seconds        histogram: queued -> first token selected
    jaxdecode_inter_token_latency_seconds        histogram: between consecutive selections
    jaxdecode_queue_time_seconds                 histogram: queued -> prefill started
    jaxdecode_compilations_total                 counter: jd.compilation_count() (process-wide)
    jaxdecode_spec_proposed_tokens_total         counter: draft tokens proposed (speculative
                                                 engine only, LLM.speculative_stats())
    jaxdecode_spec_accepted_tokens_total         counter: proposed tokens the target accepted
    jaxdecode_spec_rounds_total                  counter: verify rounds of a request's row
    jaxdecode_prefix_cache_queries_total         counter: prompt tokens looked up in the prefix
                                                 cache (LLM.kv_stats())
    jaxdecode_prefix_cache_hits_total            counter: prompt tokens served from it
    jaxdecode_kv_pages_used                      gauge: KV pages held by requests
    jaxdecode_kv_pages_total                     gauge: KV pages of the budget
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from jaxdecode.device.decode import compilation_count
from jaxdecode.types import RequestState

_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
            1.0, 2.5, 5.0, 10.0)
_WAIT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
         10.0, 20.0, 40.0, 80.0)


class _EngineCollector:
    """Values read from the engine at scrape time."""

    def __init__(self, llm: Any, speculative: bool):
        self.llm, self.speculative = llm, speculative

    def collect(self):
        yield GaugeMetricFamily("jaxdecode_requests_running",
                                "Requests in engine slots (LLM.num_running).",
                                value=self.llm.num_running)
        yield GaugeMetricFamily("jaxdecode_requests_waiting",
                                "Requests in the admission queue (LLM.num_waiting).",
                                value=self.llm.num_waiting)
        yield CounterMetricFamily("jaxdecode_compilations",
                                  "XLA compilations of jaxdecode's jitted functions.",
                                  value=compilation_count())
        kv = self.llm.kv_stats()
        yield CounterMetricFamily("jaxdecode_prefix_cache_queries",
                                  "Prompt tokens looked up in the prefix cache.",
                                  value=kv["prefix_cache_queries"])
        yield CounterMetricFamily("jaxdecode_prefix_cache_hits",
                                  "Prompt tokens served from the prefix cache.",
                                  value=kv["prefix_cache_hits"])
        yield GaugeMetricFamily("jaxdecode_kv_pages_used", "KV pages held by requests.",
                                value=kv["pages_used"])
        yield GaugeMetricFamily("jaxdecode_kv_pages_total", "KV pages of the budget.",
                                value=kv["pages_total"])
        if self.speculative:
            stats = self.llm.speculative_stats()
            for name, key, doc in (("proposed_tokens", "proposed", "Draft tokens proposed."),
                                   ("accepted_tokens", "accepted",
                                    "Proposed tokens the target accepted."),
                                   ("rounds", "iterations", "Speculative verify rounds.")):
                yield CounterMetricFamily(f"jaxdecode_spec_{name}", doc, value=stats[key])


class Metrics:
    def __init__(self, llm: Any, speculative: bool = False):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("jaxdecode_requests_total",
                                "Engine requests by how they ended.", ["finish_reason"],
                                registry=r)
        self.rejected = Counter("jaxdecode_requests_rejected_total",
                                "HTTP requests refused before reaching the engine.", ["reason"],
                                registry=r)
        self.prompt_tokens = Counter("jaxdecode_prompt_tokens_total", "Prompt tokens.",
                                     registry=r)
        self.generation_tokens = Counter("jaxdecode_generation_tokens_total",
                                         "Selected output tokens.", registry=r)
        self.ttft = Histogram("jaxdecode_time_to_first_token_seconds",
                              "Queued to first token selected.", buckets=_WAIT, registry=r)
        self.itl = Histogram("jaxdecode_inter_token_latency_seconds",
                             "Time between consecutive token selections.", buckets=_LATENCY,
                             registry=r)
        self.queue_time = Histogram("jaxdecode_queue_time_seconds",
                                    "Queued to prefill started.", buckets=_WAIT, registry=r)
        r.register(_EngineCollector(llm, speculative))

    def observe(self, handle: Any, label: str) -> dict:
        """Record one ended engine request; returns its timings for the log line."""
        self.requests.labels(finish_reason=label).inc()
        usage = handle.usage()
        self.prompt_tokens.inc(len(handle.prompt_ids))
        self.generation_tokens.inc(usage.selected_tokens)
        times = handle.state_times
        queued = times.get(RequestState.QUEUED)
        out: dict = {}
        if queued is not None and RequestState.PREFILLING in times:
            out["queue_s"] = times[RequestState.PREFILLING] - queued
            self.queue_time.observe(out["queue_s"])
        selected = [e.time for e in handle.trace() if e.kind == "token.selected"]
        if selected and queued is not None:
            out["ttft_s"] = selected[0] - queued
            self.ttft.observe(max(0.0, out["ttft_s"]))
        for a, b in zip(selected, selected[1:]):
            self.itl.observe(max(0.0, b - a))
        if len(selected) > 1:
            out["mean_itl_s"] = (selected[-1] - selected[0]) / (len(selected) - 1)
        return out
