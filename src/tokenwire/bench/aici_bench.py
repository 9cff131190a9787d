"""`tokenwire bench aici`: AICI step overhead through shared memory, and grammar mask times.

Rows (medians, milliseconds):
- raw shm round trip (ping): the baseline every main-channel op pays twice per step;
- post_pre_process + mid_process for 1, 10 and 40 sequences of a declarative regex
  controller (engine-side wall time of both round trips, the runtime's work included);
- mask time for a regex and for a C-subset Lark grammar on the 49k-token vocabulary
  (llguidance via GrammarConstraint, in process, one mask per token of a sample text).
AICI's published numbers (AMD EPYC 7V13, 32k vocabulary) are shown beside them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

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
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument(
        "--overlap-seqs", type=int, default=4, help="sequences in the engine overlap run (0 = skip it)"
    )
    p.set_defaults(handler=run_bench)


def _ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1000


def bench_masks() -> dict[str, Any]:
    from tokenwire.engine.grammar import GrammarConstraint, lltokenizer_for
    from tokenwire.model.loader import resolve_model

    tok = resolve_model(None, progress=False).tokenizer
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


def bench_steps(seq_counts: list[int], steps: int) -> dict[str, Any]:
    from tokenwire.protocols.aici.client import AiciClient

    client = AiciClient(tokenizer="default")
    try:
        pings = []
        for _ in range(200):
            t0 = time.perf_counter()
            client.main({"op": "ping"})
            pings.append(time.perf_counter() - t0)
        a_token = client.side("instantiate", req_id="probe", prompt="", module_id="regex", module_arg="a")
        del a_token
        out: dict[str, Any] = {"ping_ms": _ms(pings), "steps": {}}
        next_id = 1
        prog = {"steps": [{"gen": {"regex": "a*", "max_tokens": 100000}}]}
        from tokenwire.protocols.aici.tokenizer_env import load_tokenizer

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
            times, pp, mp = [], [], []
            for _ in range(steps):
                t0 = time.perf_counter()
                client.main(
                    {
                        "op": "post_pre_process",
                        "pre_ops": [],
                        "freed": [],
                        "post_ops": [{"id": s, "tokens": [a], "backtrack": 0} for s in ids],
                    }
                )
                t1 = time.perf_counter()
                data = client.main({"op": "mid_process", "ops": [{"id": s} for s in ids]})
                t2 = time.perf_counter()
                bias = client.biases(n)
                assert data["num_seqs"] == n and bias[0, a] == 0.0
                times.append(t2 - t0)
                pp.append(t1 - t0)
                mp.append(t2 - t1)
            client.main({"op": "post_pre_process", "post_ops": [], "pre_ops": [], "freed": ids})
            out["steps"][str(n)] = {"step_ms": _ms(times), "post_pre_ms": _ms(pp), "mid_ms": _ms(mp)}
        return out
    finally:
        client.close()


def bench_overlap(tokens: int, seqs: int) -> dict[str, Any]:
    """The real default model driving the runtime through /v1/run's code path: per engine step,
    how long sampling waited for the runtime, with rounds run after the forward (baseline) and
    submitted as soon as every sequence reported its token (overlapping the next forward)."""
    import asyncio

    from tokenwire.engine.factory import EngineSettings, build_engine
    from tokenwire.protocols.aici.client import AiciClient
    from tokenwire.protocols.aici.engine_bridge import Coordinator
    from tokenwire.protocols.aici.rest import tokenizer_spec
    from tokenwire.protocols.aici.run import RunRequest, run_events

    engine = build_engine(EngineSettings(kv_cache_mb=256, progress=False))
    client = AiciClient(tokenizer=tokenizer_spec(engine))
    coord = Coordinator(client, engine.vocab_size, step_count=lambda: engine.steps)
    # `seqs` forks, each generating lowercase words under a regex (a mask every step)
    branches = [
        [{"fixed": f" {i}:"}, {"gen": {"regex": "( [a-z]+)+", "max_tokens": tokens}}] for i in range(seqs)
    ]
    prog = {"steps": [{"fixed": "Words:"}, {"fork": branches}] if seqs > 1 else branches[0]}
    body = {"controller": "declctrl", "controller_arg": prog, "max_tokens": tokens + 8}

    async def one_run() -> None:
        async for _ in run_events(engine, client, coord, RunRequest.from_json(body)):
            pass

    out: dict[str, Any] = {"tokens": tokens, "seqs": seqs}
    try:
        asyncio.run(one_run())  # warm-up
        for label, overlap in (
            ("after_forward", False),
            ("overlapped", True),
            ("after_forward", False),
            ("overlapped", True),
        ):
            coord.overlap = overlap
            s0, steps0, t0 = coord.stats.json(), engine.steps, time.perf_counter()
            asyncio.run(one_run())
            wall, steps, s1 = time.perf_counter() - t0, engine.steps - steps0, coord.stats.json()
            row = out.setdefault(label, {"wait_ms": [], "round_ms": [], "step_ms": []})
            row["wait_ms"].append((s1["wait_s"] - s0["wait_s"]) / steps * 1000)
            row["round_ms"].append((s1["round_s"] - s0["round_s"]) / steps * 1000)
            row["step_ms"].append(wall / steps * 1000)
        for label in ("after_forward", "overlapped"):
            out[label] = {k: statistics.median(v) for k, v in out[label].items()}
    finally:
        coord.close()
        client.close()
        engine.shutdown()
    return out


AICI_REPORTED = {"1": None, "10": 0.3, "40": 0.7, "regex": 0.3, "c_grammar": 2.0}


def run_bench(args: argparse.Namespace) -> int:
    counts = [int(x) for x in args.seqs.split(",") if x]
    steps = bench_steps(counts, args.steps)
    masks = bench_masks()
    n_overlap = getattr(args, "overlap_seqs", 4)
    overlap = bench_overlap(32, n_overlap) if n_overlap > 0 else None
    result = {"shm": steps, "masks": masks, "engine_overlap": overlap, "aici_reported_ms": AICI_REPORTED}
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print(f"{'measure':<46} {'tokenwire ms':>12} {'AICI ms':>8} {'ratio':>6}")
    print(f"{'raw shm round trip (ping), baseline':<46} {steps['ping_ms']:>12.3f} {'-':>8} {'-':>6}")
    for n, row in steps["steps"].items():
        ref = AICI_REPORTED.get(n)
        ratio = f"{row['step_ms'] / ref:.2f}" if ref else "-"
        label = f"post_pre+mid, {n} seqs (pp {row['post_pre_ms']:.2f} / mid {row['mid_ms']:.2f})"
        print(f"{label:<46} {row['step_ms']:>12.3f} {ref if ref else '-':>8} {ratio:>6}")
        base = f"  = {row['step_ms'] / steps['ping_ms']:.1f} x 1 ping"
        print(f"{base:<46}")
    for name, row in masks.items():
        ref = AICI_REPORTED[name]
        label = f"mask {name} ({row['vocab']} vocab, {row['masks']} masks)"
        print(f"{label:<46} {row['median_ms']:>12.3f} {ref:>8} {row['median_ms'] / ref:>6.2f}")
    if overlap is not None:
        print(
            f"\nengine + runtime, {overlap['seqs']} seqs x {overlap['tokens']} tokens, per engine step (ms):"
        )
        print(f"{'rounds':<26} {'engine waits':>12} {'runtime round':>13} {'step':>8}")
        for label in ("after_forward", "overlapped"):
            r = overlap[label]
            print(f"{label:<26} {r['wait_ms']:>12.3f} {r['round_ms']:>13.3f} {r['step_ms']:>8.2f}")
    return 0
