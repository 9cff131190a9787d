"""LMTP frames: one line of text, `TYPE JSON`, split at the first space.

Client frames carry one JSON object; server frames (TOKEN, MSG) carry a JSON list of records.
Output is compact JSON (no spaces); input is any JSON the standard library parses.
"""

from __future__ import annotations

import json
import math
from typing import Any

StreamId = int | str
EXTENSIONS = ("text", "buffers", "system", "retry")  # the opt-in extensions, in HELLO's order

# Records per output frame: keeps frames well under aiohttp's default 4 MiB message limit.
MAX_RECORDS_PER_FRAME = 2048

_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=True).encode


class FrameError(ValueError):
    """A client frame that cannot be split into a message type and a JSON object."""


def decode_frame(text: str) -> tuple[str, Any]:
    """Split a frame into (TYPE, parsed JSON). The JSON may be any value; callers check its shape."""
    kind, sep, body = text.strip().partition(" ")
    if not kind:
        raise FrameError("empty frame: expected 'TYPE JSON'")
    if not sep or not body.strip():
        raise FrameError(f"frame {kind[:40]!r} has no JSON payload: expected 'TYPE JSON'")
    if not kind.isascii() or not kind.replace("_", "").isalnum():
        raise FrameError(f"malformed message type {kind[:40]!r}")
    try:
        payload = json.loads(body, parse_constant=_reject_constant)
    except ValueError as exc:
        raise FrameError(f"{kind} payload is not valid JSON: {exc}") from None
    except RecursionError:  # found by the fuzzer: arrays nested 5k+ deep
        raise FrameError(f"{kind} payload is nested too deeply") from None
    if "\\u" in body or not body.isascii():
        _check_unicode(kind, payload)
    return kind, payload


def _check_unicode(kind: str, value: Any) -> None:
    """Found by the fuzzer: a lone UTF-16 surrogate (`"\\ud800"`) decodes to a str that cannot
    be sent back as UTF-8, so an error record echoing it closed the WebSocket. Refused here,
    named, before any handler sees it. (isascii is O(1): plain frames skip the walk.)"""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise FrameError(
                    f"{kind} payload holds a lone UTF-16 surrogate (not valid Unicode text)"
                ) from None
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not a number JSON allows")


def encode_frame(kind: str, payload: Any) -> str:
    return f"{kind} {_dumps(payload)}"


def encode_records(kind: str, records: list[dict[str, Any]]) -> list[str]:
    """Frames of `kind` carrying `records` in order, at most MAX_RECORDS_PER_FRAME per frame."""
    step = MAX_RECORDS_PER_FRAME
    return [f"{kind} {_dumps(records[i : i + step])}" for i in range(0, len(records), step)]


def encode_outbox(out: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """Frames for (TYPE, record) pairs in order: consecutive records of one TYPE share a frame."""
    frames: list[str] = []
    i = 0
    while i < len(out):
        kind = out[i][0]
        j = i
        while j < len(out) and out[j][0] == kind:
            j += 1
        frames.extend(encode_records(kind, [record for _, record in out[i:j]]))
        i = j
    return frames


def finite(value: float) -> float | None:
    """value, or None when it is NaN or infinite (which JSON cannot carry)."""
    return value if math.isfinite(value) else None
