"""What a GET shows: the MetadataResponse as JSON, or a short HTML page for a browser."""

from __future__ import annotations

import html
from typing import Any

from tokenwire.protocols.graphpipe.codec import IOMetadata, MetadataResponse
from tokenwire.protocols.graphpipe.types import type_name


def _io_json(io: IOMetadata) -> dict[str, Any]:
    return {
        "name": io.name,
        "description": io.description,
        "shape": list(io.shape),
        "type": type_name(io.type),
    }


def metadata_json(meta: MetadataResponse, path: str, models: dict[str, str]) -> dict[str, Any]:
    return {
        "name": meta.name,
        "version": meta.version,
        "server": meta.server,
        "description": meta.description,
        "inputs": [_io_json(io) for io in meta.inputs],
        "outputs": [_io_json(io) for io in meta.outputs],
        "path": path,
        "models": models,  # every model this server hosts: name -> path
    }


def metadata_html(meta: MetadataResponse, path: str, models: dict[str, str]) -> str:
    def rows(items: list[IOMetadata]) -> str:
        return "".join(
            f"<tr><td><code>{html.escape(io.name)}</code></td><td>{type_name(io.type)}</td>"
            f"<td>{html.escape(str(list(io.shape)))}</td><td>{html.escape(io.description)}</td></tr>"
            for io in items
        )

    links = " · ".join(f'<a href="{html.escape(p)}">{html.escape(n)}</a>' for n, p in models.items())
    head = "<tr><th>name</th><th>type</th><th>shape (-1 = any)</th><th>description</th></tr>"
    return (
        "<!doctype html><html><head><meta charset='utf-8'>"
        f"<title>GraphPipe: {html.escape(meta.name)}</title></head><body>"
        f"<h1>{html.escape(meta.name)}</h1><p>{html.escape(meta.description)}</p>"
        f"<p>GraphPipe endpoint <code>{html.escape(path)}</code>: POST a flatbuffer Request "
        f"(server {html.escape(meta.server)} {html.escape(meta.version)}).</p>"
        f"<h2>Inputs</h2><table border=1>{head}{rows(meta.inputs)}</table>"
        f"<h2>Outputs</h2><table border=1>{head}{rows(meta.outputs)}</table>"
        f"<p>Models on this server: {links}</p></body></html>\n"
    )
