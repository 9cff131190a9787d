"""`tokenwire bench aici`: AICI step overhead through shared memory, and grammar mask times.

Rows (medians, milliseconds):
- raw shm round trip (ping): the baseline every main-channel op pays twice per step;
- post_pre_process + mid_process for 1, 10 and 40 sequences of a declarative regex
  controller, engine-side: on the critical path the way AICI measures it (mid_process runs
  while a simulated accelerator forward does, post_pre_process does not), the same with
  tokenwire's engine order (both run during the forward), and serially with nothing to hide
  behind (both round trips and all the runtime's work counted);
- mask time for a regex and for a C-subset Lark grammar on the 49k-token vocabulary
  (llguidance via GrammarConstraint, in process, one mask per token of a sample text).
AICI's published numbers (AMD EPYC 7V13, 32k vocabulary) are shown beside them.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import statistics
import time
from typing import Any

from tokenwire.engine.factory import EngineSettings, build_engine
from tokenwire.engine.grammar import GrammarConstraint, lltokenizer_for
from tokenwire.engine.request import GenerateOptions, SamplingParams, stream_events
from tokenwire.model.loader import resolve_model
from tokenwire.protocols.aici.client import AiciClient
from tokenwire.protocols.aici.engine_bridge import Coordinator
from tokenwire.protocols.aici.rest import tokenizer_spec
from tokenwire.protocols.aici.run import RunRequest, run_events
from tokenwire.protocols.aici.tokenizer_env import load_tokenizer

C_GRAMMAR = r"""
start: unit
unit: (function | declaration)+
function: type IDENT "(" params? ")" block
params: param ("," param)*
param: type IDENT
declaration: type declarator ("," declarator)* ";"
declarator: IDENT ("=" expr)? | IDENT "[" NUMBER "]"
type: ("const")? base ("*")*
base: "int" | "char" | "void" | "long" | "float" | "double" | "unsigned" | "struct" IDENT
block: "{" stmt* "}"
stmt: declaration | expr ";" | "return" expr? ";" | block
    | "if" "(" expr ")" stmt ("else" stmt)?
    | "while" "(" expr ")" stmt
    | "for" "(" (declaration | expr? ";") expr? ";" expr? ")" stmt
expr: assign
assign: cond (("=" | "+=" | "-=" | "*=" | "/=") assign)?
cond: binary ("?" expr ":" cond)?
binary: unary (BINOP unary)*
unary: ("-" | "!" | "*" | "&" | "++" | "--")* postfix
postfix: primary ("(" args? ")" | "[" expr "]" | "++" | "--" | "." IDENT | "->" IDENT)*
args: expr ("," expr)*
primary: IDENT | NUMBER | STRING | CHAR | "(" expr ")"
BINOP: "+" | "-" | "*" | "/" | "%" | "<" | ">" | "<=" | ">=" | "==" | "!=" | "&&" | "||" | "&" | "|" | "^"
IDENT: /[a-zA-Z_][a-zA-Z0-9_]*/
NUMBER: /[0-9]+/
STRING: /"[^"\\\n]*"/
CHAR: /'[^'\\\n]'/
%ignore /[ \t\n]+/
"""

C_SAMPLE = """int fib(int n) {
    if (n < 2) return n;
    return fib(n - 1) + fib(n - 2);
}
int main(int argc, char **argv) {
    int total = 0;
    for (int i = 0; i < 10; i++) { total += fib(i); }
    printf("%d", total);
    return 0;
}
"""
REGEX = r"[a-z0-9._%+-]+@[a-z0-9.-]+\.[a-z]{2,4}( and [a-z0-9._%+-]+@[a-z0-9.-]+\.[a-z]{2,4})*"
REGEX_SAMPLE = "alice.smith@example.com and bob@mail.example.org and carol99@test.io"


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("aici", help="AICI: step overhead through shared memory, grammar mask times")
    p.add_argument("--steps", type=int, default=40, help="steps measured per batch size")
    p.add_argument("--seqs", default="1,10,40", help="batch sizes (comma-separated)")
    p.add_argument("--overlap-tokens", type=int, default=48, help="tokens per sequence in the overlap runs")
    p.add_argument(
        "--forward-ms",
        type=float,
        default=20.0,
        help="simulated accelerator forward per step (AICI: 20-50 ms)",
    )
    p.add_argument(
        "--busy-wait-ms",
        type=float,
        default=200.0,
        help="the runtime's spin for the next command (AICI's default)",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument(
        "--overlap-seqs",
        default="1,10,40",
        help="sequence counts of the real-engine overlap runs (comma-separated; empty or 0 = skip)",
    )
    p.set_defaults(handler=run_bench)


def _ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1000


def bench_masks() -> dict[str, Any]:
    tok = resolve_model(None).tokenizer
    llt = lltokenizer_for(tok.hf, tok.eos_token_ids)
    out = {}
    for name, make, sample in (
        ("regex", lambda: GrammarConstraint.regex(llt, tok.vocab_size, REGEX), REGEX_SAMPLE),
        ("c_grammar", lambda: GrammarConstraint.lark(llt, tok.vocab_size, C_GRAMMAR), C_SAMPLE),
    ):
        g = make()
        times = []
        for t in tok.encode(sample, add_special_tokens=False):
            t0 = time.perf_counter()
            mask = g.compute_mask()
            times.append(time.perf_counter() - t0)
            if not bool(mask[t]):
                raise RuntimeError(f"{name}: the grammar rejects the sample at token {t}")
            g.on_token(t)
        out[name] = {"median_ms": _ms(times), "masks": len(times), "vocab": tok.vocab_size}
    return out


def bench_steps(seq_counts: list[int], steps: int, forward_ms: float, busy_wait_ms: float) -> dict[str, Any]:
    """Per step, for each batch size, three engine-side timings of the same two commands:

    - serial: post_pre_process then mid_process back to back, nothing to hide behind;
    - critical path, AICI's order: post_pre_process blocks, mid_process is sent before a
      simulated accelerator forward of `forward_ms` (a sleep: a GPU forward leaves the CPU
      free) and its reply awaited after it; counted: the post_pre_process round trip plus the
      wait for mid_process's reply after the forward. This is what AICI's README reports;
    - critical path, tokenwire's order (the Coordinator's): both commands are sent as soon as
      the step's tokens are known, before the forward; counted: the wait after the forward.
    """
    # AICI's default spin (aicirt --busy-wait-time 200): its figures were taken beside a GPU
    client = AiciClient(tokenizer="default", busy_wait_ms=busy_wait_ms)
    pool = concurrent.futures.ThreadPoolExecutor(1)
    forward_s = forward_ms / 1000
    try:
        pings = []
        for _ in range(200):
            t0 = time.perf_counter()
            client.main({"op": "ping"})
            pings.append(time.perf_counter() - t0)
        out: dict[str, Any] = {
            "ping_ms": _ms(pings),
            "forward_ms": forward_ms,
            "busy_wait_ms": busy_wait_ms,
            "steps": {},
        }
        next_id = 1
        prog = {"steps": [{"gen": {"regex": "a*", "max_tokens": 100000}}]}
        a = load_tokenizer("default").encode("a", add_special_tokens=False)[0]
        for n in seq_counts:
            ids = list(range(next_id, next_id + n))
            next_id += n
            for sid in ids:
                client.side("instantiate", req_id=f"b{sid}", prompt=[], module_id="declctrl", module_arg=prog)
            client.main(
                {
                    "op": "post_pre_process",
                    "post_ops": [],
                    "freed": [],
                    "pre_ops": [{"id": s, "req_id": f"b{s}"} for s in ids],
                }
            )
            client.main({"op": "mid_process", "ops": [{"id": s} for s in ids]})

            out["steps"][str(n)] = _measure_batch(client, pool, ids, a, steps, forward_s)
            client.main({"op": "post_pre_process", "post_ops": [], "pre_ops": [], "freed": ids})
        return out
    finally:
        pool.shutdown()
        client.close()


def _measure_batch(
    client: Any, pool: Any, ids: list[int], a: int, steps: int, forward_s: float
) -> dict[str, float]:
    n = len(ids)

    def post_pre() -> dict[str, Any]:
        post_ops = [{"id": s, "tokens": [a], "backtrack": 0} for s in ids]
        return client.main({"op": "post_pre_process", "pre_ops": [], "freed": [], "post_ops": post_ops})

    def mid_msg() -> dict[str, Any]:
        return {"op": "mid_process", "ops": [{"id": s} for s in ids]}

    def check(data: dict[str, Any]) -> None:
        bias = client.biases(n)
        if data["num_seqs"] != n or bias[0, a] != 0.0 or bias[0, a + 1] != float("-inf"):
            raise RuntimeError(f"unexpected mid_process result for {n} sequences")

    def round_trip() -> None:
        post_pre()
        check(client.main(mid_msg()))

    serial, pp, mp, aici_cp, tw_cp = [], [], [], [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        post_pre()
        t1 = time.perf_counter()
        check(client.main(mid_msg()))
        t2 = time.perf_counter()
        serial.append(t2 - t0)
        pp.append(t1 - t0)
        mp.append(t2 - t1)
    for _ in range(steps):
        t0 = time.perf_counter()
        post_pre()
        t1 = time.perf_counter()
        client.send_main(mid_msg())
        time.sleep(forward_s)
        t2 = time.perf_counter()
        data = client.recv_main()
        t3 = time.perf_counter()
        check(data)
        aici_cp.append((t1 - t0) + (t3 - t2))
    for _ in range(steps):
        fut = pool.submit(round_trip)
        time.sleep(forward_s)
        t2 = time.perf_counter()
        fut.result()
        tw_cp.append(time.perf_counter() - t2)
    return {
        "serial_ms": _ms(serial),
        "post_pre_ms": _ms(pp),
        "mid_ms": _ms(mp),
        "critical_aici_order_ms": _ms(aici_cp),
        "critical_tokenwire_order_ms": _ms(tw_cp),
    }


def bench_overlap(tokens: int, seq_counts: list[int]) -> dict[str, Any]:
    """The real default model driving the runtime through /v1/run's code path: per engine step,
    how long sampling waited for the runtime, with rounds run after the forward (baseline) and
    submitted as soon as every sequence reported its token (overlapping the next forward).
    The runtime does not spin here (--busy-wait-time 0): the forward needs both CPU cores."""
    engine = build_engine(EngineSettings(kv_cache_mb=512, progress=False))
    client = AiciClient(tokenizer=tokenizer_spec(engine))
    coord = Coordinator.for_engine(client, engine)
    out: dict[str, Any] = {"tokens": tokens, "seqs": {}}
    try:
        for seqs in seq_counts:
            out["seqs"][str(seqs)] = _overlap_runs(engine, client, coord, tokens, seqs)
    finally:
        coord.close()
        client.close()
        engine.shutdown()
    return out


def _overlap_runs(engine: Any, client: Any, coord: Any, tokens: int, seqs: int) -> dict[str, Any]:
    # `seqs` forks, each generating lowercase words under a regex (a mask every step)
    branches = [
        [{"fixed": f" {i}:"}, {"gen": {"regex": "( [a-z]+)+", "max_tokens": tokens}}] for i in range(seqs)
    ]
    prog = {"steps": [{"fixed": "Words:"}, {"fork": branches}] if seqs > 1 else branches[0]}
    body = {"controller": "declctrl", "controller_arg": prog, "max_tokens": tokens + 8}

    async def one_run() -> None:
        failures = []
        async for ev in run_events(engine, client, coord, RunRequest.from_json(body)):
            failures += [f for f in ev.get("forks", []) if f["error"] or f["finish_reason"] == "fail"]
        if failures:  # a timing of failed runs would mean nothing
            raise RuntimeError(f"{len(failures)} forks failed, e.g. {failures[0]['error']!r}")

    async def plain_run() -> None:
        """The baseline: the same number of sequences and tokens, no controller at all."""
        tok = engine.tokenizer
        sessions = [
            engine.create_session(tok.encode(f"Words: {i}:", add_special_tokens=False), ttl_s=None)
            for i in range(seqs)
        ]
        opts = GenerateOptions(max_tokens=tokens, sampling=SamplingParams(temperature=0.0), ignore_eos=True)

        async def drain(session: str) -> None:
            async for _ in stream_events(engine.generate(session, options=opts)):
                pass

        try:
            await asyncio.gather(*(drain(s) for s in sessions))
        finally:
            for s in sessions:
                engine.close_session(s)

    out: dict[str, Any] = {}
    asyncio.run(one_run())  # warm-up
    for _ in range(2):
        steps0, t0 = engine.steps, time.perf_counter()
        asyncio.run(plain_run())
        row = out.setdefault("no_controller", {"step_ms": []})
        row["step_ms"].append((time.perf_counter() - t0) / (engine.steps - steps0) * 1000)
    for label, overlap in (
        ("after_forward", False),
        ("overlapped", True),
        ("after_forward", False),
        ("overlapped", True),
    ):
        coord.overlap = overlap
        coord.stats.wait_by_step = {}
        s0, steps0, t0 = coord.stats.json(), engine.steps, time.perf_counter()
        asyncio.run(one_run())
        wall, steps, s1 = time.perf_counter() - t0, engine.steps - steps0, coord.stats.json()
        by_step = coord.stats.wait_by_step
        coord.stats.wait_by_step = None
        row = out.setdefault(label, {"wait_ms": [], "median_wait_ms": [], "round_ms": [], "step_ms": []})
        row["wait_ms"].append((s1["wait_s"] - s0["wait_s"]) / steps * 1000)
        # the typical step: steps without any wait count as 0 (the mean includes the ramp-up
        # steps a fork or a new sequence forces to run their round after the forward)
        waits = [by_step.get(steps0 + i, 0.0) for i in range(1, steps + 1)]
        row["median_wait_ms"].append(statistics.median(waits) * 1000)
        row["round_ms"].append((s1["round_s"] - s0["round_s"]) / steps * 1000)
        row["step_ms"].append(wall / steps * 1000)
    return {label: {k: statistics.median(v) for k, v in row.items()} for label, row in out.items()}


AICI_REPORTED = {"1": None, "10": 0.3, "40": 0.7, "regex": 0.3, "c_grammar": 2.0}


def run_bench(args: argparse.Namespace) -> int:
    counts = [int(x) for x in args.seqs.split(",") if x]
    steps = bench_steps(counts, args.steps, args.forward_ms, args.busy_wait_ms)
    masks = bench_masks()
    n_overlap = [int(x) for x in str(getattr(args, "overlap_seqs", "") or "").split(",") if x.strip()]
    n_overlap = [n for n in n_overlap if n > 0]
    overlap = bench_overlap(args.overlap_tokens, n_overlap) if n_overlap else None
    result = {"shm": steps, "masks": masks, "engine_overlap": overlap, "aici_reported_ms": AICI_REPORTED}
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print(f"{'measure (medians)':<52} {'tokenwire ms':>12} {'AICI ms':>8} {'ratio':>6}")
    print(f"{'raw shm round trip (ping), baseline':<52} {steps['ping_ms']:>12.3f} {'-':>8} {'-':>6}")
    sections = (
        (
            "critical_aici_order_ms",
            f"critical path, AICI's order (mid during a {args.forward_ms:g} ms forward):",
        ),
        ("critical_tokenwire_order_ms", "critical path, tokenwire's order (both during the forward):"),
        ("serial_ms", "serial post_pre_process + mid_process, no forward:"),
    )
    for key, title in sections:
        print(title)
        for n, row in steps["steps"].items():
            ref = AICI_REPORTED.get(n)
            ratio = f"{row[key] / ref:.2f}" if ref else "-"
            label = f"  {n} seqs"
            if key == "serial_ms":
                label += f" (pp {row['post_pre_ms']:.3f} / mid {row['mid_ms']:.3f})"
            print(f"{label:<52} {row[key]:>12.3f} {ref if ref else '-':>8} {ratio:>6}")
    for name, row in masks.items():
        ref = AICI_REPORTED[name]
        label = f"mask {name} ({row['vocab']} vocab, {row['masks']} masks)"
        print(f"{label:<52} {row['median_ms']:>12.3f} {ref:>8} {row['median_ms'] / ref:>6.2f}")
    if overlap is not None:
        print(
            f"\nreal engine (SmolLM2, this CPU) + runtime, {overlap['tokens']} tokens a sequence, per step:"
        )
        head = f"{'seqs  rounds':<26} {'wait median':>11} {'wait mean':>9} {'round':>7} {'step':>7}"
        print(head + "  (ms; wait = sampling waiting for the runtime)")
        for n, runs in overlap["seqs"].items():
            plain = runs["no_controller"]["step_ms"]
            print(f"{n:>4}  {'no controller':<20} {'-':>11} {'-':>9} {'-':>7} {plain:>7.1f}")
            for label in ("after_forward", "overlapped"):
                r = runs[label]
                ref = AICI_REPORTED.get(n) if label == "overlapped" else None
                note = f"  AICI {ref}" if ref else ""
                times = f"{r['median_wait_ms']:>11.3f} {r['wait_ms']:>9.3f}"
                times += f" {r['round_ms']:>7.2f} {r['step_ms']:>7.1f}"
                print(f"{n:>4}  {label:<20} {times}{note}")
    return 0
