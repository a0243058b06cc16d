"""Prometheus metrics of the server (prometheus-client), in one registry per server instance.

Gauges are refreshed from the engine's stats snapshot at scrape time; latency histograms are
observed by the request handlers, measured where the client sees them: first token out and
gaps between streamed outputs for streamed requests (a non-streamed client sees nothing before
the end), whole request for all. With KV tiers on (docs/kv_tiers.md), their counters are exported
too: blocks hit per tier, bytes moved per direction, seconds the step waited on transfers.
"""
from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        r, labels = self.registry, ["model_name"]
        self.model = model_name
        self.running = Gauge("cuttle_num_requests_running", "Requests being computed", labels, registry=r)
        self.waiting = Gauge("cuttle_num_requests_waiting", "Requests waiting for KV blocks or budget", labels, registry=r)
        self.kv_usage = Gauge("cuttle_kv_cache_usage_perc", "Fraction of KV blocks in use (0-1)", labels, registry=r)
        self.hit_rate = Gauge("cuttle_prefix_cache_hit_rate", "Prompt tokens served from the prefix cache / prompt tokens", labels, registry=r)
        self.preemptions = Gauge("cuttle_num_preemptions", "Preemptions since start", labels, registry=r)
        self.prompt_tokens = Gauge("cuttle_prompt_tokens", "Prompt tokens admitted since start", labels, registry=r)
        self.generation_tokens = Gauge("cuttle_generation_tokens", "Tokens generated since start", labels, registry=r)
        self.graph_steps = Gauge("cuttle_graph_steps_total", "Decode steps replayed from kernel graphs (CPU) since start", labels, registry=r)
        self.requests = Counter("cuttle_requests", "Finished requests by finish reason", labels + ["finish_reason"], registry=r)
        self.disconnects = Counter("cuttle_client_disconnects", "Requests aborted because their client went away", labels, registry=r)
        self.ttft = Histogram("cuttle_time_to_first_token_seconds", "Time to first token", labels, buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("cuttle_inter_token_latency_seconds", "Time between streamed outputs", labels, buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("cuttle_e2e_request_latency_seconds", "End-to-end request latency", labels, buckets=_LATENCY_BUCKETS, registry=r)
        # KV tiers: running totals from the engine's stats, so gauges named as the counters they mirror
        self.tier_hits = Gauge("cuttle_kv_tier_hit_blocks_total", "KV blocks found in a lower tier and copied back", labels + ["tier"], registry=r)
        self.tier_bytes = Gauge("cuttle_kv_tier_bytes_total", "KV bytes moved between tiers", labels + ["direction"], registry=r)
        self.tier_blocked = Gauge("cuttle_kv_transfer_blocked_seconds_total", "Seconds the engine step waited on KV transfers", labels, registry=r)
        self.tier_swaps = Gauge("cuttle_kv_swap_outs_total", "Preempted sequences whose partial block went to the host tier", labels, registry=r)
        self.tier_documents = Gauge("cuttle_kv_tier_documents_total", "Squid documents offloaded whole, or loaded back per tier",
                                    labels + ["event"], registry=r)
        self.host_usage = Gauge("cuttle_kv_host_cache_usage_perc", "Fraction of host-tier KV blocks in use (0-1)", labels, registry=r)
        # squid documents (engine/squid.py): running totals mirrored from the engine's counters
        self.documents = Gauge("cuttle_squid_documents_total", "Squid documents served from the cache (hit) or computed",
                               labels + ["outcome"], registry=r)
        self.document_tokens = Gauge("cuttle_squid_document_tokens_total", "Squid document tokens reused from the cache or computed",
                                     labels + ["outcome"], registry=r)

    def render(self, stats: dict[str, Any]) -> bytes:
        m = self.model
        self.running.labels(m).set(stats["num_requests_running"])
        self.waiting.labels(m).set(stats["num_requests_waiting"])
        total = max(stats["kv_blocks_total"], 1)
        self.kv_usage.labels(m).set(1.0 - stats["kv_blocks_free"] / total)
        self.hit_rate.labels(m).set(stats["cached_tokens"] / max(stats["prompt_tokens"], 1))
        self.preemptions.labels(m).set(stats["preemptions"])
        self.prompt_tokens.labels(m).set(stats["prompt_tokens"])
        self.generation_tokens.labels(m).set(stats["generated_tokens"])
        self.graph_steps.labels(m).set(stats["graph_steps"])
        self.documents.labels(m, "hit").set(stats["documents_hit"])
        self.documents.labels(m, "computed").set(stats["documents_computed"])
        self.document_tokens.labels(m, "reused").set(stats["document_tokens_reused"])
        self.document_tokens.labels(m, "computed").set(stats["document_tokens_computed"])
        if "kv_host_blocks_total" in stats:
            self.tier_hits.labels(m, "host").set(stats["kv_host_hit_blocks"])
            self.tier_hits.labels(m, "disk").set(stats["kv_disk_hit_blocks"])
            for direction in ("device_to_host", "host_to_device", "host_to_disk", "disk_to_host"):
                self.tier_bytes.labels(m, direction).set(stats[f"kv_bytes_{direction}"])
            self.tier_blocked.labels(m).set(stats["kv_transfer_blocked_s"])
            self.tier_swaps.labels(m).set(stats["kv_swap_outs"])
            self.tier_documents.labels(m, "offloaded").set(stats["kv_offloaded_documents"])
            self.tier_documents.labels(m, "host_hit").set(stats["kv_host_document_hits"])
            self.tier_documents.labels(m, "disk_hit").set(stats["kv_disk_document_hits"])
            self.host_usage.labels(m).set(1.0 - stats["kv_host_blocks_free"] / max(stats["kv_host_blocks_total"], 1))
        return generate_latest(self.registry)
