"""The names of tokenwire's Ray actors in a namespace, and finding or removing them: used by the
cluster's set-up (cluster.py), the session map's recovery (directory.py) and `tokenwire ray
status/down` (status_cmd.py). Light on purpose: the status command reads it without the engine."""

from __future__ import annotations

from typing import Any

NAMESPACE = "tokenwire"
REPLICA_PREFIX = "tokenwire-replica-"  # + the replica's index
DIRECTORY_NAME = "tokenwire-sessions"  # the session -> replica map (directory.py)


def find_replicas(namespace: str = NAMESPACE) -> list[tuple[int, Any]]:
    """The replica actors alive in the namespace (for `tokenwire ray status`)."""
    # local: ray is optional (the `ray` extra) and slow to import; only a joined process calls this
    import ray
    from ray.util import list_named_actors

    found = []
    for entry in list_named_actors(all_namespaces=True):
        name = entry["name"] if isinstance(entry, dict) else entry
        ns = entry.get("namespace") if isinstance(entry, dict) else namespace
        if ns == namespace and name.startswith(REPLICA_PREFIX):
            found.append((int(name[len(REPLICA_PREFIX) :]), ray.get_actor(name, namespace=namespace)))
    return sorted(found, key=lambda pair: pair[0])


def remove_all(namespace: str = NAMESPACE) -> int:
    """Kill the namespace's replicas and session map (no restart); how many actors were removed."""
    # local: ray is optional (see find_replicas)
    import ray

    actors = [actor for _, actor in find_replicas(namespace)]
    try:
        actors.append(ray.get_actor(DIRECTORY_NAME, namespace=namespace))
    except ValueError:  # no session map in this namespace
        pass
    for actor in actors:
        ray.kill(actor, no_restart=True)
    return len(actors)
