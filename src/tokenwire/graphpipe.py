"""Public GraphPipe client API: `from tokenwire.graphpipe import Client, AsyncClient, execute`."""

from tokenwire.protocols.graphpipe.client import (
    AsyncClient,
    Client,
    GraphPipeClientError,
    execute,
    execute_multi,
    metadata,
)
from tokenwire.protocols.graphpipe.codec import IOMetadata, MetadataResponse
from tokenwire.protocols.graphpipe.types import Type

__all__ = [
    "AsyncClient",
    "Client",
    "GraphPipeClientError",
    "IOMetadata",
    "MetadataResponse",
    "Type",
    "execute",
    "execute_multi",
    "metadata",
]
