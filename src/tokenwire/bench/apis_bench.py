"""`tokenwire bench apis`: the same greedy chat through every API on the HTTP port (issue 43).

OpenAI chat completions, OpenAI Responses, Anthropic Messages and Ollama's /api/chat, each
streamed by a plain aiohttp client that parses the API's own stream (SSE, named SSE events,
NDJSON) and takes the token count from the API's own usage fields, against the engine called
directly with the same prompt tokens — interleaved, medians of --repeats:

- time to first token and tokens/s per API, and its ratio to the engine's (target >= 0.97x): the
  median over rounds of each reading against an engine reading taken just before it; the
  clients run in a process of their own (bench/api_clients.py), as a user's client does;
- the texts must be equal (greedy parity: the same conversation, the same tokens), else exit 1;
- turn 2 of a --history-tokens conversation through Responses: `previous_response_id` (the
  session's KV is reused) against re-sending the whole conversation (a history the server never
  saw, so no prefix cache helps it). Target >= 10x.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

from tokenwire.bench.api_clients import APIS, PROMPT, ClientProcess, Reading
from tokenwire.bench.openai_bench import _words
from tokenwire.cli_args import add_model_args, settings_from
from tokenwire.engine.engine import Engine
from tokenwire.engine.factory import EngineSettings, build_engine
from tokenwire.engine.request import FinishEvent, GenerateOptions, SamplingParams, stream_events
from tokenwire.protocols.openai.transport import OpenAIServer

GREEDY = SamplingParams(temperature=0.0)


async def _engine(engine: Engine, tokens: int) -> Reading:
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}])
    r = Reading()
    ids: list[int] = []
    opts = GenerateOptions(max_tokens=tokens, sampling=GREEDY)
    async for event in stream_events(engine.generate(None, prompt, opts)):
        if isinstance(event, FinishEvent):
            break
        if not ids:
            r.first = time.perf_counter() - r.start
        ids.append(event.token_id)
    r.text, r.tokens = engine.tokenizer.decode(ids), len(ids)
    return r.done()


async def _turn2(client: ClientProcess, base: str, engine: Engine, history: int, repeats: int) -> dict:
    model, chained, resent = engine.name, [], []
    question = "And what happened next?"
    for i in range(repeats):
        text = _words(engine.tokenizer, history, seed=20 + i)
        first = {"model": model, "input": text, "max_output_tokens": 16, "temperature": 0}
        turn1 = await client.call("responses_first_turn", base, first)
        one = {"model": model, "max_output_tokens": 1, "temperature": 0}
        chained.append(
            await client.call(
                "responses_ttft", base, {**one, "input": question, "previous_response_id": turn1["id"]}
            )
        )
        unseen = _words(engine.tokenizer, history, seed=2000 + i)  # no prefix-cache help
        conversation = [
            {"role": "user", "content": unseen},
            {"role": "assistant", "content": turn1["text"]},
            {"role": "user", "content": question},
        ]
        resent.append(await client.call("responses_ttft", base, {**one, "input": conversation}))
        await client.call("responses_delete", base, turn1["id"])
    c, s = statistics.median(chained), statistics.median(resent)
    return {"history_tokens": history, "chained_ttft_s": c, "resent_ttft_s": s, "ratio": s / c}


async def _run(engine: Engine, args: argparse.Namespace) -> dict[str, Any]:
    server = await OpenAIServer(engine, "127.0.0.1", 0).start()
    base = server.url.removesuffix("/v1")
    rows: dict[str, list[Reading]] = {"engine": [], **{name: [] for name in APIS}}
    # each API's reading beside an engine reading taken just before it: the machine is shared,
    # and a ratio of neighbours cancels the load that moves both (medians of these ratios)
    pairs: dict[str, list[float]] = {name: [] for name in APIS}
    client = ClientProcess()
    try:
        await _engine(engine, 4)  # warm-up: the prompt's prefix cache, every route once
        for name in APIS:
            await client.call(name, base, engine.name, 4)
        for _ in range(args.repeats):
            for name in APIS:
                alone = await _engine(engine, args.tokens)
                served = await client.call(name, base, engine.name, args.tokens)
                rows["engine"].append(alone)
                rows[name].append(served)
                pairs[name].append((served.tokens / served.seconds) / (alone.tokens / alone.seconds))
        turn2 = await _turn2(client, base, engine, args.history_tokens, args.repeats)
    finally:
        client.close()
        await server.stop()
    reference = rows["engine"][0].text
    table = {}
    for name, readings in rows.items():
        rate = statistics.median(r.tokens / r.seconds for r in readings)
        table[name] = {
            "ttft_s": statistics.median(r.first for r in readings),
            "tok_s": rate,
            "ratio": statistics.median(pairs[name]) if name in pairs else 1.0,
            "tokens": readings[0].tokens,
            "same_text": all(r.text == reference for r in readings),
        }
    return {
        "model": engine.name,
        "tokens": args.tokens,
        "repeats": args.repeats,
        "apis": table,
        "turn2": turn2,
    }


def run_apis_bench(args: argparse.Namespace, settings: EngineSettings) -> int:
    engine = build_engine(settings)
    try:
        result = asyncio.run(_run(engine, args))
    finally:
        engine.shutdown()
    ok = all(row["same_text"] for row in result["apis"].values())
    if args.json:
        print(json.dumps(result, indent=2))
        return 0 if ok else 1
    print(f"tokenwire bench apis — {result['model']}, {args.tokens} greedy tokens, median of {args.repeats}")
    print(f"{'api':<18}{'TTFT':>10}{'tok/s':>10}{'vs engine':>11}{'tokens':>8}{'same text':>11}")
    for name, row in result["apis"].items():
        print(
            f"{name:<18}{row['ttft_s'] * 1e3:>8.1f}ms{row['tok_s']:>10.1f}{row['ratio']:>10.2f}x"
            f"{row['tokens']:>8}{'yes' if row['same_text'] else 'NO':>11}"
        )
    t = result["turn2"]
    print(
        f"Responses turn 2 after {t['history_tokens']} tokens: previous_response_id "
        f"{t['chained_ttft_s'] * 1e3:.1f} ms vs re-sent {t['resent_ttft_s'] * 1e3:.1f} ms = {t['ratio']:.1f}x"
    )
    return 0 if ok else 1


def register(bench_sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = bench_sub.add_parser("apis", help="the same greedy chat through every HTTP API vs the engine")
    add_model_args(p)
    p.add_argument("--json", action="store_true")
    p.add_argument("--tokens", type=int, default=64, help="greedy tokens per answer")
    p.add_argument("--history-tokens", type=int, default=2000, help="conversation before Responses' turn 2")
    p.add_argument("--repeats", type=int, default=3)
    p.set_defaults(handler=lambda args: run_apis_bench(args, settings_from(args)))
