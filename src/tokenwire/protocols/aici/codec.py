"""AICI framing and message shapes (no I/O).

Frame: a 4-byte little-endian length, then that many bytes of UTF-8 JSON, at offset 0 of the
channel's shared memory. Replies are ``{"type": "ok", "data": ...}`` or
``{"type": "error", "data": null, "error": "..."}``; side-channel replies echo ``$rid``.
"""

from __future__ import annotations

import json
import struct
from typing import Any

import orjson

FRAME_HEADER = 4
_LEN = struct.Struct("<I")

__all__ = [
    "FRAME_HEADER",
    "FrameError",
    "ProtocolError",
    "decode_message",
    "encode_message",
    "error_reply",
    "fit_reply",
    "frame_length",
    "ok_reply",
    "seq_entry",
    "write_frame",
]


class FrameError(ValueError):
    """A frame that does not fit or whose length is impossible."""


class ProtocolError(ValueError):
    """A request the runtime cannot serve (bad JSON, unknown op, bad field...)."""


def write_frame(buf: Any, payload: bytes) -> None:
    buf[0:FRAME_HEADER] = _LEN.pack(len(payload))
    buf[FRAME_HEADER : FRAME_HEADER + len(payload)] = payload


def frame_length(buf: Any, size: int) -> int:
    (n,) = _LEN.unpack(buf[0:FRAME_HEADER])
    if n > size - FRAME_HEADER:
        raise FrameError(f"frame length {n} exceeds the channel size {size}")
    return n


def encode_message(obj: dict[str, Any]) -> bytes:
    # orjson: a step's messages carry an entry per sequence, and the stdlib encoder and
    # decoder were a quarter of the runtime's time per step at 40 sequences (measured)
    try:
        return orjson.dumps(obj)
    except TypeError:  # what orjson refuses (integers past 64 bits, non-string keys)
        return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


def decode_message(payload: bytes) -> dict[str, Any]:
    try:
        obj = orjson.loads(payload)
    except orjson.JSONDecodeError as e:  # also invalid UTF-8
        raise ProtocolError(f"malformed JSON: {e}") from e
    if not isinstance(obj, dict):
        raise ProtocolError(f"a message must be a JSON object, got {type(obj).__name__}")
    return obj


def ok_reply(data: Any, rid: str | None = None) -> dict[str, Any]:
    reply: dict[str, Any] = {"type": "ok", "data": data}
    if rid is not None:
        reply["$rid"] = rid
    return reply


def error_reply(message: str, rid: str | None = None) -> dict[str, Any]:
    reply: dict[str, Any] = {"type": "error", "data": None, "error": message}
    if rid is not None:
        reply["$rid"] = rid
    return reply


def seq_entry(
    result: Any, *, error: str = "", storage: list[Any] | None = None, logs: str = "", micros: int = 0
) -> dict[str, Any]:
    """One sequence's entry in post_seqs / pre_seqs / seqs."""
    return {"error": error, "result": result, "storage": storage or [], "logs": logs, "micros": micros}


# ---- field checks (requests come from another process: trust nothing) ----------------------------


def field(msg: dict[str, Any], name: str, kind: type | tuple[type, ...], *, default: Any = ...) -> Any:
    if name not in msg or msg[name] is None:
        if default is ...:
            raise ProtocolError(f"missing field {name!r}")
        return default
    value = msg[name]
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
        raise ProtocolError(f"field {name!r} has the wrong type ({type(value).__name__})")
    return value


def int_field(msg: dict[str, Any], name: str, *, default: Any = ..., minimum: int = 0) -> int:
    value = msg.get(name)
    if type(value) is int and value >= minimum:  # the common case first: runs per sequence per step
        return value
    value = field(msg, name, int, default=default)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ProtocolError(f"field {name!r} must be an integer >= {minimum}, got {value!r}")
    return value


def int_list(msg: dict[str, Any], name: str, *, default: Any = ...) -> list[int]:
    value = msg.get(name)
    if type(value) is list and all(type(v) is int and v >= 0 for v in value):  # the common case
        return value
    value = field(msg, name, list, default=default)
    for v in value:
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ProtocolError(f"field {name!r} must be a list of non-negative integers, got {v!r}")
    return value


def obj_list(msg: dict[str, Any], name: str) -> list[dict[str, Any]]:
    value = field(msg, name, list, default=[])
    for v in value:
        if not isinstance(v, dict):
            raise ProtocolError(f"entries of {name!r} must be objects, got {v!r}")
    return value


_DROPPED = "[logs and storage dropped: the reply did not fit the AICI channel]\n"


def fit_reply(reply: dict[str, Any], capacity: int) -> bytes:
    """`reply` encoded in at most `capacity` bytes. A reply over it (logs of many sequences at
    their cap, a 32 MiB channel: the runtime died sending one) loses the logs and storage of
    its largest sequence entries first, each such sequence failing with an error saying so; if
    even that is not enough, the whole reply becomes an error reply. Never raises."""
    payload = encode_message(reply)
    if len(payload) <= capacity:
        return payload
    data = reply.get("data")
    entries: list[dict[str, Any]] = []
    if isinstance(data, dict):
        for key in ("post_seqs", "pre_seqs", "seqs"):
            group = data.get(key)
            if isinstance(group, dict):
                entries += [e for e in group.values() if isinstance(e, dict)]
        if "logs" in data and "error" in data:  # instantiate: the data is one entry
            entries.append(data)
    entries.sort(key=lambda e: len(e.get("logs") or "") + len(str(e.get("storage") or "")), reverse=True)
    for entry in entries:
        entry["logs"], entry["storage"] = _DROPPED, []
        entry["error"] = entry.get("error") or f"the reply did not fit the AICI channel ({capacity} bytes)"
        if entry is data:
            data["result"] = None
        payload = encode_message(reply)
        if len(payload) <= capacity:
            return payload
    small = error_reply(f"a reply of {len(payload)} bytes does not fit the AICI channel ({capacity} bytes)")
    if "$rid" in reply:
        small["$rid"] = reply["$rid"]
    return encode_message(small)
