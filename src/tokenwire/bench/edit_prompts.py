"""The speculation benchmarks' workload: a request to copy a Python file with one name changed,
so most of the answer is in the prompt (bench/spec_bench.py, bench/lock_hold_bench.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenwire.engine.engine import Engine

NAMES = ["width", "height", "depth", "scale", "offset", "margin", "radius", "weight"]


def source_file(functions: int = 16) -> str:
    parts = []
    for i in range(functions):
        a, b = NAMES[i % len(NAMES)], NAMES[(i + 3) % len(NAMES)]
        parts.append(
            f"def measure_{i}({a}, {b}):\n"
            f'    """Measure {i}: combine {a} and {b} for part number {i * 7 % 31}."""\n'
            f"    total = {a} * {b} + {i}\n"
            f"    return total / {i + 2}\n"
        )
    return "\n\n".join(parts)


def edit_prompt(engine: Engine, variant: int = 0, functions: int = 16) -> list[int]:
    old = NAMES[variant % len(NAMES)]
    ask = f"Rewrite this Python file exactly as it is, but rename `{old}` to `{old}_{variant}`:\n\n"
    return engine.tokenizer.apply_chat_template([{"role": "user", "content": ask + source_file(functions)}])
