"""What the fuzzers feed: every decoder that reads bytes from the network, driven through the
protocols' sans-IO cores (no sockets, so ~10^5 cases run in minutes).

A Target makes a random input (`make(rng)`) and runs it (`run(input)`): it returns "ok" (a
valid answer) or "refused" (the protocol's own error: an LMTP error record, a GraphPipe
CodecError/GraphPipeError, an AICI error reply, a SalienceStatus, an Evergreen SessionAbort,
an OpenAI 4xx). Any other exception escaping is a failure: the server would have answered with
a crash, a bare INTERNAL/UNKNOWN or a dropped connection instead. Each run also checks what
goes back on the wire can be encoded (an LMTP frame must be valid UTF-8 JSON: a lone surrogate
echoed into an error once closed the WebSocket instead).
"""

from __future__ import annotations

import json
import random
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from google.protobuf import any_pb2
from google.protobuf.message import DecodeError
from pydantic import ValidationError

from tokenwire.bench import fuzz_inputs as fz
from tokenwire.engine.errors import EngineError
from tokenwire.protocols.aici.codec import (
    FRAME_HEADER,
    FrameError,
    ProtocolError,
    decode_message,
    encode_message,
    frame_length,
)
from tokenwire.protocols.aici.registry import ModuleRegistry
from tokenwire.protocols.aici.runtime import AiciRuntime
from tokenwire.protocols.aici.tokenizer_env import env_for
from tokenwire.protocols.evergreen.actions import SCHEMAS
from tokenwire.protocols.evergreen.core import SessionCore
from tokenwire.protocols.evergreen.errors import SessionAbort
from tokenwire.protocols.evergreen.gen import evergreen_service_pb2 as spb
from tokenwire.protocols.evergreen.gen import tokenwire_evergreen_pb2 as twpb
from tokenwire.protocols.graphpipe.client import build_request
from tokenwire.protocols.graphpipe.codec import (
    CodecError,
    InferRequest,
    decode_request,
    encode_metadata_request,
)
from tokenwire.protocols.graphpipe.core import resolve_call
from tokenwire.protocols.graphpipe.errors import GraphPipeError
from tokenwire.protocols.graphpipe.models.lm_model import LanguageModel
from tokenwire.protocols.lmtp.core import LmtpConnection
from tokenwire.protocols.openai import core
from tokenwire.protocols.openai.errors import OpenAIError
from tokenwire.protocols.openai.schemas import ChatCompletionRequest, CompletionRequest
from tokenwire.protocols.openai.transport import limits_of
from tokenwire.protocols.salience.core import plan_generate
from tokenwire.protocols.salience.gen import salience_pb2 as pb
from tokenwire.protocols.salience.service import model_limits
from tokenwire.protocols.salience.status import SalienceStatus

if TYPE_CHECKING:
    from tokenwire.engine.engine import Engine


@dataclass
class Target:
    name: str
    make: Callable[[random.Random], Any]
    run: Callable[[Any], str]
    budget_s: float | None = None  # seconds one case may take before it counts as a failure


class FuzzFailure(AssertionError):
    """An input answered in no protocol form (what escaped is the __cause__)."""


# ---------------------------------------------------------------- LMTP (text frames)

_LMTP_KINDS = ["GENERATE", "SCORE", "MODEL_INFO", "HELLO", "CANCEL", "BUFFER", "DROP", "TOKENIZE", "NOPE"]


def _lmtp_frame(rng: random.Random, model: str) -> str:
    r = rng.random()
    if r < 0.05:
        return fz.deep_json(rng) if rng.random() < 0.5 else "GENERATE " + fz.deep_json(rng)
    if r < 0.1:
        return fz.rand_str(rng)
    kind = rng.choice(_LMTP_KINDS)
    payload: dict[str, Any] = {"stream_id": rng.choice([1, 2, "s", None, -1, 2**70, 1.5])}
    if rng.random() < 0.8:
        payload["model"] = model if rng.random() < 0.8 else fz.rand_str(rng)
    for key in rng.sample(fz.KEYS, rng.randint(0, 6)):
        payload[key] = fz.rand_json(rng)
    if kind in ("GENERATE", "SCORE") and rng.random() < 0.7:
        payload["prompt"] = rng.choice([[1, 2, 3], "Hello", fz.rand_str(rng), [rng.randint(-5, 70000)]])
        payload["max_tokens"] = rng.choice([0, 1, 2, -1, 10**6, 2**63, "3", None])
    text = f"{kind} {fz.dumps(payload)}"
    return fz.mutate_text(rng, text) if rng.random() < 0.3 else text


def lmtp_target(engine: Engine) -> Target:
    def make(rng: random.Random) -> tuple[list[str], str]:
        extensions = rng.sample(["text", "buffers", "system", "retry"], rng.randint(0, 4))
        hello = (
            [f'HELLO {{"stream_id": 0, "extensions": {json.dumps(extensions)}}}']
            if rng.random() < 0.5
            else []
        )
        return hello, _lmtp_frame(rng, engine.name)

    def run(case: tuple[list[str], str]) -> str:
        hello, frame = case
        conn = LmtpConnection(engine, lambda handle, stream: None)
        try:
            for text in [*hello, frame]:
                conn.feed(text)
            records = []
            for out in conn.take_frames():
                out.encode("utf-8")  # strict, as the WebSocket sends it
                _kind, _, body = out.partition(" ")
                decoded = json.loads(body)
                records += decoded if isinstance(decoded, list) else [decoded]
            errors = [r for r in records if isinstance(r, dict) and r.get("error")]
            return "refused" if errors else "ok"
        finally:
            conn.close()  # cancels what a valid GENERATE started

    return Target("lmtp", make, run)


# ---------------------------------------------------------------- GraphPipe (flatbuffers)

_DTYPES = [np.int64, np.int32, np.float32, np.float64, np.uint8, np.int8, np.int16, np.uint64, np.float16]


def _graphpipe_request(rng: random.Random) -> bytes:
    if rng.random() < 0.1:
        return bytes(encode_metadata_request())
    arrays = []
    for _ in range(rng.choice([0, 1, 1, 1, 2, 3])):
        shape = tuple(rng.choice([0, 1, 1, 2, 3, 5]) for _ in range(rng.choice([0, 1, 2, 2, 3])))
        if rng.random() < 0.1:
            arrays.append(
                np.array(
                    [fz.rand_utf8(rng).encode("utf-8", "replace")] * max(1, int(np.prod(shape))), dtype=object
                )
            )
        else:
            arrays.append((np.arange(int(np.prod(shape))) % 300).astype(rng.choice(_DTYPES)).reshape(shape))
    names = (
        [rng.choice(["input_ids", "x", "", fz.rand_utf8(rng)]) for _ in arrays]
        if rng.random() < 0.5
        else None
    )
    outputs = (
        [rng.choice(["logits", "next_token_logprobs", "hidden", fz.rand_utf8(rng)])]
        if rng.random() < 0.5
        else None
    )
    config = rng.choice([None, "", '{"layer": 1}', '{"layer": 99}', "[1]", fz.dumps(fz.rand_json(rng))])
    return bytes(build_request(arrays, names, outputs, config))


def graphpipe_target(engine: Engine) -> Target:
    model = LanguageModel(engine)

    def make(rng: random.Random) -> bytes:
        body = _graphpipe_request(rng)
        return fz.mutate_bytes(rng, body) if rng.random() < 0.7 else body

    def run(body: bytes) -> str:
        try:
            req = decode_request(body)
            if isinstance(req, InferRequest):
                resolve_call(model, req)
        except (CodecError, GraphPipeError):
            return "refused"
        return "ok"

    return Target("graphpipe", make, run)


# ---------------------------------------------------------------- AICI (shared-memory JSON and frames)

REGION = 256  # bytes of the fuzzed channel region (the real ones are MiBs: the header is the same)
_MAIN_OPS = ["ping", "tokens", "post_pre_process", "mid_process", "nope"]
_SIDE_OPS = ["get_tags", "set_tags", "instantiate", "mk_module", "nope"]


def _aici_message(rng: random.Random) -> tuple[str, bytes]:
    channel = rng.choice(["main", "side", "frame"])
    if channel == "frame":  # the 4-byte length header a reader trusts, then what follows
        header = rng.choice([rng.randbytes(4), (rng.randint(0, 300)).to_bytes(4, "little")])
        return channel, header + rng.choice([b'{"op": "ping"}', rng.randbytes(rng.randint(0, 40))])
    msg: dict[str, Any] = {"op": rng.choice(_MAIN_OPS if channel == "main" else _SIDE_OPS)}
    if channel == "side" and rng.random() < 0.9:
        msg["$rid"] = rng.choice(["1", fz.rand_str(rng), 7])
    seq = lambda: {  # noqa: E731
        "id": rng.choice([0, 1, 2, -1, 2**40, "1"]),
        "req_id": rng.choice(["r1", "r2", fz.rand_str(rng)]),
        "tokens": rng.choice([[1, 2], [], [-1], [10**9], "x"]),
        "backtrack": rng.choice([0, 1, 5, -3, 10**6]),
        "clone_id": rng.choice([0, 1, 3]),
    }
    for key in rng.sample(["post_ops", "pre_ops", "ops", "freed"], rng.randint(0, 4)):
        msg[key] = rng.choice(
            [[seq() for _ in range(rng.randint(0, 3))], [rng.randint(-2, 5)], fz.rand_json(rng)]
        )
    if msg["op"] == "instantiate" or rng.random() < 0.2:
        msg.update(
            req_id=rng.choice(["r1", "r2"]),
            module_id=rng.choice(["regex", "jsctrl", "declarative", "llguidance", fz.rand_str(rng)]),
        )
        msg["module_arg"] = rng.choice(
            ["ab", "[a-z]+", "(unclosed", "", fz.dumps(fz.rand_json(rng)), fz.rand_str(rng)]
        )
        msg["prompt"] = rng.choice([[1, 2, 3], [], [-4], "text"])
    if msg["op"] in ("set_tags", "mk_module"):
        msg.update(
            module_id=fz.rand_json(rng), tags=fz.rand_json(rng), binary=rng.choice(["AGFzbQEAAAA=", "!!", ""])
        )
    for key in rng.sample(fz.KEYS, rng.randint(0, 2)):
        msg[key] = fz.rand_json(rng)
    raw = fz.dumps(msg).encode("utf-8", "surrogatepass")
    return channel, fz.mutate_bytes(rng, raw) if rng.random() < 0.2 else raw


def aici_target(engine: Engine) -> Target:
    env = env_for(engine.tokenizer, engine.vocab_size)
    store = tempfile.TemporaryDirectory(prefix="tokenwire-fuzz-aici-")
    state: dict[str, Any] = {"n": 0}
    bias = np.zeros((8, engine.vocab_size), dtype=np.float32)

    def runtime() -> AiciRuntime:
        state["n"] += 1
        if state["n"] % 200 == 1:  # a fresh runtime now and then: sequences do not pile up
            state["rt"] = AiciRuntime(env, ModuleRegistry(store.name))
        return state["rt"]

    def run(case: tuple[str, bytes]) -> str:
        channel, raw = case
        try:
            if channel == "frame":  # raw bytes as a channel region holds them: header, payload
                region = raw[:REGION].ljust(REGION, b"\0")
                n = frame_length(region, REGION)
                raw = region[FRAME_HEADER : FRAME_HEADER + n]
            msg = decode_message(raw)
        except (FrameError, ProtocolError):
            return "refused"
        rt = runtime()
        reply = rt.handle_main(msg, bias.reshape(-1)) if channel == "main" else rt.handle_side(msg)
        encode_message(reply)  # the reply must go back through the channel
        assert reply.get("type") in ("ok", "error"), reply
        return "ok" if reply["type"] == "ok" else "refused"

    target = Target("aici", _aici_message, run)
    target._store = store  # type: ignore[attr-defined]  # lives as long as the target
    return target


# ---------------------------------------------------------------- Salience (protobuf)


def salience_target(engine: Engine) -> Target:
    limits = model_limits(engine)

    def make(rng: random.Random) -> tuple[bytes, list[int]]:
        msg = fz.fill_message(rng, pb.GenerateRequest(), density=rng.choice([0.3, 0.6, 0.9]))
        raw = msg.SerializeToString()
        raw = fz.mutate_bytes(rng, raw) if rng.random() < 0.3 else raw
        return raw, [rng.randint(0, engine.vocab_size - 1) for _ in range(rng.choice([0, 1, 5, 40]))]

    def run(case: tuple[bytes, list[int]]) -> str:
        raw, tokens = case
        try:
            req = pb.GenerateRequest.FromString(raw)
            plan_generate(req, tokens, [], limits)
        except (DecodeError, SalienceStatus, EngineError):
            return "refused"
        return "ok"

    return Target("salience", make, run)


# ---------------------------------------------------------------- Evergreen (protobuf node DAGs)


def _evergreen_messages(rng: random.Random) -> list[Any]:
    pool = [f"n{i}" for i in range(rng.choice([3, 10, 60]))]
    messages = []
    for _ in range(rng.randint(1, 3)):
        if rng.random() < 0.15:  # any message the schema allows
            messages.append(fz.fill_message(rng, spb.SessionMessage(), density=0.7))
            continue
        msg = spb.SessionMessage()
        shape = rng.random()
        for i in range(rng.randint(0, len(pool))):
            frag = msg.node_fragments.add(id=pool[i] if rng.random() < 0.9 else fz.rand_utf8(rng))
            frag.seq, frag.continued = rng.choice([0, 0, 1, 5, -1]), rng.random() < 0.1
            if shape < 0.3:  # a chain, often deeper than the limit; sometimes closing a cycle
                frag.child_ids.append(pool[(i + 1) % len(pool)] if rng.random() < 0.95 else pool[i])
            elif rng.random() < 0.5:  # a DAG with shared children, self-loops and dangling ids
                frag.child_ids.extend(rng.choice([*pool, "missing"]) for _ in range(rng.randint(1, 4)))
            else:
                chunk = frag.chunk_fragment
                chunk.metadata.mimetype = rng.choice(
                    ["text/plain", "application/json", "image/png", "", fz.rand_utf8(rng)]
                )
                if rng.random() < 0.8:
                    chunk.data = rng.choice(
                        [
                            b"Hello",
                            b"",
                            b"\xff\xfe",
                            fz.deep_json(rng).encode(),
                            rng.randbytes(32),
                            b"[1, 2, 3]",
                        ]
                    )
                else:
                    chunk.ref = rng.choice(["file:///etc/passwd", "http://x", "", fz.rand_utf8(rng)])
        for _ in range(rng.randint(0, 3)):
            name = rng.choice([*SCHEMAS, "", "NOPE"])
            action = msg.actions.add(name=name)
            for param in ("inputs", "outputs"):
                for _ in range(rng.randint(0, 2)):
                    getattr(action, param).add(
                        name=rng.choice(
                            [
                                "",
                                "prompt",
                                "continuation",
                                "action",
                                "response",
                                "text",
                                "tokens",
                                "count",
                                "score",
                            ]
                        ),
                        id=rng.choice([*pool, f"out{rng.randint(0, 3)}", ""]),
                    )
            for _ in range(rng.randint(0, 2)):
                config = rng.choice(
                    [twpb.GenerateConfig, twpb.ConstraintConfig, twpb.TtlConfig, twpb.SessionOptions]
                )()
                packed = any_pb2.Any()
                packed.Pack(fz.fill_message(rng, config, density=0.6))
                if rng.random() < 0.1:
                    packed.value = rng.randbytes(8)
                action.configs.append(packed)
            if rng.random() < 0.3:
                action.target_spec.id = rng.choice(["", engine_name_placeholder, fz.rand_utf8(rng)])
        messages.append(msg)
    return messages


engine_name_placeholder = "SmolLM2-135M-Instruct"


def evergreen_target(engine: Engine) -> Target:
    def make(rng: random.Random) -> list[bytes]:
        raw = [m.SerializeToString() for m in _evergreen_messages(rng)]
        return [fz.mutate_bytes(rng, r) if rng.random() < 0.1 else r for r in raw]

    def run(raws: list[bytes]) -> str:
        core = SessionCore({engine.name})
        try:
            for raw in raws:
                effects = core.receive(spb.SessionMessage.FromString(raw))
                for action in effects.start:  # what the executor reads first: the flattened input
                    if action.spec.inputs:
                        for name in action.spec.inputs:
                            core.input(action, name)
        except (DecodeError, SessionAbort):
            return "refused"
        return "ok"

    return Target("evergreen", make, run)


# ---------------------------------------------------------------- OpenAI HTTP bodies


def openai_target(engine: Engine) -> Target:
    limits = limits_of(engine)

    def make(rng: random.Random) -> tuple[str, bytes]:
        chat = rng.random() < 0.5
        body: dict[str, Any] = {"model": engine.name if rng.random() < 0.9 else fz.rand_str(rng)}
        if chat:
            body["messages"] = rng.choice([
                [{"role": "user", "content": "Hi"}],
                [{"role": rng.choice(["user", "system", "assistant", "tool"]), "content": fz.rand_json(rng)}],
                fz.rand_json(rng),
            ])  # fmt: skip
        else:
            body["prompt"] = rng.choice(["Hi", [1, 2, 3], [[1, 2], [3]], fz.rand_json(rng), fz.rand_str(rng)])
        fields = [
            "max_tokens", "temperature", "top_p", "n", "logprobs", "top_logprobs", "stop", "seed",
            "logit_bias", "response_format", "tools", "tool_choice", "echo", "stream", "presence_penalty",
        ]  # fmt: skip
        for key in rng.sample(fields, rng.randint(0, 5)):
            body[key] = fz.rand_json(rng)
        text = fz.dumps(body)
        if rng.random() < 0.1:
            text = fz.deep_json(rng)
        elif rng.random() < 0.2:
            text = fz.mutate_text(rng, text)
        return ("chat" if chat else "completion"), text.encode("utf-8", "surrogatepass")

    def run(case: tuple[str, bytes]) -> str:
        kind, raw = case
        try:  # as FastAPI reads a body: json.loads (any failure there is its 400), then the model
            obj = json.loads(raw)
        except Exception:
            return "refused"
        try:
            if kind == "chat":
                core.plan_chat(ChatCompletionRequest.model_validate(obj), limits, None)
            else:
                core.plan_completion(CompletionRequest.model_validate(obj), limits, None)
        except (ValidationError, OpenAIError, EngineError):
            return "refused"
        return "ok"

    return Target("openai", make, run)


def all_targets(engine: Engine) -> list[Target]:
    return [
        lmtp_target(engine), graphpipe_target(engine), aici_target(engine), salience_target(engine),
        evergreen_target(engine), openai_target(engine),
    ]  # fmt: skip
