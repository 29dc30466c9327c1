"""The app's ``/metrics``: every replica's server metrics labelled ``replica="<id>"``, their total labelled
``replica="all"`` (sums; the mean for fractions such as ``kv_cache_usage_perc``, the speculation rates from the
summed counters, the latest time of ``lora_requests_info``), and the router's counters. The totals of counters and
histograms keep the last values of the replicas that no longer answer (replaced, or late), so they never go down, as
Prometheus expects of a counter."""

from __future__ import annotations

from collections import defaultdict

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

from .router import RoutingStats

TOTAL = "all"
_MONOTONIC = ("counter", "histogram", "summary")
# Gauges whose total over replicas is a ratio of summed counters, plus a constant (not a sum of the replicas' ratios);
# named without the replicas' prefix ("hf_paged:" or "vllm:").
RATIOS = {
    "spec_decode_acceptance_rate": ("spec_decode_num_accepted_tokens", "spec_decode_num_draft_tokens", 0.0),
    "spec_decode_mean_accepted_length": ("spec_decode_num_accepted_tokens", "spec_decode_num_drafts", 1.0),
}


# Gauges whose total is the replicas' largest value: a time (the series' labels carry the news), or an info gauge's 1.
LATEST = {"lora_requests_info", "cache_config_info"}


def merged_metrics(replica_texts: dict[str, str], stats: RoutingStats | None,
                   gone: dict[str, str] | None = None, num_replicas: int | None = None) -> bytes:
    """Prometheus text of the replicas' metrics (``{replica id: its /metrics text}``) and the router's; the counters
    of the replicas ``gone`` (their last texts) count in the totals only. ``num_replicas``: how many the router
    may send requests to (by default, those that answered)."""
    families: dict[str, Metric] = {}
    totals: dict[str, dict[tuple, list[float]]] = defaultdict(lambda: defaultdict(list))
    answers = [(replica, text, True) for replica, text in sorted(replica_texts.items())]
    for replica, text, live in answers + [(replica, text, False) for replica, text in sorted((gone or {}).items())]:
        for family in text_string_to_metric_families(text):
            if family.name.endswith("_created") or not (live or family.type in _MONOTONIC):
                continue
            merged = families.setdefault(family.name, Metric(family.name, family.documentation, family.type))
            for sample in family.samples:
                if live:
                    merged.add_sample(sample.name, {"replica": replica, **sample.labels}, sample.value)
                totals[family.name][(sample.name, tuple(sorted(sample.labels.items())))].append(sample.value)

    def total(prefix: str, counter: str) -> float:
        return sum(v for values in totals.get(f"{prefix}:{counter}", {}).values() for v in values)

    for name, samples in totals.items():
        prefix, _, short = name.rpartition(":")
        for (sample_name, labels), values in samples.items():
            if short in LATEST:
                value = max(values)
            elif short in RATIOS:
                above, below, plus = RATIOS[short]
                value = plus + total(prefix, above) / total(prefix, below) if total(prefix, below) \
                    else sum(values) / len(values)
            else:
                value = sum(values) / len(values) if name.endswith("_perc") else sum(values)
            families[name].add_sample(sample_name, {"replica": TOTAL, **dict(labels)}, value)
    registry = CollectorRegistry(auto_describe=False)
    replicas = len(replica_texts) if num_replicas is None else num_replicas
    registry.register(_Fixed([*families.values(), *_router_families(stats, replicas)]))
    return generate_latest(registry)


def _router_families(stats: RoutingStats | None, num_replicas: int) -> list[Metric]:
    replicas = GaugeMetricFamily("hf_paged:router_replicas", "Engine replicas the router can send requests to.",
                                 value=num_replicas)
    if stats is None:
        return [replicas]
    counters = [
        ("requests", "Requests routed with a prompt.", stats.requests),
        ("affinity_requests", "Requests sent to a replica that was sent their first prompt block before.",
         stats.affinity_requests),
        ("prompt_blocks", "Full prompt blocks of the routed requests.", stats.prompt_blocks),
        ("matched_blocks", "Prompt blocks the chosen replica was sent before (predicted prefix hits).",
         stats.matched_blocks),
    ]
    return [replicas, *(CounterMetricFamily(f"hf_paged:router_{name}", text, value=value)
                        for name, text, value in counters)]


class _Fixed:
    def __init__(self, families: list[Metric]):
        self.families = families

    def collect(self):
        return self.families
