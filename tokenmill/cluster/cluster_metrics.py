"""The replicas' metrics as the ingress shows them: each replica's series labelled with its
`replica` rank, the counters and gauges (not the ratios) also summed into the unlabelled series
a single-process server exposes (so its dashboards keep working), and how many replicas are up."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tokenmill.cluster.board import ReplicaReport

SUMMED_TYPES = ("counter", "gauge")
RATIO_SUFFIXES = ("_ratio", "_rate")
"""Gauges that are fractions: their sum over replicas means nothing, so they have no total."""


class ReplicaLabelled(Collector):
    def __init__(self, reports: Callable[[], Mapping[int, ReplicaReport]], num_replicas: int):
        self._reports = reports
        self._num_replicas = num_replicas

    def collect(self) -> Iterator[Metric]:
        reports = [r for r in self._reports().values() if r.fresh]
        families: dict[str, Metric] = {}
        totals: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
        for report in sorted(reports, key=lambda r: r.rank):
            for metric in report.families:
                family = families.get(metric.name)
                if family is None:
                    family = Metric(metric.name, metric.documentation, metric.type, metric.unit)
                    families[metric.name] = family
                    totals[metric.name] = {}
                for s in metric.samples:
                    family.samples.append(
                        s._replace(labels={**s.labels, "replica": str(report.rank)})
                    )
                    if metric.type in SUMMED_TYPES and not metric.name.endswith(RATIO_SUFFIXES):
                        key = (s.name, tuple(sorted(s.labels.items())))
                        totals[metric.name][key] = totals[metric.name].get(key, 0.0) + s.value
        for name, family in families.items():
            for (sample_name, labels), value in totals[name].items():
                family.add_sample(sample_name, dict(labels), value)
        yield from families.values()
        up = GaugeMetricFamily("tokenmill_replicas_up", "Replicas reporting a running engine")
        up.add_metric([], sum(1 for r in reports if r.running))
        yield up
        wanted = GaugeMetricFamily("tokenmill_replicas", "Replicas the deployment asks for")
        wanted.add_metric([], self._num_replicas)
        yield wanted


class ClusterMetrics:
    """Shaped like EngineMetrics where the server reads it: `registry` and `summary()`."""

    def __init__(self, reports: Callable[[], Mapping[int, ReplicaReport]], num_replicas: int):
        self._reports = reports
        self.num_replicas = num_replicas
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(ReplicaLabelled(reports, num_replicas))

    def replicas_up(self) -> int:
        return sum(1 for r in self._reports().values() if r.fresh and r.running)

    def summary(self) -> dict[str, Any]:
        """The replicas' counts summed, and each replica's own summary under `replicas`."""
        summaries = {rank: r.summary for rank, r in sorted(self._reports().items()) if r.fresh}
        total: dict[str, Any] = {}
        for summary in summaries.values():
            for key, value in summary.items():
                if isinstance(value, int) and not isinstance(value, bool):
                    total[key] = total.get(key, 0) + value
        queried = total.get("prefix_cache_queried_tokens", 0)
        total["prefix_cache_hit_rate"] = (
            total.get("prefix_cache_hit_tokens", 0) / queried if queried else None
        )
        return {
            **total,
            "replicas_up": self.replicas_up(),
            "num_replicas": self.num_replicas,
            "replicas": {str(rank): s for rank, s in summaries.items()},
        }
