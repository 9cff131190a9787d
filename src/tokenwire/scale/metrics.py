"""/metrics under --replicas: the engine-state series of tokenwire/metrics.py, one sample per
replica (label `replica`), from the stats the facade polls (no round trip at scrape time), plus
whether each replica is up and per-replica request counts.

The request latency histograms (TTFT, inter-token) and the access log lines are taken here, at the
ingress, from when each token event arrived: the latency a client sees, the hop to the replica
included.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from tokenwire.engine.request import FinishEvent
from tokenwire.metrics import REGISTRY, record_request
from tokenwire.scale.facade import ReplicaEngine
from tokenwire.scale.handle import RemoteHandle

REPLICA_REQUESTS = Counter(
    "tokenwire_replica_requests",
    "Finished generation requests per engine replica",
    ["replica", "outcome"],
    registry=REGISTRY,
)


class ReplicaCollector:
    def __init__(self, engine: ReplicaEngine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        stats = self.engine.replica_stats()
        block = self.engine.kv_block_size
        up = GaugeMetricFamily(
            "tokenwire_replica_up", "1 while the engine replica serves", labels=["replica"]
        )
        running = GaugeMetricFamily("tokenwire_requests_running", "Requests being run", labels=["replica"])
        queued = GaugeMetricFamily(
            "tokenwire_requests_queued", "Requests awaiting admission", labels=["replica"]
        )
        blocks = GaugeMetricFamily(
            "tokenwire_kv_blocks", "KV cache blocks by state", labels=["replica", "state"]
        )
        hits = CounterMetricFamily(
            "tokenwire_prefix_cache_hit_tokens", "Prompt tokens whose KV came from the prefix cache",
            labels=["replica"],
        )  # fmt: skip
        sessions = GaugeMetricFamily("tokenwire_sessions_open", "Engine sessions alive", labels=["replica"])
        load = GaugeMetricFamily(
            "tokenwire_replica_load_tokens",
            "Queued + running tokens (the router's load measure)",
            labels=["replica"],
        )
        for r, s in enumerate(stats):
            label = str(r)
            up.add_metric([label], 1.0 if s is not None and s["up"] else 0.0)
            if s is None:
                continue
            running.add_metric([label], s["running"])
            queued.add_metric([label], s["waiting"])
            free = s["kv_blocks_available"]
            blocks.add_metric([label, "used"], s["kv_blocks_total"] - free)
            blocks.add_metric([label, "free"], free)
            hits.add_metric([label], s["prefix_cache_hits"] * block)
            sessions.add_metric([label], s["sessions"])
            load.add_metric([label], s["load_tokens"])
        yield from (up, running, queued, blocks, hits, sessions, load)


_collector: ReplicaCollector | None = None


def observe_remote(handle: RemoteHandle, finish: FinishEvent) -> None:
    session = None if handle.ephemeral else handle.session_id
    record_request(handle.origin, finish, handle.arrived, handle.token_times, session, replica=handle.replica)
    REPLICA_REQUESTS.labels(str(handle.replica), finish.reason).inc()


def watch_replicas(engine: ReplicaEngine) -> None:
    global _collector
    if _collector is not None:
        REGISTRY.unregister(_collector)  # type: ignore[arg-type]
    _collector = ReplicaCollector(engine)
    REGISTRY.register(_collector)  # type: ignore[arg-type]
    engine.on_finish = observe_remote
