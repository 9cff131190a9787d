"""`tokenwire bench openai`: what the OpenAI-compatible HTTP layer costs, and what sessions save.

All in one process and one run, medians of --repeats, each measure next to its baseline
(interleaved, so a load change on a shared machine hits both alike):
- throughput: tokens/s a client receives through streaming /v1/chat/completions (SSE) against
  the engine called directly with the same requests, for 1 and --streams concurrent streams on
  the real model. Targets: >= 0.95x the engine at 1 stream, >= 0.9x at 32.
- SSE overhead: one stream of --overhead-tokens tokens on the no-model backend (the engine
  around RandomTokenModel, no forward pass), (HTTP - engine) / tokens in us; baseline: a bare
  uvicorn/Starlette endpoint streaming the same number of ready-made chunks (transport alone).
- turn 2: time to the first token of the second turn of a --history-token conversation, on a
  session (only the new message is sent and computed) against resending the whole history as
  stock clients do (a history the server never saw: no prefix-cache help; the prefix-cache
  case is reported too). Target: >= 10x.
The client is aiohttp reading the SSE lines and parsing each chunk's JSON with orjson, in the
same event loop as the server (the least any client must do; the `openai` package costs more).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from typing import Any

import aiohttp
import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from tokenwire.bench.random_tokens import run_with_random_twin
from tokenwire.cli_args import add_model_args, settings_from
from tokenwire.engine.engine import Engine
from tokenwire.engine.factory import EngineSettings
from tokenwire.engine.request import FinishEvent, GenerateOptions, SamplingParams, stream_events
from tokenwire.protocols.openai.transport import EmbeddedServer, OpenAIServer

PROMPT = "Tell me a long story about a lighthouse keeper and a storm."


async def _stream(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[int, float]:
    """(completion tokens, seconds to the first content) of one streamed chat completion."""
    start = time.perf_counter()
    first = 0.0
    tokens = 0
    async with http.post(url + "/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.content:
            if not line.startswith(b"data: "):
                continue
            payload = line[6:].strip()
            if payload == b"[DONE]":
                break
            chunk = orjson.loads(payload)
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            elif not first and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                first = time.perf_counter() - start
    return tokens, first


def _chat_body(model: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        **extra,
    }


async def _engine_run(engine: Engine, prompt: list[int], streams: int, tokens: int) -> float:
    async def one() -> int:
        opts = GenerateOptions(max_tokens=tokens, sampling=SamplingParams(temperature=0), ignore_eos=True)
        count = 0
        async for event in stream_events(engine.generate(None, prompt, opts)):
            count += not isinstance(event, FinishEvent)
        return count

    start = time.perf_counter()
    total = sum(await asyncio.gather(*(one() for _ in range(streams))))
    return total / (time.perf_counter() - start)


async def _http_run(http: aiohttp.ClientSession, url: str, model: str, streams: int, tokens: int) -> float:
    start = time.perf_counter()
    results = await asyncio.gather(*(_stream(http, url, _chat_body(model, tokens)) for _ in range(streams)))
    total = sum(count for count, _ in results)
    assert total == streams * tokens, (total, streams * tokens)
    return total / (time.perf_counter() - start)


async def _throughput(
    engine: Engine, http: aiohttp.ClientSession, url: str, args: argparse.Namespace
) -> list:
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}])
    rows = []
    for streams in (1, args.streams):
        await _engine_run(engine, prompt, streams, 4)  # warm-up (and the prompt's prefix cache)
        await _http_run(http, url, engine.name, streams, 4)
        runs = []
        for _ in range(args.repeats):
            runs.append(
                (
                    await _engine_run(engine, prompt, streams, args.tokens),
                    await _http_run(http, url, engine.name, streams, args.tokens),
                )
            )
        direct = statistics.median(r[0] for r in runs)
        served = statistics.median(r[1] for r in runs)
        rows.append(
            {
                "streams": streams,
                "tokens_per_stream": args.tokens,
                "engine_tok_s": direct,
                "http_tok_s": served,
                "ratio": served / direct,
            }
        )
    return rows


def _echo_app(chunk: bytes) -> Starlette:
    async def echo(request: Request) -> StreamingResponse:
        n = int(request.query_params["n"])

        async def body() -> Any:
            for _ in range(n):
                yield chunk
            yield b"data: [DONE]\n\n"

        return StreamingResponse(body(), media_type="text/event-stream")

    return Starlette(routes=[Route("/echo", echo)])


async def _overhead(random_engine: Engine, http: aiohttp.ClientSession, args: argparse.Namespace) -> dict:
    n = args.overhead_tokens
    server = await OpenAIServer(random_engine, "127.0.0.1", 0).start()
    sample = (
        b"data: "
        + orjson.dumps(
            {
                "id": "chatcmpl-" + "0" * 32,
                "object": "chat.completion.chunk",
                "created": 0,
                "model": random_engine.name,
                "choices": [
                    {"index": 0, "delta": {"content": " token"}, "finish_reason": None, "logprobs": None}
                ],
                "system_fingerprint": None,
            }
        )
        + b"\n\n"
    )
    echo = EmbeddedServer(
        uvicorn.Config(_echo_app(sample), host="127.0.0.1", port=0, log_level="warning", lifespan="off")
    )
    echo_task = asyncio.create_task(echo.serve())
    while not echo.started:
        await asyncio.sleep(0.01)
    echo_url = f"http://127.0.0.1:{echo.servers[0].sockets[0].getsockname()[1]}/echo?n={n}"
    prompt = random_engine.tokenizer.encode(PROMPT)

    async def direct() -> float:
        opts = GenerateOptions(max_tokens=n, sampling=SamplingParams(temperature=0), ignore_eos=True)
        start = time.perf_counter()
        async for _ in stream_events(random_engine.generate(None, prompt, opts)):
            pass
        return time.perf_counter() - start

    async def served() -> float:
        start = time.perf_counter()
        count, _ = await _stream(http, server.url, _chat_body(random_engine.name, n))
        assert count == n
        return time.perf_counter() - start

    async def bare() -> float:
        start = time.perf_counter()
        async with http.get(echo_url) as response:
            count = 0
            async for line in response.content:
                if line.startswith(b"data: ") and line[6:].strip() != b"[DONE]":
                    orjson.loads(line[6:])
                    count += 1
        assert count == n
        return time.perf_counter() - start

    try:
        for fn in (direct, served, bare):
            await fn()
        runs = [(await direct(), await served(), await bare()) for _ in range(args.repeats)]
    finally:
        await server.stop()
        echo.should_exit = True
        await echo_task
    t_direct, t_served, t_bare = (statistics.median(r[k] for r in runs) for k in range(3))
    return {
        "tokens": n,
        "engine_us_per_token": t_direct / n * 1e6,
        "http_us_per_token": t_served / n * 1e6,
        "overhead_us_per_token": (t_served - t_direct) / n * 1e6,
        "echo_us_per_token": t_bare / n * 1e6,
        "chunk_bytes": len(sample),
    }


def _words(tokenizer: Any, count: int, seed: int) -> str:
    """Text of about `count` tokens, different for every seed (no prefix-cache hits between seeds)."""
    rng = random.Random(seed)
    vocab = "the a of lamp tower sea storm keeper night light ship rock wave wind door stair oil".split()
    text = ""
    while len(tokenizer.encode(text)) < count:
        text += " ".join(rng.choice(vocab) for _ in range(64)) + " "
    ids = tokenizer.encode(text)[:count]
    return tokenizer.decode(ids)


async def _turn2(engine: Engine, http: aiohttp.ClientSession, url: str, args: argparse.Namespace) -> dict:
    model = engine.name
    question = [{"role": "user", "content": "And what happened next?"}]
    session_s, cold_s, warm_s, prompt_tokens = [], [], [], 0

    async def turn(messages: list[dict[str, str]], **extra: Any) -> tuple[str, float]:
        body = {**_chat_body(model, 1, **extra), "messages": messages}
        body.pop("ignore_eos")
        return "", (await _stream(http, url, body))[1]

    for r in range(args.repeats):
        history = [{"role": "user", "content": _words(engine.tokenizer, args.history_tokens, seed=10 + r)}]
        async with http.post(url + "/sessions", json={}) as response:
            sid = (await response.json())["id"]
        async with http.post(
            url + "/chat/completions",
            json={
                "model": model,
                "messages": history,
                "max_tokens": 16,
                "temperature": 0,
                "session": sid,
            },
        ) as response:
            reply = (await response.json())["choices"][0]["message"]["content"]
        session_s.append((await turn(question, session=sid))[1])
        await http.delete(url + f"/sessions/{sid}")
        whole = [*history, {"role": "assistant", "content": reply}, *question]
        warm_s.append((await turn(whole))[1])  # seen before: the prefix cache has turn 1
        fresh = [
            {"role": "user", "content": _words(engine.tokenizer, args.history_tokens, seed=1000 + r)},
            {"role": "assistant", "content": reply},
            *question,
        ]
        cold_s.append((await turn(fresh))[1])
        prompt_tokens = len(engine.tokenizer.apply_chat_template(fresh))
    s, cold, warm = (statistics.median(x) for x in (session_s, cold_s, warm_s))
    return {
        "prompt_tokens": prompt_tokens,
        "session_s": s,
        "resend_s": cold,
        "resend_cached_s": warm,
        "ratio": cold / s,
        "ratio_cached": warm / s,
    }


async def _run(engine: Engine, random_engine: Engine, args: argparse.Namespace) -> dict:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as http:
        overhead = await _overhead(random_engine, http, args)
        server = await OpenAIServer(engine, "127.0.0.1", 0).start()
        try:
            return {
                "model": engine.name,
                "throughput": await _throughput(engine, http, server.url, args),
                "overhead": overhead,
                "turn2": await _turn2(engine, http, server.url, args),
            }
        finally:
            await server.stop()


def run_openai_bench(args: argparse.Namespace, settings: EngineSettings) -> int:
    result = run_with_random_twin(settings, lambda engine, twin: _run(engine, twin, args))
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"tokenwire bench openai — {result['model']}, median of {args.repeats}")
    print(f"{'measure':<44}{'openai api':>14}{'baseline':>14}{'ratio':>9}")
    for row in result["throughput"]:
        label = f"stream tok/s, {row['streams']} x {row['tokens_per_stream']} tok (vs engine)"
        print(f"{label:<44}{row['http_tok_s']:>14.1f}{row['engine_tok_s']:>14.1f}{row['ratio']:>8.2f}x")
    o = result["overhead"]
    print(
        f"{'SSE overhead per token, no model (vs echo)':<44}{o['overhead_us_per_token']:>11.1f} us"
        f"{o['echo_us_per_token']:>11.1f} us{o['overhead_us_per_token'] / o['echo_us_per_token']:>8.2f}x"
    )
    print(
        f"{'  total per token (vs engine)':<44}{o['http_us_per_token']:>11.1f} us"
        f"{o['engine_us_per_token']:>11.1f} us{o['http_us_per_token'] / o['engine_us_per_token']:>8.2f}x"
    )
    t = result["turn2"]
    label = f"turn-2 TTFT, {t['prompt_tokens']} tok (vs resend)"
    print(f"{label:<44}{t['session_s'] * 1e3:>11.1f} ms{t['resend_s'] * 1e3:>11.1f} ms{t['ratio']:>8.2f}x")
    print(
        f"{'  (vs resend, prefix cache warm)':<44}{t['session_s'] * 1e3:>11.1f} ms"
        f"{t['resend_cached_s'] * 1e3:>11.1f} ms{t['ratio_cached']:>8.2f}x"
    )
    print("throughput ratios are api / engine; overhead = (HTTP - engine) / tokens on RandomTokenModel;")
    print(
        f"echo = bare uvicorn SSE stream of {o['chunk_bytes']}-byte chunks; turn-2 ratios: resend / session."
    )
    return 0


def register(bench_sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]

    p = bench_sub.add_parser(
        "openai", help="OpenAI API: SSE throughput vs the engine, overhead, session turn 2"
    )
    add_model_args(p)
    p.add_argument("--json", action="store_true")
    p.add_argument("--streams", type=int, default=32, help="concurrent streams of the second throughput row")
    p.add_argument("--tokens", type=int, default=32, help="tokens per stream in the throughput rows")
    p.add_argument("--overhead-tokens", type=int, default=512)
    p.add_argument("--history-tokens", type=int, default=1000, help="conversation length before turn 2")
    p.add_argument("--repeats", type=int, default=3)
    p.set_defaults(handler=lambda args: run_openai_bench(args, settings_from(args)))
