"""Prometheus metrics of the server (prometheus-client), in one registry per server instance.

Gauges and the running totals (counters, `_Totals`) are refreshed from the engine's stats snapshot
at scrape time; latency histograms are
observed by the request handlers, measured where the client sees them: first token out and
gaps between streamed outputs for streamed requests (a non-streamed client sees nothing before
the end), whole request for all. With KV tiers on (docs/kv_tiers.md), their counters are exported
too: blocks hit per tier, bytes moved per direction, seconds the step waited on transfers.
"""
from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


# running totals mirrored from the engine's stats at scrape time, exposed as counters (`_total`,
# as vLLM's prompt_tokens_total / generation_tokens_total / num_preemptions_total): name (without
# _total), help, the label beside model_name (or None), and (label value, stats key) pairs
_TOTALS = [
    ("cuttle_num_preemptions", "Preemptions since start", None, [(None, "preemptions")]),
    ("cuttle_prompt_tokens", "Prompt tokens admitted since start", None, [(None, "prompt_tokens")]),
    ("cuttle_generation_tokens", "Tokens generated since start", None, [(None, "generated_tokens")]),
    ("cuttle_graph_steps", "Decode steps replayed from kernel graphs (CPU) since start", None, [(None, "graph_steps")]),
    ("cuttle_kv_window_released_blocks", "KV blocks given back behind a sliding window since start", None,
     [(None, "kv_window_released_blocks")]),
    # vLLM's spec_decode_num_draft_tokens / _num_accepted_tokens (0 without speculative_config)
    ("cuttle_spec_decode_num_draft_tokens", "Draft tokens proposed by speculative decoding since start", None,
     [(None, "spec_draft_tokens")]),
    ("cuttle_spec_decode_num_accepted_tokens", "Draft tokens kept by speculative decoding since start", None,
     [(None, "spec_accepted_tokens")]),
    ("cuttle_squid_documents", "Squid documents served from the cache (hit) or computed", "outcome",
     [("hit", "documents_hit"), ("computed", "documents_computed")]),
    ("cuttle_squid_document_tokens", "Squid document tokens reused from the cache or computed", "outcome",
     [("reused", "document_tokens_reused"), ("computed", "document_tokens_computed")]),
]
_TIER_TOTALS = [  # only with a KV host tier
    ("cuttle_kv_tier_hit_blocks", "KV blocks found in a lower tier and copied back", "tier",
     [("host", "kv_host_hit_blocks"), ("disk", "kv_disk_hit_blocks")]),
    ("cuttle_kv_tier_bytes", "KV bytes moved between tiers", "direction",
     [(d, f"kv_bytes_{d}") for d in ("device_to_host", "host_to_device", "host_to_disk", "disk_to_host")]),
    ("cuttle_kv_transfer_blocked_seconds", "Seconds the engine step waited on KV transfers", None, [(None, "kv_transfer_blocked_s")]),
    ("cuttle_kv_swap_outs", "Preempted sequences whose partial block went to the host tier", None, [(None, "kv_swap_outs")]),
    ("cuttle_kv_tier_documents", "Squid documents offloaded whole, or loaded back per tier", "event",
     [("offloaded", "kv_offloaded_documents"), ("host_hit", "kv_host_document_hits"), ("disk_hit", "kv_disk_document_hits")]),
]


class _Totals:
    """A collector yielding the engine's running totals as counters from the last stats rendered
    (they were gauges: rate() and friends treat a gauge's restart differently)."""

    def __init__(self, model: str):
        self.model = model
        self.stats: dict[str, Any] = {}

    def collect(self):
        tables = _TOTALS + (_TIER_TOTALS if "kv_host_blocks_total" in self.stats else [])
        for name, help_, label, entries in tables:
            fam = CounterMetricFamily(name, help_, labels=["model_name"] + ([label] if label else []))
            for value, key in entries:
                fam.add_metric([self.model] + ([value] if label else []), float(self.stats[key]))
            yield fam


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        r, labels = self.registry, ["model_name"]
        self.model = model_name
        self.running = Gauge("cuttle_num_requests_running", "Requests being computed", labels, registry=r)
        self.waiting = Gauge("cuttle_num_requests_waiting", "Requests waiting for KV blocks or budget", labels, registry=r)
        self.kv_usage = Gauge("cuttle_kv_cache_usage_perc", "Fraction of KV blocks in use (0-1)", labels, registry=r)
        self.hit_rate = Gauge("cuttle_prefix_cache_hit_rate", "Prompt tokens served from the prefix cache / prompt tokens", labels, registry=r)
        self.requests = Counter("cuttle_requests", "Finished requests by finish reason", labels + ["finish_reason"], registry=r)
        self.disconnects = Counter("cuttle_client_disconnects", "Requests aborted because their client went away", labels, registry=r)
        self.ttft = Histogram("cuttle_time_to_first_token_seconds", "Time to first token", labels, buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("cuttle_inter_token_latency_seconds", "Time between streamed outputs", labels, buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("cuttle_e2e_request_latency_seconds", "End-to-end request latency", labels, buckets=_LATENCY_BUCKETS, registry=r)
        self.host_usage = Gauge("cuttle_kv_host_cache_usage_perc", "Fraction of host-tier KV blocks in use (0-1)", labels, registry=r)
        # with --enable-lora only
        self.lora_loaded = Gauge("cuttle_lora_adapters_loaded", "LoRA adapters held loaded (at most --max-loras)", labels, registry=r)
        self.lora_running = Gauge("cuttle_lora_requests_running", "Running requests under a LoRA adapter", labels, registry=r)
        self.totals = _Totals(model_name)
        r.register(self.totals)

    def render(self, stats: dict[str, Any]) -> bytes:
        m = self.model
        self.running.labels(m).set(stats["num_requests_running"])
        self.waiting.labels(m).set(stats["num_requests_waiting"])
        total = max(stats["kv_blocks_total"], 1)
        self.kv_usage.labels(m).set(1.0 - stats["kv_blocks_free"] / total)
        self.hit_rate.labels(m).set(stats["cached_tokens"] / max(stats["prompt_tokens"], 1))
        self.totals.stats = stats
        if "kv_host_blocks_total" in stats:
            self.host_usage.labels(m).set(1.0 - stats["kv_host_blocks_free"] / max(stats["kv_host_blocks_total"], 1))
        if "lora_adapters_loaded" in stats:
            self.lora_loaded.labels(m).set(stats["lora_adapters_loaded"])
            self.lora_running.labels(m).set(stats["lora_requests_running"])
        return generate_latest(self.registry)
