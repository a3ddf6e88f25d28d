"""``/metrics``: the engine's state and the requests' latencies under vLLM's Prometheus metric names.

Gauges and counters are read from the engine at scrape time (a collector); the latency histograms
are observed as requests make tokens. Latencies are simulated seconds (equal to wall seconds at time
scale 1). Each server has its own registry: no process-wide state.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from servelab.replay.core.request import Request, Status

# vLLM's buckets (vllm/v1/metrics/loggers.py)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)


class Metrics:
    """vLLM's metrics for ``sim`` (a serve.sim.Simulation), labelled ``model_name``."""

    def __init__(self, sim, model_name: str):
        self.sim = sim
        self.model = model_name
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token (simulated s).", labels,
                              buckets=TTFT_BUCKETS, registry=self.registry).labels(model_name)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Inter-token latency (simulated s).", labels,
                             buckets=ITL_BUCKETS, registry=self.registry).labels(model_name)
        self.tpot = Histogram("vllm:time_per_output_token_seconds", "Time per output token (simulated s).", labels,
                              buckets=ITL_BUCKETS, registry=self.registry).labels(model_name)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency (simulated s).", labels,
                             buckets=E2E_BUCKETS, registry=self.registry).labels(model_name)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.queries = 0  # prefix cache: prompt tokens looked up, and those found
        self.hits = 0
        self.preemptions_done = 0  # of ended requests (the live ones' are added at scrape time)
        self.success: dict[str, int] = {}
        self.last_token: dict[int, float] = {}
        self.live: dict[int, Request] = {}
        self.registry.register(_State(self))
        sim.listeners.append(self._heard)

    def _heard(self, req: Request, times: list[float], ended: bool) -> None:
        key = id(req)
        if not ended:
            self.live[key] = req
        last = self.last_token.get(key)
        for t in times:
            if last is None:
                self.ttft.observe(t - req.arrival_s)
                self.prompt_tokens += req.prompt_tokens
                self.queries += req.prompt_tokens
                self.hits += req.num_cached_tokens
            else:
                self.itl.observe(t - last)
            last = t
        self.generation_tokens += len(times)
        if last is not None:
            self.last_token[key] = last
        if ended:
            self.live.pop(key, None)
            self.last_token.pop(key, None)
            self.preemptions_done += req.num_preemptions
            if req.status is Status.FINISHED:
                self.e2e.observe(req.finish_s - req.arrival_s)
                if req.num_generated_tokens > 1:
                    self.tpot.observe((req.finish_s - req.first_token_s) / (req.num_generated_tokens - 1))
                self.success["length"] = self.success.get("length", 0) + 1

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _State:
    """The scrape-time part: queues, KV usage and the counters."""

    def __init__(self, metrics: Metrics):
        self.m = metrics

    def collect(self):
        m = self.m
        replicas = m.sim.replicas
        labels = [m.model]

        def gauge(name, doc, value):
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric(labels, value)
            return g

        def counter(name, doc, value):
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric(labels, value)
            return c

        total = sum(r.kv.total for r in replicas)
        usage = sum(r.kv.used for r in replicas) / total if total else 0.0
        yield gauge("vllm:num_requests_running", "Requests in model execution batches.",
                    sum(len(r.running) for r in replicas))
        yield gauge("vllm:num_requests_waiting", "Requests waiting to be processed.",
                    sum(len(r.waiting) for r in replicas))
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage (1 = 100%).", usage)
        yield gauge("vllm:gpu_cache_usage_perc", "GPU KV-cache usage (1 = 100%; vLLM's older name).", usage)
        yield counter("vllm:prefix_cache_queries", "Prefix cache: prompt tokens queried.", m.queries)
        yield counter("vllm:prefix_cache_hits", "Prefix cache: prompt tokens hit.", m.hits)
        live = sum(req.num_preemptions for req in m.live.values())
        yield counter("vllm:num_preemptions", "Cumulative preemptions.", m.preemptions_done + live)
        yield counter("vllm:prompt_tokens", "Prefill tokens processed.", m.prompt_tokens)
        yield counter("vllm:generation_tokens", "Generation tokens processed.", m.generation_tokens)
        success = CounterMetricFamily("vllm:request_success", "Successfully processed requests.",
                                      labels=["model_name", "finished_reason"])
        for reason, n in sorted(m.success.items()):
            success.add_metric([m.model, reason], n)
        yield success
