"""Scale-out: many engine replicas (Ray actors) behind the protocols of one or more ingress processes.

`tokenwire serve --replicas N` hands the protocols a `ReplicaEngine` (facade.py) instead of an
in-process Engine: it has the Engine's interface and sends each call to the replica that holds the
session (directory.py: the session -> replica map, a named Ray actor; router.py: where a new
session goes). Nothing here is imported by `--replicas 0`: this package is the only place that
imports ray. Design and measurements: docs/scale-out.md.
"""
