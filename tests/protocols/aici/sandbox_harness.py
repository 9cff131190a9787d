"""`serve --aici` in this process for the sandbox tests: the engine with the no-model backend
(real scheduler, sessions and KV blocks; RandomTokenModel skips the forward pass), the AICI REST
server on its own event loop thread, and the real runtime child under its supervisor, as
`tokenwire serve --aici` runs it. Also the hostile controllers the tests send (JavaScript and
WAT). No timing assertions: client timeouts are hang guards only."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import wasmtime

from tokenwire.protocols.aici.client import AiciClient
from tokenwire.protocols.aici.rest import AiciServer, tokenizer_spec

T = TypeVar("T")
MIB = 2**20
NORMAL = {"controller": "regex", "controller_arg": "[a-z]+", "prompt": "Hello", "max_tokens": 4}


def rss_of(pid: int | str = "self") -> int:
    """Resident bytes of a process (VmRSS)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


@dataclass
class RunResult:
    status: int
    raw: bytes
    forks: dict[int, dict[str, Any]] = field(default_factory=dict)

    @property
    def error(self) -> str:
        if self.status != 200:
            return self.raw.decode(errors="replace")
        return "\n".join(f["error"] for f in self.forks.values() if f["error"])

    @property
    def finish(self) -> str | None:
        return self.forks[0]["finish_reason"] if 0 in self.forks else None


class Served:
    """The AICI REST server with a supervised runtime, on `engine`."""

    def __init__(self, engine: Any, store_dir: Path, runtime_args: tuple[str, ...] = ()) -> None:
        self.engine = engine
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="aici-test-loop", daemon=True)
        self.thread.start()

        def make_client() -> AiciClient:
            args = [f"--store-dir={store_dir}", "--max-pre-ms=50", *runtime_args]
            return AiciClient(tokenizer=tokenizer_spec(engine), runtime_args=args)

        client = make_client()
        self.server: AiciServer = self.call(
            AiciServer(engine, client, port=0, make_client=make_client).start()
        )

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 120) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.call(self.server.stop())
        client = self.server.client
        if client is not None:
            client.close()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    @property
    def runtime_pid(self) -> int:
        assert self.server.client is not None
        return self.server.client.proc.pid

    def runtime_rss(self) -> int:
        return rss_of(self.runtime_pid)

    def post(self, path: str, *, timeout: float = 60, **kw: Any) -> tuple[int, bytes]:
        async def go() -> tuple[int, bytes]:
            limit = aiohttp.ClientTimeout(total=timeout)
            async with aiohttp.ClientSession(timeout=limit) as s, s.post(self.server.url + path, **kw) as r:
                return r.status, await r.read()

        return asyncio.run(go())

    def upload(self, wasm: bytes) -> str:
        status, raw = self.post("/v1/controllers", data=wasm)
        assert status == 200, raw
        return str(json.loads(raw)["module_id"])

    def run(self, body: dict[str, Any], *, timeout: float = 60) -> RunResult:
        """POST /v1/run; the forks' text, logs and errors joined per index."""
        status, raw = self.post("/v1/run", json=body, timeout=timeout)
        result = RunResult(status, raw)
        if status != 200:
            return result
        chunks = [c for c in raw.decode().split("\n\n") if c]
        assert chunks and chunks[-1] == "data: [DONE]", chunks[-3:]
        for chunk in chunks[1:-1]:
            for f in json.loads(chunk[6:])["forks"]:
                acc = result.forks.setdefault(
                    f["index"], {"text": "", "logs": "", "error": "", "finish_reason": None}
                )
                for key in ("text", "logs", "error"):
                    acc[key] += f[key]
                acc["finish_reason"] = f["finish_reason"] or acc["finish_reason"]
        return result

    def js(self, program: str, *, max_tokens: int = 4, timeout: float = 60) -> RunResult:
        body = {"controller": "jsctrl-latest", "controller_arg": program, "max_tokens": max_tokens}
        return self.run({**body, "prompt": "Hi"}, timeout=timeout)

    def normal_run_works(self) -> None:
        """A plain controller runs to its end without an error (waiting out a restart)."""
        got = self.run(NORMAL)
        assert got.status == 200 and got.finish in ("aici-stop", "length") and not got.error, got


def js_main(body: str) -> str:
    """A jsctrl program whose main() runs `body` and then generates a little."""
    return f"async function main() {{\n{body}\nawait gen({{ maxTokens: 2 }})\n}}\nstart(main)\n"


# ---- Wasm controllers (tokenwire controller ABI v1), written in WAT ----------------------------

PRELUDE = """
  (import "tw" "log" (func $log (param i32 i32)))
  (import "tw" "var_set" (func $var_set (param i32 i32 i32 i32 i32)))
  (import "tw" "tokenize" (func $tokenize (param i32 i32 i32 i32) (result i32)))
  (import "tw" "set_num_forks" (func $set_forks (param i32)))
  (import "tw" "set_ff_tokens" (func $set_ff (param i32 i32)))
  (import "tw" "set_backtrack" (func $set_backtrack (param i32)))
  (import "tw" "vocab_size" (func $vocab_size (result i32)))
  (import "tw" "bias_allow" (func $allow (param i32)))
  (global $heap (export "heap") (mut i32) (i32.const 4096))
  (func (export "tw_alloc") (param $n i32) (result i32)
    (local $p i32) (local.set $p (global.get $heap))
    (global.set $heap (i32.add (global.get $heap) (local.get $n))) (local.get $p))
  (func (export "init_prompt") (param i32 i32) (result i32) (i32.const 0))
"""
PLAIN_MID = '(func (export "mid_process") (result i32) (i32.const 0))'
PLAIN_POST = '(func (export "post_process") (param i32 i32 i32) (result i32) (i32.const 0))'
PLAIN_PRE = '(func (export "pre_process") (result i32) (i32.const 0))'


def wat(body: str, *, memory_pages: int = 1, pre: str = PLAIN_PRE, mid: str = PLAIN_MID) -> bytes:
    memory = f'(memory (export "memory") {memory_pages})'
    return wasmtime.wat2wasm(f"(module {PRELUDE} {memory} {body} {pre} {mid} {PLAIN_POST})")


def pre(code: str) -> str:
    return f'(func (export "pre_process") (result i32) {code} (i32.const 0))'


def mid(code: str) -> str:
    return f'(func (export "mid_process") (result i32) {code} (i32.const 0))'


def loop_forever(code: str) -> str:
    return f"(loop $l {code} (br $l))"


# the hostile Wasm modules of the findings, by name
HOSTILE_WASM: dict[str, bytes] = {
    "fork 2^31-1": wat("", pre=pre("(call $set_forks (i32.const 0x7fffffff))")),
    "log 60 MB": wat(
        "", memory_pages=960, pre=pre(loop_forever("(call $log (i32.const 0) (i32.const 62914560))"))
    ),
    "var_set append": wat(
        '(data (i32.const 0) "v")',
        memory_pages=960,
        pre=pre(
            loop_forever(
                "(call $var_set (i32.const 0) (i32.const 1)"
                " (i32.const 16) (i32.const 60000000) (i32.const 1))"
            )
        ),
    ),
    "table.grow": wat(
        "(table $t 1 funcref)",
        pre=pre(
            "(if (i32.ne (table.grow $t (ref.null func) (i32.const 100000000)) (i32.const -1))"
            " (then (return (i32.const 7))))"
        ),
    ),
    "start loops": wat("(func $spin (loop $l (drop (call $vocab_size)) (br $l))) (start $spin)"),
    "memory.grow bomb": wat("", pre=pre(loop_forever("(drop (memory.grow (i32.const 1024)))"))),
    "infinite loop": wat("", pre=pre(loop_forever(""))),
    "deep recursion": wat("(func $r (call $r))", pre=pre("(call $r)")),
    "bad pointer": wat("", pre=pre("(call $log (i32.const -16) (i32.const 64))")),
    "bad token": wat("", mid=mid("(call $allow (i32.const -5))")),
    "ff 2^31 tokens": wat("", pre=pre("(call $set_ff (i32.const 0) (i32.const 0x7fffffff))")),
    "tokenize 60 MB": wat(
        "",
        memory_pages=960,
        pre=pre("(drop (call $tokenize (i32.const 0) (i32.const 62914560) (i32.const 0) (i32.const 0)))"),
    ),
    "backtrack 2^31-1": wat(
        "",
        mid=mid(
            "(i32.store (i32.const 0) (i32.const 42)) (call $set_ff (i32.const 0) (i32.const 1))"
            " (call $set_backtrack (i32.const 0x7fffffff))"
        ),
    ),
    "trap": wat("", pre=pre("unreachable")),
}

# hostile jsctrl programs that end in their own error (no crash, no hang)
HOSTILE_JS: dict[str, str] = {
    "infinite loop": "while (true) {}",
    "allocation bomb": "const a = []; while (true) a.push(new Array(1e5).fill(1))",
    "string bomb": 'let s = "x"; while (true) s += s',
    "deep recursion": "function f(n) { return f(n + 1) + 1 }\nf(0)",
    "thrown null": "throw null",
    "fork 1e6": "await fork(1e6)",
    "console.log flood": 'for (let i = 0; i < 1e7; i++) console.log("x".repeat(1000))',
    "tokenize 15 MB": 'tokenize("ab ".repeat(5e6))',
    "bad host call": "tokenize(12345); detokenize([1e9])",
    "setVar flood": 'for (let i = 0; i < 1e6; i++) appendVar("v", "y".repeat(1e5))',
    "huge regex": 'await gen({ regex: "a".repeat(3e6) })',
    "bad token mask": "await gen({ regex: 12 })",
}


def hostile_js_program(name: str) -> str:
    return js_main(HOSTILE_JS[name])
