"""`tokenwire graphpipe URL`: describe a GraphPipe model, or run a request with .npy inputs."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("graphpipe", help="GraphPipe client: show a model's metadata or run a request")
    p.add_argument("url", help="model URL, e.g. http://127.0.0.1:9000/mlp")
    p.add_argument(
        "--input", action="append", default=[], type=Path, help="input tensor as .npy (repeatable)"
    )
    p.add_argument(
        "--input-name", action="append", default=[], help="name of each --input (default: the model's)"
    )
    p.add_argument(
        "--output-name", action="append", default=[], help="outputs to request (default: the model's)"
    )
    p.add_argument("--config", help="config string sent with the request (e.g. JSON)")
    p.add_argument("--save", type=Path, help="write the outputs to this .npz file")
    p.add_argument("--json", action="store_true", help="print outputs (or metadata) as JSON")
    p.set_defaults(handler=run_graphpipe)


def run_graphpipe(args: argparse.Namespace) -> int:
    from tokenwire.protocols.graphpipe.client import Client, GraphPipeClientError
    from tokenwire.protocols.graphpipe.types import type_name

    try:
        with Client(args.url) as client:
            if not args.input:
                meta = client.metadata()
                described = {
                    "name": meta.name,
                    "version": meta.version,
                    "server": meta.server,
                    "description": meta.description,
                    **{
                        kind: [{"name": io.name, "type": type_name(io.type), "shape": io.shape} for io in ios]
                        for kind, ios in (("inputs", meta.inputs), ("outputs", meta.outputs))
                    },
                }
                print(json.dumps(described, indent=1 if args.json else None))
                return 0
            inputs = [np.load(path, allow_pickle=False) for path in args.input]
            outputs = client.execute_multi(
                inputs, args.input_name or None, args.output_name or None, args.config
            )
    except (GraphPipeClientError, OSError, ValueError) as exc:
        code = getattr(exc, "code", None)
        print(f"tokenwire graphpipe: {exc}" + (f" (error code {code})" if code else ""), file=sys.stderr)
        return 1
    names = args.output_name or [f"output_{i}" for i in range(len(outputs))]
    if args.save:
        np.savez(args.save, **dict(zip(names, outputs, strict=False)))
    for name, arr in zip(names, outputs, strict=False):
        if args.json:
            value = (
                arr.tolist()
                if arr.dtype != object
                else [b.decode("utf-8", "replace") for b in arr.reshape(-1)]
            )
            print(
                json.dumps({"name": name, "dtype": str(arr.dtype), "shape": list(arr.shape), "value": value})
            )
        else:
            print(f"{name}: {arr.dtype} {list(arr.shape)}\n{arr}")
    return 0
