"""Prometheus metrics of one app, named like vLLM's (`vllm:X` is `hf_accel:X`) so dashboards carry over.

Gauges and counters are read from `engine.stats()` at scrape time by a custom collector; the latency histograms
are fed by the engine's finish observer from each finished request's timing. A request that failed alone counts in
`request_success_total` under `finished_reason="error"`; the loop's own death in `engine_loop_failures_total`. Every
series has vLLM's `model_name` label but, with LoRA adapters, `lora_requests_info`, vLLM's: one series whose labels
name the adapters of the running and of the waiting requests (comma-separated) and whose value is the scrape time.
Each app has its own `CollectorRegistry`, so several apps live in one process.

| hf_accel                                   | vLLM                                   | kind      |
|--------------------------------------------|----------------------------------------|-----------|
| hf_accel:num_requests_running              | vllm:num_requests_running              | gauge     |
| hf_accel:num_requests_waiting              | vllm:num_requests_waiting              | gauge     |
| hf_accel:kv_cache_usage_perc               | vllm:kv_cache_usage_perc (0-1)         | gauge     |
| hf_accel:num_preemptions_total             | vllm:num_preemptions_total             | counter   |
| hf_accel:prefix_cache_queries_total        | vllm:prefix_cache_queries_total        | counter   |
| hf_accel:prefix_cache_hits_total           | vllm:prefix_cache_hits_total           | counter   |
| hf_accel:prompt_tokens_total               | vllm:prompt_tokens_total               | counter   |
| hf_accel:generation_tokens_total           | vllm:generation_tokens_total           | counter   |
| hf_accel:spec_decode_num_drafts_total     | vllm:spec_decode_num_drafts_total      | counter   |
| hf_accel:spec_decode_num_draft_tokens_total | vllm:spec_decode_num_draft_tokens_total | counter  |
| hf_accel:spec_decode_num_accepted_tokens_total | vllm:spec_decode_num_accepted_tokens_total | counter |
| hf_accel:spec_decode_num_accepted_tokens_per_pos_total{position} | vllm:spec_decode_num_accepted_tokens_per_pos_total | counter |
| hf_accel:request_success_total             | vllm:request_success_total (+ "error") | counter   |
| hf_accel:engine_loop_failures_total        | (hf_accel's: 1 once the loop has died)  | counter   |
| hf_accel:lora_requests_info (labels above)  | vllm:lora_requests_info                | gauge     |
| hf_accel:time_to_first_token_seconds       | vllm:time_to_first_token_seconds       | histogram |
| hf_accel:inter_token_latency_seconds       | vllm:inter_token_latency_seconds       | histogram |
| hf_accel:e2e_request_latency_seconds       | vllm:e2e_request_latency_seconds       | histogram |
| hf_accel:request_queue_time_seconds        | vllm:request_queue_time_seconds        | histogram |
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..engine.engine_stats import EngineStats
from ..engine.outputs import RequestOutput
from .served_engine import ServedEngine

PREFIX = "hf_accel:"
LABELS = ["model_name"]

GAUGES = {  # EngineStats field -> help
    "num_requests_running": "Requests in the running batch.",
    "num_requests_waiting": "Requests waiting to be scheduled.",
    "kv_cache_usage_perc": "Fraction of KV-cache blocks in use (1 is full).",
}
COUNTERS = {
    "num_preemptions": "Preemptions (recompute) since start.",
    "prefix_cache_queries": "Prompt tokens looked up in the prefix cache.",
    "prefix_cache_hits": "Prompt tokens found in the prefix cache.",
    "prompt_tokens": "Prompt tokens admitted.",
    "generation_tokens": "Tokens generated.",
    "spec_decode_num_drafts": "Speculation rounds: a sequence verifying candidates in a step.",
    "spec_decode_num_draft_tokens": "Candidate tokens verified.",
    "spec_decode_num_accepted_tokens": "Candidate tokens accepted (bonus tokens not counted).",
}
PER_POSITION = ("spec_decode_num_accepted_tokens_per_pos",
                "Candidate tokens accepted, by position in the chain (0: the first after the last token).")
# vLLM's buckets, in seconds
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0]
REQUEST_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0]


class EngineStatsCollector(Collector):
    """The engine's gauges and counters, read at scrape time."""

    def __init__(self, engine: ServedEngine, model_name: str):
        self.engine, self.model_name = engine, model_name

    def collect(self) -> Iterator[Metric]:
        stats = self.engine.stats()
        for name, help_text in GAUGES.items():
            gauge = GaugeMetricFamily(PREFIX + name, help_text, labels=LABELS)
            gauge.add_metric([self.model_name], getattr(stats, name))
            yield gauge
        for name, help_text in COUNTERS.items():
            counter = CounterMetricFamily(PREFIX + name, help_text, labels=LABELS)
            counter.add_metric([self.model_name], getattr(stats, name))
            yield counter
        per_position = CounterMetricFamily(PREFIX + PER_POSITION[0], PER_POSITION[1], labels=LABELS + ["position"])
        for position, count in enumerate(stats.spec_decode_num_accepted_tokens_per_pos):
            per_position.add_metric([self.model_name, str(position)], count)
        yield per_position
        failures = CounterMetricFamily(PREFIX + "engine_loop_failures", "Times the engine loop stopped on an error "
                                       "that concerns every request (the server then answers 503).", labels=LABELS)
        failures.add_metric([self.model_name], 0 if self.engine.is_healthy else 1)
        yield failures
        if stats.max_loras:
            yield lora_requests_info(stats)


def lora_requests_info(stats: EngineStats) -> Metric:
    """vLLM's `lora_requests_info`: the adapters running and waiting, as labels of one series valued now."""
    info = GaugeMetricFamily(PREFIX + "lora_requests_info", "LoRA adapters of the running and the waiting requests.",
                             labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
    info.add_metric([str(stats.max_loras), ",".join(sorted(stats.running_lora_adapters)),
                     ",".join(sorted(stats.waiting_lora_adapters))], time.time())
    return info


class ServerMetrics:
    """One app's registry: the engine collector plus latency histograms fed by `observe`."""

    def __init__(self, engine: ServedEngine, model_name: str):
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.registry.register(EngineStatsCollector(engine, model_name))

        def histogram(name: str, help_text: str, buckets: list[float]) -> Histogram:
            return Histogram(PREFIX + name, help_text, LABELS, buckets=buckets, registry=self.registry)

        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between consecutive tokens of a sample.",
                             ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish of requests not aborted.",
                             REQUEST_BUCKETS)
        self.queue = histogram("request_queue_time_seconds", "Arrival to first scheduled.", REQUEST_BUCKETS)
        self.success = Counter(PREFIX + "request_success", "Finished requests by their first sample's finish reason.",
                               LABELS + ["finished_reason"], registry=self.registry)
        engine.add_finish_observer(self.observe)

    def observe(self, out: RequestOutput) -> None:
        """Record a finished request (called in the engine's thread)."""
        timing, labels = out.timing, [self.model_name]
        if timing.queue_time is not None:
            self.queue.labels(*labels).observe(timing.queue_time)
        if timing.time_to_first_token is not None:
            self.ttft.labels(*labels).observe(timing.time_to_first_token)
        itl = self.itl.labels(*labels)
        for sample in out.outputs:
            for before, after in zip(sample.token_times, sample.token_times[1:]):
                itl.observe(after - before)
        self.success.labels(*labels, out.finish_reason).inc()
        if timing.e2e_latency is not None and out.finish_reason != "abort":
            self.e2e.labels(*labels).observe(timing.e2e_latency)
