"""Prometheus metrics for /metrics: the engine's gauges and counters, and request latencies.

Engine figures (running and waiting requests, KV tokens used and free, token totals, prefix-cache
hits, and where the routed experts live: residency, cache hit rate, bytes streamed over PCIe per
token and the copies' effective bandwidth, for the first rank) are read at scrape time from the
stats the engine process sent after its latest step, so scraping costs the engine nothing.
Latency histograms are observed in the HTTP process as outputs arrive. Each server has its own
registry (no process-wide globals).
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
)
_TOKEN_GAP_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    2.5,
)

# (metric name, stats key, help)
_GAUGES = [
    ("ft_num_requests_running", "running", "Requests the engine is running"),
    ("ft_num_requests_waiting", "waiting", "Requests waiting for KV blocks, a state slot or a turn"),
    ("ft_kv_cache_used_tokens", "kv_tokens_used", "KV-cache tokens held (whole blocks)"),
    ("ft_kv_cache_free_tokens", "kv_tokens_free", "KV-cache tokens free (whole blocks)"),
    ("ft_moe_expert_residency", "moe_residency", "Fraction of routed experts resident on the GPU"),
    ("ft_moe_resident_experts", "moe_resident", "Routed experts resident on the GPU, all layers"),
    ("ft_moe_cache_slots_per_layer", "moe_slots", "GPU expert-cache slots per MoE layer"),
    ("ft_moe_expert_hit_rate", "moe_hit_rate", "Hits over expert uses, cumulative"),
    ("ft_moe_bytes_per_token", "moe_bytes_per_token", "Expert bytes over PCIe (copied, read) per token"),
    ("ft_moe_pcie_gb_per_second", "moe_pcie_gb_s", "Effective host-to-device bandwidth of expert copies"),
]
_COUNTERS = [
    ("ft_prompt_tokens", "prompt_tokens", "Prompt tokens computed (prefix-cache hits excluded)"),
    ("ft_generation_tokens", "generation_tokens", "Tokens generated"),
    ("ft_prefix_cache_hit_tokens", "prefix_hit_tokens", "Prompt tokens served from the prefix cache"),
    ("ft_moe_expert_hits", "moe_hits", "Expert uses ((layer, expert) a forward routes to) found resident"),
    ("ft_moe_expert_misses", "moe_misses", "Expert uses that did not (copied, streamed or run on the CPU)"),
    ("ft_moe_expert_evictions", "moe_evictions", "Experts evicted from the GPU cache"),
    ("ft_moe_experts_prefetched", "moe_prefetched", "Experts copied ahead of need"),
    ("ft_moe_bytes_streamed", "moe_bytes_h2d", "Expert bytes copied host to device"),
    ("ft_moe_bytes_host_read", "moe_bytes_host_read", "Expert bytes kernels read from host memory in place"),
    ("ft_moe_prestaged_layers", "moe_prestaged_layers", "Layers prefills ran on experts staged while idle"),
]


class _EngineCollector:
    def __init__(self, stats: Callable[[], dict], labels: dict[str, str]) -> None:
        self.stats, self.labels = stats, labels

    def collect(self):
        stats = self.stats()
        for name, key, help_text in _GAUGES:
            g = GaugeMetricFamily(name, help_text, labels=list(self.labels))
            g.add_metric(list(self.labels.values()), float(stats.get(key, 0)))
            yield g
        for name, key, help_text in _COUNTERS:
            c = CounterMetricFamily(name, help_text, labels=list(self.labels))
            c.add_metric(list(self.labels.values()), float(stats.get(key, 0)))
            yield c
        info = GaugeMetricFamily(
            "ft_moe_backend_info", "The MoE backend in use (value 1)", labels=[*self.labels, "backend"]
        )
        info.add_metric([*self.labels.values(), str(stats.get("moe_backend", "gpu"))], 1.0)
        yield info


class Metrics:
    def __init__(self, model_name: str, stats: Callable[[], dict]) -> None:
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}
        self.registry.register(_EngineCollector(stats, labels))
        self.ttft = Histogram(
            "ft_time_to_first_token_seconds",
            "Time from the request's arrival to its first generated token",
            ["model_name"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        ).labels(model_name)
        self.itl = Histogram(
            "ft_inter_token_latency_seconds",
            "Time between successive generated tokens of a request",
            ["model_name"],
            buckets=_TOKEN_GAP_BUCKETS,
            registry=self.registry,
        ).labels(model_name)
        self.e2e = Histogram(
            "ft_e2e_request_latency_seconds",
            "Time from a choice's arrival to its last token",
            ["model_name"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        ).labels(model_name)
        self._finished = Counter(
            "ft_requests",
            "Finished choices by finish reason",
            ["model_name", "finish_reason"],
            registry=self.registry,
        )
        self.model_name = model_name

    def finished(self, reason: str, seconds: float) -> None:
        self._finished.labels(self.model_name, reason).inc()
        self.e2e.observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
