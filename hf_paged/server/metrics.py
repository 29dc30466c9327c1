"""Prometheus metrics of a server, named after vLLM's with an ``hf_paged:`` prefix.

Every app has its own `CollectorRegistry`, so several servers can live in one process. The engine thread updates
the metrics after each step (`ServerMetrics.observe_step`); scraping ``/metrics`` only reads them.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from ..generation import EngineStats, RequestOutput

_PREFIX = "hf_paged:"
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0, 160.0, 640.0)
_TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                480.0, 960.0, 1920.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)

# Cumulative EngineStats fields, exported as counters of the same name.
_COUNTERS = ("prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "prompt_tokens", "generation_tokens",
             "spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")


class ServerMetrics:
    """The server's gauges, counters and histograms, registered in ``registry``."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.num_running = Gauge(_PREFIX + "num_requests_running", "Sequences in the running batch.", registry=r)
        self.num_waiting = Gauge(_PREFIX + "num_requests_waiting", "Sequences waiting to be scheduled.", registry=r)
        self.kv_usage = Gauge(_PREFIX + "kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = full).",
                              registry=r)
        self.counters = {
            name: Counter(_PREFIX + name, f"EngineStats.{name} since the engine started.", registry=r)
            for name in _COUNTERS
        }
        self.spec_acceptance = Gauge(_PREFIX + "spec_decode_acceptance_rate",
                                     "Speculative guesses kept over guesses verified, since the engine started.",
                                     registry=r)
        self.spec_length = Gauge(_PREFIX + "spec_decode_mean_accepted_length",
                                 "Tokens a sequence gained per step that verified its speculative guesses.", registry=r)
        self.request_success = Counter(_PREFIX + "request_success", "Finished requests by finish reason.",
                                       ["finished_reason"], registry=r)
        self.step_failures = Counter(_PREFIX + "engine_step_failures", "Engine steps that raised.", registry=r)
        self.ttft = Histogram(_PREFIX + "time_to_first_token_seconds", "Arrival to first token.",
                              buckets=_TTFT_BUCKETS, registry=r)
        self.tpot = Histogram(_PREFIX + "time_per_output_token_seconds", "Mean time between output tokens.",
                              buckets=_TPOT_BUCKETS, registry=r)
        self.e2e = Histogram(_PREFIX + "e2e_request_latency_seconds", "Arrival to finish.",
                             buckets=_E2E_BUCKETS, registry=r)
        self.batch_size = Histogram(_PREFIX + "num_running_per_step",
                                    "Sequences that produced tokens in one step (the decode batch size).",
                                    buckets=_BATCH_BUCKETS, registry=r)
        self._last = dict.fromkeys(_COUNTERS, 0)

    def observe_step(self, stats: EngineStats, outputs: list[RequestOutput]) -> None:
        """Record one engine step: ``stats`` taken after it, ``outputs`` what it returned (``DELTA`` outputs, as the
        server asks for)."""
        self.num_running.set(stats.num_running)
        self.num_waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_cache_usage)
        if stats.spec_decode_num_drafts:
            self.spec_acceptance.set(stats.spec_decode_acceptance_rate)
            self.spec_length.set(stats.spec_decode_mean_accepted_length)
        for name in _COUNTERS:
            value = getattr(stats, name)
            if value > self._last[name]:
                self.counters[name].inc(value - self._last[name])
            self._last[name] = value
        # A sequence that kept speculative guesses gains several tokens in a step and counts once.
        sequences = sum(1 for output in outputs for sample in output.outputs if sample.token_ids)
        if sequences:
            self.batch_size.observe(sequences)
        for output in outputs:
            if output.finished:
                self._observe_finished(output)

    def _observe_finished(self, output: RequestOutput) -> None:
        reasons = [o.finish_reason for o in output.outputs]
        reason = "abort" if "abort" in reasons or not reasons else reasons[0]
        self.request_success.labels(finished_reason=reason).inc()
        m = output.metrics
        if m.finished_time is not None:
            self.e2e.observe(m.finished_time - m.arrival_time)
        if m.first_token_time is None:
            return
        self.ttft.observe(m.first_token_time - m.arrival_time)
        num_tokens = m.num_output_tokens
        if num_tokens > 1 and m.finished_time is not None:
            self.tpot.observe((m.finished_time - m.first_token_time) / (num_tokens - 1))
