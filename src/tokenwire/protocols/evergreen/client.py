"""The thick Evergreen client: build nodes from strings, bytes, files and earlier outputs, stream
large payloads as fragments, run actions, await or stream their outputs.

    async with await EvergreenSession.connect("127.0.0.1:50051") as session:
        answer = await session.generate("Who wrote Hamlet?", GenerateConfig(max_tokens=32))
        async for text in answer:
            print(text, end="")
        follow_up = await session.generate([prompt, answer, "And Macbeth?"])  # reuses turn 1

Actions are sent before their input nodes so the server can start prefilling early.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import mimetypes
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import any_pb2
from google.protobuf.message import Message

from tokenwire.protocols.evergreen.content import END_OF_TURN
from tokenwire.protocols.evergreen.core import ERROR_MIMETYPE
from tokenwire.protocols.evergreen.gen import evergreen_pb2 as pb
from tokenwire.protocols.evergreen.gen import evergreen_service_pb2 as spb
from tokenwire.protocols.evergreen.gen import evergreen_service_pb2_grpc as rpc
from tokenwire.protocols.evergreen.gen import tokenwire_evergreen_pb2 as twpb

FRAGMENT_BYTES = 64 * 1024
# actions whose effect on later fragments depends on order (DROP then a fragment of that id)
_ORDERED = {"DROP", "SET_TTL", "CANCEL"}  # payloads larger than this go out as several fragments
GenerateConfig = twpb.GenerateConfig
ConstraintConfig = twpb.ConstraintConfig


class EvergreenError(Exception):
    """The session was aborted (code and details of the gRPC status) or an action failed."""

    def __init__(self, code: str, details: str) -> None:
        super().__init__(f"{code}: {details}")
        self.code = code
        self.details = details


class Node:
    """A node of the session, usable as an action input or a child of another node."""

    def __init__(self, session: EvergreenSession, node_id: str) -> None:
        self.session = session
        self.id = node_id

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.id!r})"


class Output(Node):
    """An output node the server writes: iterate for its text as it streams, or await text()."""

    def __init__(self, session: EvergreenSession, node_id: str) -> None:
        super().__init__(session, node_id)
        self.mimetype = ""
        self.chunks: list[bytes] = []
        self.done = asyncio.Event()
        self.prompt: Node | None = None  # GENERATE: the input node
        self.error: EvergreenError | None = None
        self._updates = asyncio.Condition()

    async def _add(self, fragment: pb.NodeFragment) -> None:
        chunk = fragment.chunk_fragment
        if fragment.seq == 0 or chunk.metadata.mimetype:
            self.mimetype = chunk.metadata.mimetype or self.mimetype
        if chunk.metadata.mimetype == ERROR_MIMETYPE:
            err = twpb.ActionError.FromString(chunk.data)
            self.error = EvergreenError(err.code_name, err.message)
        else:
            self.chunks.append(bytes(chunk.data))
        if not fragment.continued:
            self.done.set()
        async with self._updates:
            self._updates.notify_all()

    async def _fail(self, error: EvergreenError) -> None:
        if not self.done.is_set():
            self.error = self.error or error
            self.done.set()
        async with self._updates:
            self._updates.notify_all()

    async def __aiter__(self) -> AsyncIterator[str]:
        sent = 0
        decoded = b""
        while True:
            async with self._updates:
                await self._updates.wait_for(lambda n=sent: len(self.chunks) > n or self.done.is_set())
            while sent < len(self.chunks):
                decoded += self.chunks[sent]
                sent += 1
            text, decoded = _split_utf8(decoded)
            if text:
                yield text
            if self.done.is_set() and sent == len(self.chunks):
                if self.error is not None:
                    raise self.error
                return

    async def data(self) -> bytes:
        await self.done.wait()
        if self.error is not None:
            raise self.error
        return b"".join(self.chunks)

    async def text(self) -> str:
        return (await self.data()).decode()

    async def json(self) -> Any:
        return json.loads(await self.data())


def _split_utf8(data: bytes) -> tuple[str, bytes]:
    """Decode what is complete; keep a trailing partial UTF-8 sequence for later."""
    for cut in range(len(data), max(len(data) - 4, -1), -1):
        try:
            return data[:cut].decode(), data[cut:]
        except UnicodeDecodeError:
            continue
    return data.decode("utf-8", "replace"), b""


Content = str | bytes | Node | Path | Sequence["Content"]


class EvergreenSession:
    """One StartSession stream."""

    def __init__(
        self, channel: grpc.aio.Channel, *, own_channel: bool = False, auth_token: str | None = None
    ) -> None:
        self.channel = channel
        self.own_channel = own_channel
        self._ids = itertools.count(1)
        self._outbox: asyncio.Queue[spb.SessionMessage | None] = asyncio.Queue()
        self.outputs: dict[str, Output] = {}
        self.error: EvergreenError | None = None
        metadata = (("authorization", f"Bearer {auth_token}"),) if auth_token else None
        self._call = rpc.EvergreenServiceStub(channel).StartSession(metadata=metadata)
        self._writer = asyncio.create_task(self._write())
        self._reader = asyncio.create_task(self._read())

    @classmethod
    async def connect(
        cls, target: str, *, auth_token: str | None = None, root_certificates: bytes | None = None
    ) -> EvergreenSession:
        """`auth_token`: the server's --auth-token; `root_certificates`: PEM to trust, for TLS."""
        channel = (
            grpc.aio.secure_channel(target, grpc.ssl_channel_credentials(root_certificates))
            if root_certificates is not None
            else grpc.aio.insecure_channel(target)
        )
        return cls(channel, own_channel=True, auth_token=auth_token)

    async def __aenter__(self) -> EvergreenSession:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ------------------------------------------------------------------ transport
    async def _write(self) -> None:
        # explicit writes, not a request iterator: when the server aborts while messages are
        # still queued, the call keeps the server's status instead of a client-side one
        # Everything queued meanwhile goes out as one message: fewer writes, and fewer writes in
        # flight when the server ends the call (grpc.aio turns a write that fails then into
        # an INTERNAL status on the client, hiding the server's).
        try:
            closing = False
            while not closing:
                message = await self._outbox.get()
                if message is None:
                    break
                held: spb.SessionMessage | None = None
                while not self._outbox.empty():
                    more = self._outbox.get_nowait()
                    if more is None:
                        closing = True
                        break
                    if more.node_fragments and any(a.name in _ORDERED for a in message.actions):
                        held = more  # the server reads a message's fragments before its actions
                        break
                    message.node_fragments.extend(more.node_fragments)
                    message.actions.extend(more.actions)
                if self._call.done():
                    return
                await self._call.write(message)
                if held is not None:
                    await self._call.write(held)
            await self._call.done_writing()
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError, grpc.aio.UsageError):
            pass  # the call is over; _read reports why

    async def _read(self) -> None:
        try:
            async for message in self._call:
                for fragment in message.node_fragments:
                    output = self.outputs.get(fragment.id)
                    if output is not None:
                        await output._add(fragment)
        except grpc.aio.AioRpcError as exc:
            self.error = EvergreenError(exc.code().name, exc.details() or "")
        except asyncio.CancelledError:
            self.error = EvergreenError("CANCELLED", "session closed")
        finally:
            error = self.error or EvergreenError("UNKNOWN", "session ended before the output was final")
            for output in self.outputs.values():
                await output._fail(error)

    def send(self, *items: pb.NodeFragment | pb.Action) -> None:
        if self.error is not None:
            raise self.error
        self._outbox.put_nowait(
            spb.SessionMessage(
                node_fragments=[i for i in items if isinstance(i, pb.NodeFragment)],
                actions=[i for i in items if isinstance(i, pb.Action)],
            )
        )

    def new_id(self, prefix: str) -> str:
        return f"{prefix}_{next(self._ids)}"

    # ------------------------------------------------------------------ nodes
    def data(self, payload: bytes, mimetype: str, *, role: str = "", file_name: str = "") -> Node:
        """A leaf with inline data, split into fragments of FRAGMENT_BYTES."""
        node = Node(self, self.new_id("node"))
        pieces = [payload[i : i + FRAGMENT_BYTES] for i in range(0, len(payload), FRAGMENT_BYTES)] or [b""]
        for seq, piece in enumerate(pieces):
            chunk = pb.Chunk(data=piece)
            if seq == 0:
                chunk.metadata.mimetype = mimetype
                chunk.metadata.role = role
                chunk.metadata.original_file_name = file_name
            self.send(
                pb.NodeFragment(id=node.id, seq=seq, continued=seq < len(pieces) - 1, chunk_fragment=chunk)
            )
        return node

    def text(self, text: str, *, role: str = "", mimetype: str = "text/plain") -> Node:
        return self.data(text.encode(), mimetype, role=role)

    def file(self, path: str | Path, mimetype: str | None = None, *, as_ref: bool = False) -> Node:
        """A file as a leaf: streamed inline in fragments, or as a file:// ref the server reads
        (it must lie under one of the server's --allow-ref-root directories)."""
        path = Path(path)
        mimetype = mimetype or mimetypes.guess_type(path.name)[0] or "application/octet-stream"
        if as_ref:
            node = Node(self, self.new_id("file"))
            chunk = pb.Chunk(ref=path.resolve().as_uri())
            chunk.metadata.mimetype = mimetype
            chunk.metadata.original_file_name = path.name
            self.send(pb.NodeFragment(id=node.id, chunk_fragment=chunk))
            return node
        node = Node(self, self.new_id("file"))
        with path.open("rb") as f:
            seq, block = 0, f.read(FRAGMENT_BYTES)
            while True:
                following = f.read(FRAGMENT_BYTES)
                chunk = pb.Chunk(data=block)
                if seq == 0:
                    chunk.metadata.mimetype = mimetype
                    chunk.metadata.original_file_name = path.name
                self.send(
                    pb.NodeFragment(id=node.id, seq=seq, continued=bool(following), chunk_fragment=chunk)
                )
                if not following:
                    return node
                seq, block = seq + 1, following

    def end_of_turn(self) -> Node:
        return self.data(b"", END_OF_TURN)

    def node(self, *children: Content) -> Node:
        """An inner node of the given content, in order."""
        node = Node(self, self.new_id("node"))
        ids = [self.as_node(c).id for c in children]
        self.send(pb.NodeFragment(id=node.id, child_ids=ids))
        return node

    def as_node(self, content: Content) -> Node:
        if isinstance(content, Node):
            return content
        if isinstance(content, str):
            return self.text(content)
        if isinstance(content, bytes):
            return self.data(content, "application/octet-stream")
        if isinstance(content, Path):
            return self.file(content)
        return self.node(*content)

    # ------------------------------------------------------------------ actions
    def action(
        self,
        name: str,
        inputs: dict[str, Node | str],
        outputs: Sequence[str],
        configs: Sequence[Message] = (),
        target: str = "",
    ) -> dict[str, Output]:
        made = {name_: Output(self, self.new_id(name_)) for name_ in outputs}
        for output in made.values():
            self.outputs[output.id] = output
        action = pb.Action(
            name=name,
            inputs=[
                pb.NamedParameter(name=k, id=v if isinstance(v, str) else v.id) for k, v in inputs.items()
            ],
            outputs=[pb.NamedParameter(name=k, id=o.id) for k, o in made.items()],
        )
        for config in configs:
            packed = any_pb2.Any()
            packed.Pack(config)
            action.configs.append(packed)
        if target:
            action.target_spec.id = target
        self.send(action)
        return made

    def generate(
        self,
        prompt: Content,
        config: GenerateConfig | None = None,
        constraint: ConstraintConfig | None = None,
        *,
        target: str = "",
    ) -> Output:
        """Start a GENERATE; returns its `response` output (stream it, or await .text()).
        The action goes out before the prompt's nodes so prefill starts as they arrive."""
        if isinstance(prompt, Node):
            root = prompt
        else:
            root = Node(self, self.new_id("prompt"))
        configs = [c for c in (config, constraint) if c is not None]
        output = self.action("GENERATE", {"prompt": root}, ["response"], configs, target)["response"]
        output.prompt = root
        if not isinstance(prompt, Node):
            parts = prompt if isinstance(prompt, list | tuple) else [prompt]
            ids = [self.as_node(p).id for p in parts]
            self.send(pb.NodeFragment(id=root.id, child_ids=ids))
        return output

    async def score(self, prompt: Content | None, continuation: Content) -> dict[str, Any]:
        inputs = {"continuation": self.as_node(continuation)}
        if prompt is not None:
            inputs["prompt"] = self.as_node(prompt)
        return await self.action("SCORE", inputs, ["score"])["score"].json()

    async def tokenize(self, text: Content) -> list[int]:
        return await self.action("TOKENIZE", {"text": self.as_node(text)}, ["tokens"])["tokens"].json()

    async def count_tokens(self, text: Content) -> int:
        return await self.action("COUNT_TOKENS", {"text": self.as_node(text)}, ["count"])["count"].json()

    async def detokenize(self, ids: list[int]) -> str:
        node = self.data(json.dumps(ids).encode(), "application/json")
        return await self.action("DETOKENIZE", {"tokens": node}, ["text"])["text"].text()

    def drop(self, *nodes: Node) -> None:
        self.action("DROP", {f"node{i}": n for i, n in enumerate(nodes)}, [])

    def set_ttl(self, node: Node, seconds: float) -> None:
        self.action("SET_TTL", {"node": node}, [], [twpb.TtlConfig(ttl_seconds=seconds)])

    def cancel(self, output: Output) -> None:
        self.action("CANCEL", {"action": output}, [])

    def set_options(self, *, partial_failures: bool) -> None:
        self.action("SET_SESSION_OPTIONS", {}, [], [twpb.SessionOptions(partial_failures=partial_failures)])

    # ------------------------------------------------------------------ end
    async def close(self) -> None:
        """Half-close, let the server finish the running actions, then end."""
        self._outbox.put_nowait(None)
        await asyncio.gather(self._writer, self._reader, return_exceptions=True)
        if self.own_channel:
            await self.channel.close()


class Chat:
    """Multi-turn chat on one session: each turn's prompt is the previous prompt, the previous
    answer and the new user turn, so the server extends turn 1's computation."""

    def __init__(self, session: EvergreenSession, system: str | None = None, target: str = "") -> None:
        self.session = session
        self.target = target  # the model name (target_spec.id); empty: the server's
        self.history: list[Node] = []
        if system:
            self.history += [session.text(system, role="system"), session.end_of_turn()]

    def say(self, text: str, config: GenerateConfig | None = None) -> Output:
        answer = self.session.generate([*self.history, self.session_turn(text)], config, target=self.target)
        assert answer.prompt is not None
        self.history = [answer.prompt, answer]
        return answer

    def session_turn(self, text: str) -> Node:
        return self.session.node(self.session.text(text, role="user"), self.session.end_of_turn())
