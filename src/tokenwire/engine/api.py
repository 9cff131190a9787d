"""EngineAPI: what the protocols ask of an engine, and all they may ask.

Two classes implement it, each explicitly (they subclass it): `Engine` (engine/engine.py), one
model in this process, and `ReplicaEngine` (scale/facade.py), N engine replicas on Ray behind one
router. Protocol code is typed against EngineAPI, so what a protocol needs is named here and
exists in both; what only one of them can do is a member with a typed answer for the other (a
None, or a typed error), never an attribute a protocol has to probe for.

Model-thread work (GraphPipe's whole-batch forward) is named, not passed as a closure, because
under --replicas it runs in another process: `model_call("tokenwire.<module>:<function>", ...)`
runs function(engine, ...) on the model thread of this engine or of one replica.
"""

from __future__ import annotations

import importlib
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Protocol

from tokenwire.engine.request import GenerateOptions, RequestHandle
from tokenwire.engine.session import Ttl
from tokenwire.engine.vision import ImageBlock, ImageInput

if TYPE_CHECKING:
    from tokenwire.engine.admission import Limits
    from tokenwire.engine.concepts import ConceptSet
    from tokenwire.model.config import ModelConfig
    from tokenwire.model.loader import ModelSource
    from tokenwire.model.tokenizer import Tokenizer


class RemoteAiciRuns(Protocol):
    """AICI runs handed whole to another process (scale/aici.py's RemoteAici under --replicas).
    Declared here, below the protocols and scale-out, so the engine interface names no layer
    above it; `req` is the AICI protocol's RunRequest."""

    def describe(self) -> str: ...

    async def side(self, op: str, **fields: Any) -> dict[str, Any]: ...

    def run(self, req: Any) -> AsyncIterator[dict[str, Any]]: ...


class EngineAPI(Protocol):
    # ------------------------------------------------------------------ the model
    name: str  # the served model's name (what clients ask for)
    tokenizer: Tokenizer
    config: ModelConfig
    vocab_size: int  # the tokenizer's: valid token ids
    logits_size: int  # the model's output width (>= vocab_size: padded vocabularies)
    eos_ids: frozenset[int]  # the tokenizer's and the model config's end tokens
    max_model_len: int
    limits: Limits  # admission limits, for protocols that check a request before they answer
    concepts: ConceptSet | None  # concept readouts (--concepts), None without
    kv_block_size: int  # positions per KV block (the prefix cache's unit)
    device_type: str  # where the model runs: "cpu" or "cuda"
    source: ModelSource | None  # the model's files (None for a model built in memory: tests)
    # whether sessions stay when this server stops (--replicas on a joined cluster: the replicas
    # keep them), so a protocol does not close them on its way out
    sessions_outlive_server: bool

    # ------------------------------------------------------------------ sessions
    def create_session(self, tokens: Sequence[int] = (), ttl_s: float | Ttl | None = Ttl.DEFAULT) -> str: ...

    def fork_session(self, session_id: str, at: int | None = None) -> str: ...

    def close_session(self, session_id: str) -> bool: ...

    def truncate_session(self, session_id: str, length: int) -> None: ...

    def session_tokens(self, session_id: str) -> list[int]: ...

    def session_busy(self, session_id: str) -> bool: ...

    def touch_session(self, session_id: str) -> None: ...

    def has_session(self, session_id: str) -> bool: ...

    def claim_session(
        self, session_id: str, protocol: str, owner: str = "", metadata: dict[str, Any] | None = None
    ) -> None:
        """A protocol's session by id: it persists across restarts (with --state-dir) and belongs
        to `owner` (a digest of the key that made it, protocols/security.py owner_of); `metadata`
        (JSON) persists with it."""
        ...

    def claimed_sessions(self, protocol: str | None = None) -> list[dict[str, Any]]:
        """The sessions `protocol` (None: any) claimed: id, owner, metadata, idle_s; least
        recently used first."""
        ...

    def session_owner(self, session_id: str) -> str:
        """The owner claim_session gave it ("" for nobody in particular)."""
        ...

    # ------------------------------------------------------------------ requests
    def check(
        self,
        session_id: str | None = None,
        append: Sequence[int] = (),
        options: GenerateOptions | None = None,
        *,
        needs_room: bool = False,
    ) -> int:
        """The EngineError `generate` would raise, raised without starting anything; the prompt
        length otherwise."""
        ...

    def generate(
        self,
        session_id: str | None = None,
        append: Sequence[int] = (),
        options: GenerateOptions | None = None,
        images: Sequence[ImageInput] = (),
    ) -> RequestHandle:
        """Submit a request; its handle gives its events (subscribe) and cancels it."""
        ...

    # ------------------------------------------------------------------ images
    def image_block(self) -> ImageBlock | None:
        """The image block of a vision model that takes images here; None where images are not
        accepted (a text-only model)."""
        ...

    # ------------------------------------------------------------------ whole-model calls
    def model_call(self, name: str, *args: Any) -> Future[Any]:
        """Run the function `name` ("tokenwire.<module>:<function>", see `model_function`) as
        function(engine, *args) on a model thread; a Future of its result."""
        ...

    # ------------------------------------------------------------------ AICI
    def remote_aici(self, runtime_args: list[str], busy_wait_ms: float | None) -> RemoteAiciRuns | None:
        """Where AICI runs go when they cannot run in this process (--replicas: whole to a
        replica, scale/aici.py); None when `serve --aici` runs its own runtime beside the engine."""
        ...

    # ------------------------------------------------------------------ state
    @property
    def steps(self) -> int:
        """Engine steps run so far (all replicas)."""
        ...

    def stats(self) -> dict[str, Any]: ...

    def shutdown(self, timeout_s: float = 10.0) -> bool: ...


def model_function(name: str) -> Callable[..., Any]:
    """The function a model call names: "tokenwire.<module>:<function>" (tokenwire's code only:
    a name that crossed a process boundary must not import anything else)."""
    module, _, function = name.partition(":")
    if not (module.startswith("tokenwire.") and function.isidentifier()):
        raise AttributeError(f"model call {name!r} must name tokenwire.<module>:<function>")
    fn = getattr(importlib.import_module(module), function, None)
    if not callable(fn):
        raise AttributeError(f"no model call named {name!r}")
    return fn
