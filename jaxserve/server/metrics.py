"""Prometheus metrics of one server. Each server has its own registry, so several can live in one process.

The main ones are also given under vLLM's names (`vllm:...`, with a `model_name` label), read from jaxserve's at
each scrape, so dashboards and autoscalers built for vLLM read a jaxserve server as they read vLLM.
"""

from __future__ import annotations

from typing import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Metric
from prometheus_client.core import GaugeMetricFamily

# Seconds: a CPU token takes tens of milliseconds, a long GPU prefill many seconds.
_LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    1.5,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
)


class ServerMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.ttft = Histogram(
            "jaxserve_time_to_first_token_seconds",
            "From arrival to the first generated token.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "jaxserve_inter_token_latency_seconds",
            "Between consecutive generated tokens of one request.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "jaxserve_e2e_request_latency_seconds",
            "From arrival to the last token.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.waiting = Gauge(
            "jaxserve_num_requests_waiting", "Requests queued, not yet admitted to a batch.", registry=r
        )
        self.running = Gauge("jaxserve_num_requests_running", "Requests in the running batch.", registry=r)
        self.kv_used = Gauge("jaxserve_kv_cache_blocks_used", "KV cache blocks held by requests.", registry=r)
        self.kv_free = Gauge(
            "jaxserve_kv_cache_blocks_free", "KV cache blocks free (free-but-cached included).", registry=r
        )
        self.prefix_queries = Counter(
            "jaxserve_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", registry=r
        )
        self.prefix_hits = Counter("jaxserve_prefix_cache_hits", "Prompt tokens found in the prefix cache.", registry=r)
        self.preemptions = Counter(
            "jaxserve_num_preemptions", "Requests preempted for KV memory (they recompute).", registry=r
        )
        self.prompt_tokens = Counter("jaxserve_prompt_tokens", "Prompt tokens of admitted requests.", registry=r)
        self.generated_tokens = Counter("jaxserve_generation_tokens", "Tokens generated.", registry=r)
        self.step_seconds = Histogram(
            "jaxserve_engine_step_seconds",
            "Engine iterations (count: how many ran), wall "
            "time: scheduling, the compiled step and handing out its tokens.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.step_predicted = Counter(
            "jaxserve_engine_step_predicted_seconds",
            "The scheduler's cost-model "
            "estimate of the same iterations, summed (set beside "
            "jaxserve_engine_step_seconds_sum: how far the model is off live).",
            registry=r,
        )
        self.finished = Counter(
            "jaxserve_requests_finished",
            "Requests that left the engine, by reason "
            "(stop, length, abort: the client left or the server shut down, error: the engine "
            "could not run it).",
            ["reason"],
            registry=r,
        )
        self.cluster_events = Counter(
            "jaxserve_cluster_events",
            "A cluster's scheduling events, by kind (chunks: "
            "prefill chunks run; rebalances: a history moved to a chunk's group; "
            "transfers: KV landed on a decode instance; scale_ups: an elastic batch over "
            "several instances; scale_downs: a prompt's KV kept on fewer of them; "
            "multi_master: a request decoding over several instances; decode_scale_ups: "
            "such a decode grown onto another instance; flips_to_decode, flips_to_prefill: "
            "an instance changed role).",
            ["event"],
            registry=r,
        )
        self.errors = Counter(
            "jaxserve_request_errors",
            "Requests answered with an error, by reason (invalid, "
            "not_found, unauthenticated, too_large, read_timeout, queue_full, shutting_down, "
            "engine_failed, internal).",
            ["reason"],
            registry=r,
        )

    def name_model(self, model_name: str) -> None:
        """Serve the main metrics under vLLM's names too, labelled with the model clients ask for."""
        self.registry.register(_VllmNames(self, model_name))


class _VllmNames:
    """vLLM's names for jaxserve's main metrics: each sample of ours renamed, with a model_name label; and the
    two gauges vLLM derives (KV cache usage and the prefix cache's hit rate, fractions of 1)."""

    def __init__(self, metrics: ServerMetrics, model_name: str):
        m = metrics
        self.metrics, self.model_name = m, model_name
        self.renamed = [
            (m.ttft, "vllm:time_to_first_token_seconds"),
            (m.itl, "vllm:inter_token_latency_seconds"),
            (m.itl, "vllm:time_per_output_token_seconds"),  # vLLM's name before v1
            (m.e2e, "vllm:e2e_request_latency_seconds"),
            (m.waiting, "vllm:num_requests_waiting"),
            (m.running, "vllm:num_requests_running"),
            (m.prefix_queries, "vllm:prefix_cache_queries"),
            (m.prefix_hits, "vllm:prefix_cache_hits"),
            (m.preemptions, "vllm:num_preemptions"),
            (m.prompt_tokens, "vllm:prompt_tokens"),
            (m.generated_tokens, "vllm:generation_tokens"),
            (m.finished, "vllm:request_success"),
        ]

    def collect(self) -> Iterator[Metric]:
        label = {"model_name": self.model_name}
        for metric, name in self.renamed:
            for family in metric.collect():
                out = Metric(name, family.documentation, family.type)
                for sample in family.samples:
                    labels = {("finished_reason" if k == "reason" else k): v for k, v in sample.labels.items()}
                    out.add_sample(name + sample.name[len(family.name) :], label | labels, sample.value)
                yield out
        used, free = (self._value(x) for x in (self.metrics.kv_used, self.metrics.kv_free))
        queries, hits = (self._value(x) for x in (self.metrics.prefix_queries, self.metrics.prefix_hits))
        usage = used / max(used + free, 1)
        for name, doc, value in (
            ("vllm:kv_cache_usage_perc", "KV cache usage: 1 means every block held.", usage),
            ("vllm:gpu_cache_usage_perc", "KV cache usage (vLLM's name before v1).", usage),
            (
                "vllm:gpu_prefix_cache_hit_rate",
                "Prompt tokens found in the prefix cache, of those looked up.",
                hits / max(queries, 1),
            ),
        ):
            family = GaugeMetricFamily(name, doc, labels=list(label))
            family.add_metric(list(label.values()), value)
            yield family

    @staticmethod
    def _value(metric) -> float:
        """A gauge's value, or a counter's total."""
        (family,) = metric.collect()
        return next(s.value for s in family.samples if not s.name.endswith("_created"))
