"""`tokenwire ray status`: the engine replicas of a running `serve --replicas` on a Ray cluster,
with their sessions, requests and KV usage, and the session map's size.

Light to import (argparse only): ray is imported when the command runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from typing import Any, TypeVar

from tokenwire.cli_args import HelpFormatter
from tokenwire.scale.actors import DIRECTORY_NAME, find_replicas, remove_all

STATS_TIMEOUT_S = 10.0
T = TypeVar("T")


def register_cli(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "ray", help="the engine replicas of `serve --replicas` on Ray", formatter_class=HelpFormatter
    )
    rsub = p.add_subparsers(dest="ray_command", required=True, metavar="ACTION")
    status = _cluster_parser(rsub, "status", "list replicas with their sessions and KV usage")
    status.add_argument("--json", action="store_true", help="print the replicas' stats as JSON")
    status.set_defaults(handler=run_status)
    down = _cluster_parser(
        rsub,
        "down",
        "remove the replicas and session map (they outlive ingress processes on a shared cluster)",
    )
    down.set_defaults(handler=run_down)


def _cluster_parser(rsub: argparse._SubParsersAction, name: str, help: str) -> argparse.ArgumentParser:  # type: ignore[type-arg]
    """An action's parser with the flags naming the cluster and namespace."""
    action = rsub.add_parser(name, help=help, formatter_class=HelpFormatter)
    action.add_argument(
        "--ray-address", default="auto", help="the Ray cluster (auto: the one on this machine)"
    )
    action.add_argument("--ray-namespace", default="tokenwire", help="namespace of the replicas")
    return action


def collect(namespace: str) -> dict[str, Any]:
    """Each replica's stats (or why it did not answer) and the session map's counts."""
    # local: ray is optional (the `ray` extra) and slow to import; `tokenwire --help` loads this module
    import ray

    replicas: list[dict[str, Any]] = []
    found = find_replicas(namespace)
    refs = [actor.stats.remote() for _, actor in found]
    for (index, _), ref in zip(found, refs, strict=True):
        try:
            stats = ray.get(ref, timeout=STATS_TIMEOUT_S)
            replicas.append({"replica": index, "state": "up", **stats})
        except Exception as exc:  # dead, restarting, or not answering: say so, list the others
            replicas.append({"replica": index, "state": f"not answering ({type(exc).__name__})"})
    mapped: dict[int, int] = {}
    try:
        directory = ray.get_actor(DIRECTORY_NAME, namespace=namespace)
        mapped = ray.get(directory.counts.remote(), timeout=STATS_TIMEOUT_S)
    except Exception:  # no serve --replicas running in this namespace
        pass
    for entry in replicas:
        entry["mapped_sessions"] = mapped.get(entry["replica"], 0)
    return {"namespace": namespace, "replicas": replicas, "mapped_sessions": sum(mapped.values())}


def format_table(status: dict[str, Any]) -> str:
    head = f"{'replica':>7} {'state':<10} {'pid':>7} {'sessions':>8} {'mapped':>6} {'running':>7} "
    head += f"{'queued':>6} {'load tok':>8} {'KV used':>14}"
    lines = [head]
    for r in status["replicas"]:
        if r["state"] != "up":
            lines.append(f"{r['replica']:>7} {r['state']}")
            continue
        total, free = r["kv_blocks_total"], r["kv_blocks_available"]
        kv = f"{total - free}/{total} ({100 * (total - free) / max(total, 1):.0f}%)"
        lines.append(
            f"{r['replica']:>7} {'up':<10} {r['pid']:>7} {r['sessions']:>8} {r['mapped_sessions']:>6} "
            f"{r['running']:>7} {r['waiting']:>6} {r['load_tokens']:>8.0f} {kv:>14}"
        )
    lines.append(f"session map: {status['mapped_sessions']} sessions (namespace {status['namespace']!r})")
    return "\n".join(lines)


def _in_cluster(args: argparse.Namespace, action: Callable[[str], T]) -> T | None:
    """action(namespace) while joined to the cluster; None (after saying why) when there is none."""
    os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")
    # local: ray (see collect)
    import ray

    try:
        ray.init(address=args.ray_address, namespace=args.ray_namespace, log_to_driver=False)
    except ConnectionError as exc:
        print(
            f"tokenwire ray {args.ray_command}: no Ray cluster at {args.ray_address}: {exc}", file=sys.stderr
        )
        return None
    try:
        return action(args.ray_namespace)
    finally:
        ray.shutdown()


def run_down(args: argparse.Namespace) -> int:
    removed = _in_cluster(args, remove_all)
    if removed is None:
        return 1
    what = "engine replicas and the session map"
    print(f"removed {removed} actors ({what}) from namespace {args.ray_namespace!r}")
    return 0


def run_status(args: argparse.Namespace) -> int:
    status = _in_cluster(args, collect)
    if status is None:
        return 1
    if not status["replicas"]:
        print(
            f"tokenwire ray status: no engine replicas in namespace {args.ray_namespace!r}", file=sys.stderr
        )
        return 1
    print(json.dumps(status, indent=2) if args.json else format_table(status))
    return 0
