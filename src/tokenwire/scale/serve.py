"""`tokenwire serve --replicas N`: its flags, and building the ReplicaEngine the protocols get.

Importing this module does not import ray (serve's flags are added on every `serve`); ray is
imported when `--replicas` is above 0 and the engine is built.
"""

from __future__ import annotations

import argparse
import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenwire.engine.factory import EngineSettings
    from tokenwire.scale.facade import ReplicaEngine

log = logging.getLogger("tokenwire.scale")


def add_scale_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("scale-out (Ray)")
    g.add_argument(
        "--replicas",
        type=int,
        default=0,
        help="engine replicas as Ray actors, each its own model copy and KV cache (0 = one in-process "
        "engine, no Ray)",
    )
    g.add_argument("--ray-address", help="join this Ray cluster (default: start a local one)")
    g.add_argument(
        "--ray-namespace", default="tokenwire", help="Ray namespace of the replicas and session map"
    )
    g.add_argument(
        "--replica-cpus", type=float, default=1.0, help="CPUs each replica declares (may be fractional)"
    )
    g.add_argument(
        "--replica-gpus", type=float, default=0.0, help="GPUs each replica declares (may be fractional)"
    )
    g.add_argument(
        "--no-prefix-placement",
        dest="prefix_placement",
        action="store_false",
        help="place session-less requests by load only, not on the replica holding their prompt's prefix",
    )


def check_scale_args(args: argparse.Namespace) -> None:
    """Refuse bad values before anything binds or loads (one line naming the flag)."""
    if args.replicas < 0:
        raise ValueError(f"--replicas must be >= 0, got {args.replicas}")
    if args.replicas and args.replica_cpus < 0:
        raise ValueError(f"--replica-cpus must be >= 0, got {args.replica_cpus}")
    if args.replicas and args.replica_gpus < 0:
        raise ValueError(f"--replica-gpus must be >= 0, got {args.replica_gpus}")
    if args.ray_address and not args.replicas:
        raise ValueError("--ray-address needs --replicas N (N > 0)")


def build_replicated(settings: EngineSettings, args: argparse.Namespace) -> ReplicaEngine:
    """Connect to (or start) Ray, start or find the replicas, and stand the facade in front."""
    # local: the replicated engine loads torch and ray; `serve --help` does without
    from tokenwire.model.loader import resolve_model
    from tokenwire.scale.cluster import ClusterSpec, connect, start_replicas
    from tokenwire.scale.facade import ReplicaEngine

    spec = ClusterSpec(
        replicas=args.replicas,
        address=args.ray_address,
        namespace=args.ray_namespace,
        replica_cpus=args.replica_cpus,
        replica_gpus=args.replica_gpus,
    )
    # the front-end needs the tokenizer (protocols encode and decode here), not the weights
    source = resolve_model(settings.model, cache_dir=settings.cache_dir, name=settings.model_name)
    connect(spec)
    actors, directory, infos = start_replicas(spec, settings)
    engine = ReplicaEngine(
        actors, directory, infos, source.tokenizer, prefix_aware=args.prefix_placement,
        detached=spec.detached, source=source,
    )  # fmt: skip
    return engine


def shutdown_ray() -> None:
    # local: ray is optional (the `ray` extra); only --replicas started it
    import ray

    ray.shutdown()
