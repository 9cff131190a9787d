"""Random inputs for the fuzzers: JSON values, protobuf messages of any schema, byte mutations.

Every generator takes a `random.Random`, so a run is reproducible from its seed (the fuzz
bench's --seed, the tests' derandomized hypothesis, which draws the Random). Values favour the
ones that break decoders: boundary integers, NaN/inf, 5,000-digit numbers, lone UTF-16
surrogates, NUL, deep nesting, and byte-level damage to valid encodings (truncation, bit
flips, 32-bit words overwritten with huge or negative offsets, inserted garbage).
"""

from __future__ import annotations

import json
import random
import struct
from typing import Any

from google.protobuf import descriptor as pbd
from google.protobuf.message import Message

STRINGS = [
    "", "a", "Hello", "\ud800", "x\udfffy", "\x00", "é", "𝄞", "<|im_end|>", " " * 64, "{}", "null",
    "9" * 5000, "\\u0000", "\u202e", "[" * 100, "a" * 70_000,
]  # fmt: skip
INTS = [
    0,
    1,
    -1,
    2,
    3,
    7,
    255,
    256,
    -256,
    2**15,
    2**31 - 1,
    -(2**31),
    2**32,
    2**53 + 1,
    2**63,
    -(2**63),
    10**400,
]
FLOATS = [0.0, -0.0, 0.5, 1.0, -1.0, 1e-320, 1e308, -1e308, float("nan"), float("inf"), float("-inf"), 2.0]
KEYS = [
    "stream_id", "model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "logit_bias",
    "top_logprobs", "scored", "extensions", "name", "base", "buffer", "save_as", "resume_from", "stop",
    "stop_token_ids", "ignore_eos", "priority", "data", "op", "id", "tokens", "messages", "role", "content",
]  # fmt: skip


def rand_int(rng: random.Random, lo: int | None = None, hi: int | None = None) -> int:
    v = rng.choice(INTS) if rng.random() < 0.5 else rng.randint(-50, 50000)
    if lo is not None and hi is not None:
        v = v if lo <= v <= hi else rng.choice([lo, hi, rng.randint(lo, min(hi, lo + 70000))])
    return v


def rand_str(rng: random.Random) -> str:
    r = rng.random()
    if r < 0.4:
        return rng.choice(STRINGS)
    if r < 0.7:
        return "".join(chr(rng.randint(32, 126)) for _ in range(rng.randint(0, 40)))
    return "".join(chr(rng.randint(0, 0x10FFFF)) for _ in range(rng.randint(0, 12)))


def rand_utf8(rng: random.Random) -> str:
    """rand_str that a client library can encode (no lone surrogates)."""
    return rand_str(rng).encode("utf-8", "replace").decode("utf-8")


def rand_json(rng: random.Random, depth: int = 0) -> Any:
    r = rng.random()
    if depth >= 4 or r < 0.45:
        kind = rng.randrange(6)
        if kind == 0:
            return rng.choice([None, True, False])
        if kind == 1:
            return rand_int(rng)
        if kind == 2:
            return rng.choice(FLOATS)
        if kind == 3:
            return [rng.randint(0, 60000) for _ in range(rng.randint(0, 8))]  # token ids
        return rand_str(rng)
    if r < 0.7:
        return [rand_json(rng, depth + 1) for _ in range(rng.randint(0, 5))]
    return {
        (rng.choice(KEYS) if rng.random() < 0.7 else rand_str(rng)): rand_json(rng, depth + 1)
        for _ in range(rng.randint(0, 6))
    }


def dumps(obj: Any) -> str:
    """JSON text the way a client library writes it (surrogates escaped, NaN as NaN)."""
    return json.dumps(obj)


def deep_json(rng: random.Random) -> str:
    """Arrays or objects nested 1k..100k deep: a recursion bomb for naive decoders."""
    depth = rng.choice([1000, 5000, 100_000])
    if rng.random() < 0.5:
        return "[" * depth + "1" + "]" * depth
    return '{"a":' * depth + "1" + "}" * depth


def mutate_bytes(rng: random.Random, data: bytes) -> bytes:
    """Damage a valid encoding in one to three ways."""
    buf = bytearray(data)
    for _ in range(rng.randint(1, 3)):
        if not buf:
            buf = bytearray(rng.randbytes(rng.randint(1, 64)))
            continue
        kind = rng.randrange(6)
        i = rng.randrange(len(buf))
        if kind == 0:
            del buf[rng.randrange(len(buf) + 1) :]  # truncated
        elif kind == 1:
            buf[i] ^= 1 << rng.randrange(8)  # a bit flip
        elif kind == 2 and len(buf) >= 4:  # a 32-bit field (an offset, a length) made absurd
            j = rng.randrange(len(buf) - 3)
            buf[j : j + 4] = struct.pack(
                "<I", rng.choice([0, 1, 0x7FFFFFFF, 0xFFFFFFFF, 0x80000000, len(buf) + 4])
            )
        elif kind == 3:
            buf[i:i] = rng.randbytes(rng.randint(1, 16))  # inserted garbage
        elif kind == 4:
            buf[i] = rng.randrange(256)
        else:
            buf += buf[rng.randrange(len(buf)) :]  # duplicated tail
    return bytes(buf)


def mutate_text(rng: random.Random, text: str) -> str:
    kind = rng.randrange(4)
    i = rng.randrange(len(text) + 1)
    if kind == 0:
        return text[:i]
    if kind == 1:
        return text[:i] + rand_str(rng) + text[i:]
    if kind == 2:
        return text[:i] + rng.choice(['"', "}", "]", ",", ":", "\\", " ", "\n", "\ud800"]) + text[i:]
    return text.replace(" ", "", 1)


# ---------------------------------------------------------------- protobuf messages of any schema

_INT_RANGES = {
    pbd.FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1),
    pbd.FieldDescriptor.TYPE_SINT32: (-(2**31), 2**31 - 1),
    pbd.FieldDescriptor.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    pbd.FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1),
    pbd.FieldDescriptor.TYPE_FIXED32: (0, 2**32 - 1),
    pbd.FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1),
    pbd.FieldDescriptor.TYPE_SINT64: (-(2**63), 2**63 - 1),
    pbd.FieldDescriptor.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    pbd.FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1),
    pbd.FieldDescriptor.TYPE_FIXED64: (0, 2**64 - 1),
}


def _scalar(rng: random.Random, field: pbd.FieldDescriptor) -> Any:
    t = field.type
    if t in _INT_RANGES:
        return rand_int(rng, *_INT_RANGES[t])
    if t in (pbd.FieldDescriptor.TYPE_FLOAT, pbd.FieldDescriptor.TYPE_DOUBLE):
        v = rng.choice(FLOATS) if rng.random() < 0.6 else rng.uniform(-5, 5)
        return max(min(v, 3e38), -3e38) if t == pbd.FieldDescriptor.TYPE_FLOAT and v == v else v
    if t == pbd.FieldDescriptor.TYPE_BOOL:
        return rng.random() < 0.5
    if t == pbd.FieldDescriptor.TYPE_ENUM:
        numbers = [v.number for v in field.enum_type.values]
        return rng.choice(numbers) if rng.random() < 0.9 or field.enum_type.is_closed else rng.randint(-3, 99)
    if t == pbd.FieldDescriptor.TYPE_STRING:
        s = rand_str(rng)
        return s.encode("utf-8", "replace").decode("utf-8")  # protobuf strings are valid UTF-8
    if t == pbd.FieldDescriptor.TYPE_BYTES:
        return rng.randbytes(rng.choice([0, 1, 7, 64, 1000]))
    raise TypeError(f"unhandled protobuf field type {t}")


def fill_message(rng: random.Random, msg: Message, depth: int = 0, *, density: float = 0.5) -> Message:
    """Set a random subset of `msg`'s fields (any schema) to random values, recursively."""
    for field in msg.DESCRIPTOR.fields:
        if rng.random() > density:
            continue
        repeated = field.is_repeated
        if field.type == pbd.FieldDescriptor.TYPE_MESSAGE:
            if field.message_type.GetOptions().map_entry:
                target = getattr(msg, field.name)
                key_f, val_f = (
                    field.message_type.fields_by_name["key"],
                    field.message_type.fields_by_name["value"],
                )
                for _ in range(rng.randint(0, 3)):
                    key = _scalar(rng, key_f)
                    if val_f.type == pbd.FieldDescriptor.TYPE_MESSAGE:
                        if depth < 4:
                            fill_message(rng, target[key], depth + 1, density=density)
                    else:
                        target[key] = _scalar(rng, val_f)
            elif depth < 4:
                if repeated:
                    for _ in range(rng.randint(0, 3)):
                        fill_message(rng, getattr(msg, field.name).add(), depth + 1, density=density)
                else:
                    fill_message(rng, getattr(msg, field.name), depth + 1, density=density)
        elif repeated:
            getattr(msg, field.name).extend(_scalar(rng, field) for _ in range(rng.choice([0, 1, 2, 5, 40])))
        else:
            setattr(msg, field.name, _scalar(rng, field))
    return msg
