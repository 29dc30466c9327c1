"""Prometheus metrics of a server, named after vLLM's with an ``hf_paged:`` prefix (or vLLM's own ``vllm:``, for
its dashboards and gateways: ``ServingOptions.metrics_prefix``) and labelled as vLLM's.

Every app has its own `CollectorRegistry`, so several servers can live in one process. The engine thread updates
the metrics after each step (`ServerMetrics.observe_step`); scraping ``/metrics`` only reads them.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from ..generation import EngineStats, RequestOutput

METRICS_PREFIXES = ("hf_paged", "vllm")
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0, 160.0, 640.0, 2560.0)
_TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                480.0, 960.0, 1920.0, 7680.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
_ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_N_BUCKETS = (1, 2, 5, 10, 20)
# A finished request's phases (vLLM's request_*_time_seconds): arrival -> first scheduled -> first token -> finished.
_PHASES = (("queue", "Arrival to first scheduled (waiting for a place in the batch).", "arrival_time",
            "first_scheduled_time"),
           ("prefill", "First scheduled to first token (the prompt's prefill, chunks and all).", "first_scheduled_time",
            "first_token_time"),
           ("decode", "First token to finish.", "first_token_time", "finished_time"),
           ("inference", "First scheduled to finish.", "first_scheduled_time", "finished_time"))


def _one_two_five(limit: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``limit``: token-count buckets, as vLLM's."""
    return tuple(step * 10**power for power in range(len(str(limit))) for step in (1, 2, 5)
                 if step * 10**power <= limit)

# The finish reasons a sample is counted under (vLLM's; "error": failed in the engine), each series there from the
# start.
FINISH_REASONS = ("stop", "length", "abort", "error")
# Cumulative EngineStats fields, exported as counters of the same name.
_COUNTERS = ("prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "prompt_tokens", "generation_tokens",
             "spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")


class ServerMetrics:
    """The server's gauges, counters and histograms, registered in ``registry``, each labelled with vLLM's
    ``model_name`` (the served model's name), which vLLM's dashboards select by."""

    def __init__(self, registry: CollectorRegistry | None = None, model_name: str = "", max_model_len: int = 1 << 20,
                 prefix: str = "hf_paged"):
        if prefix not in METRICS_PREFIXES:
            raise ValueError(f"the metrics' prefix is one of {', '.join(METRICS_PREFIXES)}, got {prefix!r}")
        self.registry = registry if registry is not None else CollectorRegistry()
        self.model_name, self.prefix = model_name, prefix

        def made(kind, name: str, text: str, **options):
            return kind(f"{prefix}:{name}", text, ["model_name"], registry=self.registry, **options).labels(model_name)

        self.num_running = made(Gauge, "num_requests_running", "Sequences in the running batch.")
        self.num_waiting = made(Gauge, "num_requests_waiting", "Sequences waiting to be scheduled.")
        self.kv_usage = made(Gauge, "kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = full).")
        self.counters = {name: made(Counter, name, f"EngineStats.{name} since the engine started.")
                         for name in _COUNTERS}
        self.spec_acceptance = made(Gauge, "spec_decode_acceptance_rate",
                                    "Speculative guesses kept over guesses verified, since the engine started.")
        self.spec_per_position = Counter(f"{prefix}:spec_decode_num_accepted_tokens_per_pos", "Speculative guesses "
                                         "kept at each position of the guesses.", ["model_name", "position"],
                                         registry=self.registry)
        self.spec_length = made(Gauge, "spec_decode_mean_accepted_length",
                                "Tokens a sequence gained per step that verified its speculative guesses.")
        self.request_success = Counter(f"{prefix}:request_success", "Finished samples (each of a request's n, as "
                                       "vLLM's child requests) by finish reason.", ["model_name", "finished_reason"],
                                       registry=self.registry)
        for reason in FINISH_REASONS:
            self.request_success.labels(model_name=model_name, finished_reason=reason)
        self.step_failures = made(Counter, "engine_step_failures", "Engine steps that raised.")
        self.ttft = made(Histogram, "time_to_first_token_seconds", "Arrival to first token (observed when it comes).",
                         buckets=_TTFT_BUCKETS)
        self.itl = made(Histogram, "inter_token_latency_seconds",
                        "Time between a request's consecutive outputs of tokens (one per step that gave it tokens).",
                        buckets=_TPOT_BUCKETS)
        self.itl_alias = made(Histogram, "time_per_output_token_seconds", "inter_token_latency_seconds under its "
                              "older name (vLLM's deprecated alias).", buckets=_TPOT_BUCKETS)
        self.tpot = made(Histogram, "request_time_per_output_token_seconds", "A finished request's mean time between "
                         "its output tokens.", buckets=_TPOT_BUCKETS)
        self.e2e = made(Histogram, "e2e_request_latency_seconds", "Arrival to finish.", buckets=_E2E_BUCKETS)
        self.phases = [(made(Histogram, f"request_{phase}_time_seconds", text, buckets=_E2E_BUCKETS), start, end)
                       for phase, text, start, end in _PHASES]
        self.max_model_len = max_model_len
        tokens = _one_two_five(max_model_len)
        self.prompt_tokens = made(Histogram, "request_prompt_tokens", "A finished request's prompt tokens.",
                                  buckets=tokens)
        self.generation_tokens = made(Histogram, "request_generation_tokens",
                                      "A finished sample's generated tokens (each of a request's n).", buckets=tokens)
        self.max_generation_tokens = made(Histogram, "request_max_num_generation_tokens",
                                          "The most tokens one sample of a finished request generated.", buckets=tokens)
        self.params_n = made(Histogram, "request_params_n", "A finished request's n.", buckets=_N_BUCKETS)
        self.params_max_tokens = made(Histogram, "request_params_max_tokens", "A finished request's max_tokens (the "
                                      "context its prompt left, when it gave none).", buckets=tokens)
        self.iteration_tokens = made(Histogram, "iteration_tokens_total", "Tokens one step counted: the prompts whose "
                                     "first token came, and the tokens generated.", buckets=_ITERATION_BUCKETS)
        self.batch_size = made(Histogram, "num_running_per_step",
                               "Sequences that produced tokens in one step (the decode batch size).",
                               buckets=_BATCH_BUCKETS)
        # vLLM's, which gateways route LoRA requests by: one series, labelled with the adapters now running and
        # waiting, set to the time of its last update (the series of earlier labels are removed).
        self.lora_info = Gauge(f"{prefix}:lora_requests_info", "Running stats on LoRA requests.",
                               ["max_lora", "waiting_lora_adapters", "running_lora_adapters"], registry=self.registry)
        self._lora_labels: tuple[str, str, str] | None = None
        self._last = dict.fromkeys(_COUNTERS, 0)
        self._last_per_position: dict[int, int] = {}
        self._last_token_time: dict[str, float] = {}  # requests in flight that have tokens: when they last got some
        # Requests in flight: each sample's tokens so far and its finish reason (a sample may finish before the rest).
        self._samples: dict[str, dict[int, tuple[int, str | None]]] = {}
        self._params: dict[str, tuple[int, int | None]] = {}  # requests in flight: their n and max_tokens
        self._failed: set[str] = set()  # requests in flight that a failed step failed

    def set_cache_config(self, **config: object) -> None:
        """vLLM's ``cache_config_info``: one series, labelled with the KV cache's settings, set to 1."""
        info = Gauge(f"{self.prefix}:cache_config_info", "The KV cache's configuration.", sorted(config),
                     registry=self.registry)
        info.labels(**{name: str(value) for name, value in config.items()}).set(1)

    def observe_submitted(self, request_id: str, n: int, max_tokens: int | None) -> bool:
        """A request queued with these parameters (observed when it finishes, as vLLM's); False where a request of
        that id is in flight already (the engine refuses this one)."""
        if request_id in self._params:
            return False
        self._params[request_id] = n, max_tokens
        return True

    def withdraw(self, request_id: str) -> None:
        """A request submitted but refused before it was queued."""
        self._params.pop(request_id, None)

    def observe_step(self, stats: EngineStats, outputs: list[RequestOutput]) -> None:
        """Record one engine step: ``stats`` taken after it, ``outputs`` what it returned (``DELTA`` outputs, as the
        server asks for)."""
        self.num_running.set(stats.num_running)
        self.num_waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_cache_usage)
        if stats.spec_decode_num_drafts:
            self.spec_acceptance.set(stats.spec_decode_acceptance_rate)
            self.spec_length.set(stats.spec_decode_mean_accepted_length)
        if stats.max_loras:
            self._observe_loras(stats)
        for position, kept in enumerate(stats.spec_decode_num_accepted_tokens_per_pos):
            counted = self._last_per_position.get(position, 0)
            series = self.spec_per_position.labels(model_name=self.model_name, position=str(position))
            if kept > counted:
                series.inc(kept - counted)
            self._last_per_position[position] = kept
        self.iteration_tokens.observe(stats.prompt_tokens - self._last["prompt_tokens"] + stats.generation_tokens
                                      - self._last["generation_tokens"])
        for name in _COUNTERS:
            value = getattr(stats, name)
            if value > self._last[name]:
                self.counters[name].inc(value - self._last[name])
            self._last[name] = value
        # A sequence that kept speculative guesses gains several tokens in a step and counts once.
        sequences = sum(1 for output in outputs for sample in output.outputs if sample.token_ids)
        if sequences:
            self.batch_size.observe(sequences)
        now = time.monotonic()
        for output in outputs:
            samples = self._samples.setdefault(output.request_id, {})
            for sample in output.outputs:
                tokens, _ = samples.get(sample.index, (0, None))
                samples[sample.index] = tokens + len(sample.token_ids), sample.finish_reason
            if any(sample.token_ids for sample in output.outputs):
                self._observe_tokens(output, now)
            if output.finished:
                self._observe_finished(output)

    def observe_pooled(self, prompt_lengths: list[int]) -> None:
        """Inputs embedded (each a request that finished, as in vLLM, whose pooling requests run in its engine)."""
        self.counters["prompt_tokens"].inc(sum(prompt_lengths))
        self.request_success.labels(model_name=self.model_name, finished_reason="stop").inc(len(prompt_lengths))
        for length in prompt_lengths:
            self.prompt_tokens.observe(length)

    def observe_failed(self, request_ids: list[str]) -> None:
        """Requests the engine failed as a whole (a failed step), then aborted: their final output, an abort, counts
        as an error."""
        self._failed.update(request_ids)

    def _observe_loras(self, stats: EngineStats) -> None:
        labels = (str(stats.max_loras), ",".join(stats.waiting_lora_adapters), ",".join(stats.running_lora_adapters))
        if labels != self._lora_labels and self._lora_labels is not None:
            self.lora_info.remove(*self._lora_labels)
        self._lora_labels = labels
        self.lora_info.labels(*labels).set_to_current_time()

    def _observe_tokens(self, output: RequestOutput, now: float) -> None:
        last = self._last_token_time.get(output.request_id)
        if last is not None:
            self.itl.observe(now - last)
            self.itl_alias.observe(now - last)
        elif output.metrics.first_token_time is not None:
            self.ttft.observe(output.metrics.first_token_time - output.metrics.arrival_time)
        self._last_token_time[output.request_id] = now

    def _observe_finished(self, output: RequestOutput) -> None:
        self._last_token_time.pop(output.request_id, None)
        samples = self._samples.pop(output.request_id, {})
        failed = output.error is not None or output.request_id in self._failed
        self._failed.discard(output.request_id)
        reasons = ["error"] if failed else [reason or "abort" for _, reason in samples.values()]
        for reason in reasons or ["abort"]:
            self.request_success.labels(model_name=self.model_name, finished_reason=reason).inc()
        n, max_tokens = self._params.pop(output.request_id, (None, None))
        if n is not None:
            self.params_n.observe(n)
            self.params_max_tokens.observe(max_tokens or max(self.max_model_len - len(output.prompt_token_ids), 0))
        m = output.metrics
        if m.finished_time is not None:
            self.e2e.observe(m.finished_time - m.arrival_time)
        for histogram, start, end in self.phases:  # the phases it went through (none for one refused or aborted early)
            began, ended = getattr(m, start), getattr(m, end)
            if began is not None and ended is not None:
                histogram.observe(ended - began)
        if output.error is None and m.first_token_time is not None:  # it ran (not refused, nor aborted waiting)
            self.prompt_tokens.observe(len(output.prompt_token_ids))
            for tokens, _ in samples.values():
                self.generation_tokens.observe(tokens)
            self.max_generation_tokens.observe(max((tokens for tokens, _ in samples.values()), default=0))
        num_tokens = m.num_output_tokens
        if m.first_token_time is not None and num_tokens > 1 and m.finished_time is not None:
            self.tpot.observe((m.finished_time - m.first_token_time) / (num_tokens - 1))
