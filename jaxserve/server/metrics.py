"""Prometheus metrics of one server. Each server has its own registry, so several can live in one process."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Seconds: a CPU token takes tens of milliseconds, a long GPU prefill many seconds.
_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0, 10.0,
                    20.0, 40.0, 80.0)


class ServerMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.ttft = Histogram("jaxserve_time_to_first_token_seconds", "From arrival to the first generated token.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("jaxserve_inter_token_latency_seconds",
                             "Between consecutive generated tokens of one request.", buckets=_LATENCY_BUCKETS,
                             registry=r)
        self.e2e = Histogram("jaxserve_e2e_request_latency_seconds", "From arrival to the last token.",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.waiting = Gauge("jaxserve_num_requests_waiting", "Requests queued, not yet admitted to a batch.",
                             registry=r)
        self.running = Gauge("jaxserve_num_requests_running", "Requests in the running batch.", registry=r)
        self.kv_used = Gauge("jaxserve_kv_cache_blocks_used", "KV cache blocks held by requests.", registry=r)
        self.kv_free = Gauge("jaxserve_kv_cache_blocks_free", "KV cache blocks free (free-but-cached included).",
                             registry=r)
        self.prefix_queries = Counter("jaxserve_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                      registry=r)
        self.prefix_hits = Counter("jaxserve_prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                                   registry=r)
        self.preemptions = Counter("jaxserve_num_preemptions", "Requests preempted for KV memory (they recompute).",
                                   registry=r)
        self.prompt_tokens = Counter("jaxserve_prompt_tokens", "Prompt tokens of admitted requests.", registry=r)
        self.generated_tokens = Counter("jaxserve_generation_tokens", "Tokens generated.", registry=r)
        self.step_seconds = Histogram("jaxserve_engine_step_seconds", "Engine iterations (count: how many ran), wall "
                                      "time: scheduling, the compiled step and handing out its tokens.",
                                      buckets=_LATENCY_BUCKETS, registry=r)
        self.step_predicted = Counter("jaxserve_engine_step_predicted_seconds", "The scheduler's cost-model "
                                      "estimate of the same iterations, summed (set beside "
                                      "jaxserve_engine_step_seconds_sum: how far the model is off live).",
                                      registry=r)
        self.finished = Counter("jaxserve_requests_finished", "Requests that left the engine, by reason "
                                "(stop, length, abort: the client left or the server shut down, error: the engine "
                                "could not run it).", ["reason"],
                                registry=r)
        self.cluster_events = Counter("jaxserve_cluster_events", "A cluster's scheduling events, by kind (chunks: "
                                      "prefill chunks run; rebalances: a history moved to a chunk's group; "
                                      "transfers: KV landed on a decode instance; scale_ups: an elastic batch over "
                                      "several instances; scale_downs: a prompt's KV gathered onto one of them; "
                                      "flips_to_decode, flips_to_prefill: an instance changed role).", ["event"],
                                      registry=r)
        self.errors = Counter("jaxserve_request_errors", "Requests answered with an error, by reason (invalid, "
                              "unauthenticated, too_large, read_timeout, queue_full, shutting_down, engine_failed, "
                              "internal).", ["reason"], registry=r)
