"""Prometheus series of the gateway (routes, semantic cache) in their own registry, and the
engines' series of a several-model server, each sample labelled with its `model`."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

LOOKUP_BUCKETS_S = (0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.route_requests = Counter(
            "tokenmill_route_requests",
            "Requests a route sent to each model",
            ["route", "model"],
            registry=r,
        )
        self.route_escalations = Counter(
            "tokenmill_route_escalations",
            "Cascade answers of the small model judged unsure and asked of the large one",
            ["route"],
            registry=r,
        )
        self.cache_hits = Counter(
            "tokenmill_semantic_cache_hits", "Answers served from the cache", ["tier"], registry=r
        )
        self.cache_misses = Counter(
            "tokenmill_semantic_cache_misses",
            "Cacheable requests the cache did not answer",
            registry=r,
        )
        self.cache_lookup = Histogram(
            "tokenmill_semantic_cache_lookup_seconds",
            "Time to look a request up in both tiers",
            buckets=LOOKUP_BUCKETS_S,
            registry=r,
        )
        self.cache_entries = Gauge(
            "tokenmill_semantic_cache_entries", "Answers held by the cache", registry=r
        )


class ModelLabelled(Collector):
    """Every series of several registries, one per model, each sample given a `model` label."""

    def __init__(self, registries: Mapping[str, CollectorRegistry]) -> None:
        self._registries = dict(registries)

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for model, registry in self._registries.items():
            for metric in registry.collect():
                family = families.get(metric.name)
                if family is None:
                    family = Metric(metric.name, metric.documentation, metric.type, metric.unit)
                    families[metric.name] = family
                family.samples += [
                    s._replace(labels={**s.labels, "model": model}) for s in metric.samples
                ]
        yield from families.values()


def model_labelled_registry(registries: Mapping[str, CollectorRegistry]) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ModelLabelled(registries))
    return registry
