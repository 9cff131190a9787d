"""Starting or joining a Ray cluster and getting the replica actors and the session directory.

Replicas are named actors (`tokenwire-replica-<i>` in the namespace, default "tokenwire"): the
first ingress process creates them, later ones (same --ray-address and namespace) find the same
ones by name. On a cluster joined with --ray-address the replicas and the session map are
detached actors: they outlive the ingress that created them, so ingress processes behind a load
balancer come and go freely, and `tokenwire ray down` removes them. On the local cluster an
ingress starts for itself they end with it (the cluster does). Ray restarts a dead replica
(max_restarts=-1); calls that were in flight on it fail (max_task_retries=0: a generation is not
silently re-run on a fresh KV cache).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace
from typing import Any

from tokenwire.engine.factory import EngineSettings
from tokenwire.scale.actors import DIRECTORY_NAME, NAMESPACE, REPLICA_PREFIX
from tokenwire.scale.directory import SessionDirectory
from tokenwire.scale.replica import EngineReplica, ReplicaInfo

log = logging.getLogger("tokenwire.scale")
OBJECT_STORE_MB = 200  # token event batches are small; the default (30% of RAM) is not needed


@dataclass
class ClusterSpec:
    replicas: int
    address: str | None = None
    namespace: str = NAMESPACE
    replica_cpus: float = 1.0
    replica_gpus: float = 0.0
    start_timeout_s: float = 600.0

    @property
    def detached(self) -> bool:
        """On a joined cluster the replicas outlive the ingress that made them (module doc)."""
        return bool(self.address)


def connect(spec: ClusterSpec) -> None:
    """ray.init: join `spec.address`, or start a local cluster sized for the replicas."""
    # Ray's C++ failure-signal handler would take over SIGTERM in this process (a stack dump,
    # and no clean shutdown); serve handles SIGTERM itself
    os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")
    # local: ray is optional (the `ray` extra), and reads RAY_DISABLE_FAILURE_SIGNAL_HANDLER when imported
    import ray

    if ray.is_initialized():
        return
    if spec.address:
        ray.init(address=spec.address, namespace=spec.namespace, log_to_driver=True)
        return
    cores = os.cpu_count() or 1
    wanted = spec.replicas * spec.replica_cpus
    if wanted > cores:
        log.warning(
            "%d replicas x %.2g CPUs = %.2g CPUs on a %d-core machine: oversubscribed",
            spec.replicas, spec.replica_cpus, wanted, cores,
        )  # fmt: skip
    ray.init(
        namespace=spec.namespace,
        num_cpus=max(cores, int(wanted + 0.999)),
        num_gpus=None,
        object_store_memory=OBJECT_STORE_MB * 2**20,
        include_dashboard=False,  # plain `ray` has no dashboard packages
        log_to_driver=True,
    )


def replica_threads(cpus: float) -> int:
    """torch threads of a replica: its declared CPUs (at least one)."""
    return max(1, int(cpus))


def start_replicas(spec: ClusterSpec, settings: EngineSettings) -> tuple[list[Any], Any, list[ReplicaInfo]]:
    """The replica actors (created or found), the session directory, and each replica's info
    (waits until every replica has loaded its model)."""
    # local: ray is optional (the `ray` extra) and slow; `bench --help` loads this module without it
    import ray

    settings = replace(settings, progress=False)
    if settings.threads is None:
        settings = replace(settings, threads=replica_threads(spec.replica_cpus))
    lifetime = "detached" if spec.detached else None
    directory = (
        ray.remote(SessionDirectory)
        .options(
            name=DIRECTORY_NAME, get_if_exists=True, num_cpus=0, max_restarts=-1, max_concurrency=64,
            lifetime=lifetime,
        )
        .remote()
    )  # fmt: skip
    actor_cls = ray.remote(EngineReplica)
    actors = [
        actor_cls.options(
            name=f"{REPLICA_PREFIX}{i}",
            get_if_exists=True,
            num_cpus=spec.replica_cpus,
            num_gpus=spec.replica_gpus,
            max_restarts=-1,
            max_task_retries=0,
            max_concurrency=1000,
            lifetime=lifetime,
        ).remote(i, settings)
        for i in range(spec.replicas)
    ]
    log.info(
        "%d engine replicas (%.2g CPUs, %.2g GPUs each) loading on Ray", spec.replicas, spec.replica_cpus,
        spec.replica_gpus,
    )  # fmt: skip
    infos: list[ReplicaInfo] = ray.get([a.info.remote() for a in actors], timeout=spec.start_timeout_s)
    for info in infos:
        log.info("replica %d: pid %d on %s, device %s (%s)", info.index, info.pid, info.node, info.device,
                 info.incarnation)  # fmt: skip
    # the sessions each replica restored from its state dir (engine/persistence.py), in the map: a
    # session map made with this start asked the replicas before they existed
    held = ray.get([a.sessions.remote() for a in actors], timeout=spec.start_timeout_s)
    ray.get([directory.assign_many.remote(ids, i, incarnation) for i, (incarnation, ids) in enumerate(held)],
            timeout=spec.start_timeout_s)  # fmt: skip
    restored = sum(len(ids) for _, ids in held)
    if restored:
        log.info("%d session(s) the replicas restored are in the session map", restored)
    return actors, directory, infos
