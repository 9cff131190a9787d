"""Evergreen (evergreen.v2): bidirectional gRPC sessions of node DAGs and actions.

Layout: `nodes.py` (fragment store, DAG rules, limits), `flatten.py` (a node's available
content in depth-first order), `content.py` (chunks -> chat-template tokens), `refs.py` (the
file:// sandbox), `actions.py` (action validation and configs), `core.py` (the sans-IO
session state machine), `executor.py` + `engine_sessions.py` (actions on the engine),
`servicer.py` (the thin grpc.aio adapter), `client.py` (the thick client library), `cli.py`.
"""
