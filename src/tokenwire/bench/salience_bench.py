"""`tokenwire bench salience`: what the gRPC layer costs, and what sessions save.

All in one process and one run, medians of --repeats:
- stream overhead: a burst of N Token events (prefill-only scoring with logprobs on N positions:
  one model step, then N events) through Generate, against the same request straight on the
  engine; (salience - engine) / N is the per-token cost of the gRPC layer. This row runs on the
  no-model backend (RandomTokenModel: the engine without the forward pass), so model time,
  which would swamp a per-token difference on a shared machine, is not part of either side. The baseline is a
  bare grpc.aio server-streaming echo of N ready-made Token-sized messages: per-message cost
  of the transport alone (target: Salience's overhead within 2x of it).
- decode: decode-only time per token of a greedy decode, engine direct vs Generate.
- wire bytes: a --turns turn, --tokens token chat, with a session (each turn sends its delta)
  against resending the whole prompt each turn (OpenSession + full Generate + CloseSession).
  Counted as serialized protobuf messages plus gRPC's 5-byte frame header, both directions
  (HTTP/2 headers excluded, equal per call in both modes).
- turn-N TTFT: time to the first token of the last turn, with the session (turns 1..N-1 already
  prefilled) against resending the whole conversation to a fresh session (a conversation the
  server has never seen, so its prefix cache cannot help). Target: >= 10x.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import grpc

from tokenwire.bench.random_tokens import run_with_random_twin
from tokenwire.cli_args import add_model_args, settings_from
from tokenwire.engine.engine import Engine
from tokenwire.engine.factory import EngineSettings
from tokenwire.engine.request import FinishEvent, GenerateOptions, SamplingParams
from tokenwire.protocols.grpc_server import GrpcServer
from tokenwire.protocols.salience.gen import salience_pb2 as pb
from tokenwire.protocols.salience.gen import salience_pb2_grpc as pb_grpc
from tokenwire.protocols.salience.service import add_to_server as add_salience

ECHO_METHOD = "/tokenwire.bench.Echo/Stream"
FRAME = 5  # gRPC length-prefixed message header


async def _median(fn: Callable[[], Coroutine[Any, Any, float]], repeats: int) -> float:
    return statistics.median([await fn() for _ in range(repeats)])


def _echo_handler(messages: list[bytes]) -> grpc.GenericRpcHandler:
    async def stream(request: bytes, context: Any) -> AsyncIterator[bytes]:
        for message in messages[: int(request or b"0")]:
            yield message

    handler = grpc.unary_stream_rpc_method_handler(
        stream, request_deserializer=lambda b: b, response_serializer=lambda b: b
    )
    return grpc.method_handlers_generic_handler("tokenwire.bench.Echo", {"Stream": handler})


async def _stream_overhead(
    engine: Engine, stub: pb_grpc.SalienceStub, channel: grpc.aio.Channel, n: int, repeats: int
) -> dict[str, float]:
    tokens = [random.Random(1).randrange(1000, 20000) for _ in range(n)]
    sid = engine.create_session(tokens)
    opts = lambda: GenerateOptions(max_tokens=0, logprob_ranges=[(0, n)])  # noqa: E731

    async def direct() -> float:
        start = time.perf_counter()
        count = 0
        async for event in engine.generate(sid, [], opts()):
            count += not isinstance(event, FinishEvent)
        assert count == n
        return time.perf_counter() - start

    async def salience() -> float:
        request = pb.GenerateRequest(
            session_id=sid, offset=n, logprobs_ranges=[pb.PositionRange(start=0, end=n)]
        )
        start = time.perf_counter()
        count = 0
        async for event in stub.Generate(request):
            count += event.HasField("token")
        assert count == n
        return time.perf_counter() - start

    sample = pb.GenerateEvent(
        token=pb.Token(
            id=12345, position=2000, is_prefill=True, sampled_logprob=-1.5, has_sampled_logprob=True
        )
    ).SerializeToString()
    echo_call = channel.unary_stream(
        ECHO_METHOD, request_serializer=lambda b: b, response_deserializer=lambda b: b
    )

    async def echo() -> float:
        start = time.perf_counter()
        count = 0
        async for _ in echo_call(str(n).encode()):
            count += 1
        assert count == n
        return time.perf_counter() - start

    await direct()  # warm-up: first-call costs out of the medians
    await salience()
    await echo()
    # interleaved, so a load change on a shared machine hits all three alike
    runs = [(await direct(), await salience(), await echo()) for _ in range(repeats)]
    t_direct, t_salience, t_echo = (statistics.median(r[k] for r in runs) for k in range(3))
    engine.close_session(sid)
    overhead = (t_salience - t_direct) / n
    per_echo = t_echo / n
    return {
        "tokens": n,
        "engine_us_per_token": t_direct / n * 1e6,
        "salience_us_per_token": t_salience / n * 1e6,
        "overhead_us_per_token": overhead * 1e6,
        "echo_us_per_token": per_echo * 1e6,
        "overhead_vs_echo": overhead / per_echo,
        "echo_message_bytes": len(sample),
    }


async def _decode(
    engine: Engine, stub: pb_grpc.SalienceStub, prompt: list[int], n: int, repeats: int
) -> dict[str, float]:
    """Decode-only time per token (first token, which carries the prefill, excluded on both sides)."""

    async def direct() -> float:
        opts = GenerateOptions(max_tokens=n, sampling=SamplingParams(temperature=0), ignore_eos=True)
        times = []
        async for event in engine.generate(None, prompt, opts):
            if not isinstance(event, FinishEvent):
                times.append(time.perf_counter())
        return (times[-1] - times[0]) / (len(times) - 1)

    async def salience() -> float:
        sid = (await stub.OpenSession(pb.OpenSessionRequest())).session_id
        request = pb.GenerateRequest(session_id=sid, append_tokens=prompt, max_tokens=n, top_k=1)
        times = []
        async for event in stub.Generate(request):
            if event.HasField("token"):
                times.append(time.perf_counter())
        await stub.CloseSession(pb.CloseSessionRequest(session_id=sid))
        if len(times) < 2:
            raise RuntimeError("the model stopped after one token: use another prompt")
        return (times[-1] - times[0]) / (len(times) - 1)

    runs = [(await direct(), await salience()) for _ in range(repeats)]  # interleaved
    return {
        "engine_ms_per_token": statistics.median(r[0] for r in runs) * 1e3,
        "salience_ms_per_token": statistics.median(r[1] for r in runs) * 1e3,
    }


def _conversation(engine: Engine, turns: int, total: int, seed: int) -> list[tuple[list[int], list[int]]]:
    """(user, assistant) token lists per turn, `total` tokens in all, from real-text token ids."""
    rng = random.Random(seed)
    words = "the a of session token server client model send delta each turn prompt reply wire".split()
    per = total // (2 * turns)
    out = []
    for _ in range(turns):
        user = engine.tokenizer.encode(
            " ".join(rng.choice(words) for _ in range(per * 2)), add_special_tokens=False
        )
        reply = engine.tokenizer.encode(
            " ".join(rng.choice(words) for _ in range(per * 2)), add_special_tokens=False
        )
        out.append((user[:per], reply[:per]))
    return out


def _wire_bytes(conv: list[tuple[list[int], list[int]]]) -> dict[str, int]:
    """Bytes both ways for the whole chat; replies stream back as Token events in both modes."""

    def size(message: Any) -> int:
        return message.ByteSize() + FRAME

    sid = "0" * 32
    session_bytes = size(pb.OpenSessionRequest()) + size(
        pb.OpenSessionResponse(session_id=sid, max_model_len=8192)
    )
    resend_bytes = 0
    session_up = resend_up = 0  # client -> server only: where sessions save
    history: list[int] = []
    for user, reply in conv:
        session_up += size(
            pb.GenerateRequest(session_id=sid, append_tokens=user, offset=len(history), max_tokens=len(reply))
        )
        resend_up += size(pb.OpenSessionRequest()) + size(pb.CloseSessionRequest(session_id=sid))
        resend_up += size(
            pb.GenerateRequest(session_id=sid, append_tokens=history + user, max_tokens=len(reply))
        )
        back = sum(
            size(pb.GenerateEvent(token=pb.Token(id=t, position=len(history) + len(user) + i)))
            for i, t in enumerate(reply)
        )
        done = size(
            pb.GenerateEvent(done=pb.GenerateDone(prompt_tokens=len(history), completion_tokens=len(reply)))
        )
        session_bytes += (
            size(
                pb.GenerateRequest(
                    session_id=sid, append_tokens=user, offset=len(history), max_tokens=len(reply)
                )
            )
            + back
            + done
        )
        resend_bytes += (
            size(pb.OpenSessionRequest())
            + size(pb.OpenSessionResponse(session_id=sid, max_model_len=8192))
            + size(pb.GenerateRequest(session_id=sid, append_tokens=history + user, max_tokens=len(reply)))
            + back
            + done
            + size(pb.CloseSessionRequest(session_id=sid))
            + size(pb.CloseSessionResponse())
        )
        history += user + reply
    return {
        "tokens": len(history),
        "session_bytes": session_bytes,
        "resend_bytes": resend_bytes,
        "session_upload_bytes": session_up,
        "resend_upload_bytes": resend_up,
    }


async def _first_token(stub: pb_grpc.SalienceStub, request: pb.GenerateRequest) -> float:
    start = time.perf_counter()
    call = stub.Generate(request)
    async for event in call:
        if event.HasField("token"):
            elapsed = time.perf_counter() - start
            call.cancel()
            return elapsed
    raise RuntimeError("no token came back")


async def _ttft(engine: Engine, stub: pb_grpc.SalienceStub, turns: int, total: int, repeats: int) -> dict:
    with_session, without = [], []
    for r in range(repeats):
        conv = _conversation(engine, turns, total, seed=100 + 2 * r)
        history = [t for user, reply in conv[:-1] for t in user + reply]
        sid = (await stub.OpenSession(pb.OpenSessionRequest())).session_id
        length = 0
        for user, reply in conv[:-1]:  # turns 1..N-1: their prompts and replies are in the session
            await stub.Generate(
                pb.GenerateRequest(session_id=sid, append_tokens=user + reply, offset=length)
            ).read()
            length += len(user) + len(reply)
        last = conv[-1][0]
        with_session.append(
            await _first_token(
                stub,
                pb.GenerateRequest(session_id=sid, append_tokens=last, offset=length, max_tokens=1, top_k=1),
            )
        )
        await stub.CloseSession(pb.CloseSessionRequest(session_id=sid))
        other = _conversation(engine, turns, total, seed=101 + 2 * r)  # never seen: no cache hits
        full = [t for user, reply in other[:-1] for t in user + reply] + other[-1][0]
        fresh = (await stub.OpenSession(pb.OpenSessionRequest())).session_id
        without.append(
            await _first_token(
                stub, pb.GenerateRequest(session_id=fresh, append_tokens=full, max_tokens=1, top_k=1)
            )
        )
        await stub.CloseSession(pb.CloseSessionRequest(session_id=fresh))
        assert len(full) == len(history) + len(last)
    s, w = statistics.median(with_session), statistics.median(without)
    return {"prompt_tokens": len(history) + len(last), "session_s": s, "resend_s": w, "ratio": w / s}


async def _start_server(engine: Engine) -> GrpcServer:
    return await GrpcServer(
        engine,
        argparse.Namespace(session_ttl=600.0),
        "127.0.0.1",
        0,
        services=[add_salience],
    ).start()


async def _stream_row(random_engine: Engine, args: argparse.Namespace) -> dict[str, float]:
    sample = pb.GenerateEvent(
        token=pb.Token(
            id=12345, position=2000, is_prefill=True, sampled_logprob=-1.5, has_sampled_logprob=True
        )
    ).SerializeToString()
    server = await _start_server(random_engine)
    assert server.server is not None
    server.server.add_generic_rpc_handlers([_echo_handler([sample] * args.stream_tokens)])
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = pb_grpc.SalienceStub(channel)
            return await _stream_overhead(random_engine, stub, channel, args.stream_tokens, args.repeats)
    finally:
        await server.stop(0.5)


async def _run(engine: Engine, random_engine: Engine, args: argparse.Namespace) -> dict:
    stream = await _stream_row(random_engine, args)
    server = await _start_server(engine)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = pb_grpc.SalienceStub(channel)
            prompt = engine.tokenizer.apply_chat_template(
                [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}]
            )
            return {
                "model": engine.name,
                "stream": stream,
                "decode": await _decode(engine, stub, prompt, args.decode_tokens, args.repeats),
                "wire": _wire_bytes(_conversation(engine, args.turns, args.tokens, seed=7)),
                "ttft": await _ttft(engine, stub, args.turns, args.tokens, args.repeats),
            }
    finally:
        await server.stop(0.5)


def run_salience_bench(args: argparse.Namespace, settings: EngineSettings) -> int:
    result = run_with_random_twin(settings, lambda engine, twin: _run(engine, twin, args))
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    s, d, w, t = result["stream"], result["decode"], result["wire"], result["ttft"]
    print(f"tokenwire bench salience — {result['model']}, median of {args.repeats}")
    print(f"{'measure':<40}{'salience':>14}{'baseline':>14}{'ratio':>9}")
    print(
        f"{'stream: overhead per token (vs echo)':<40}{s['overhead_us_per_token']:>11.1f} us"
        f"{s['echo_us_per_token']:>11.1f} us{s['overhead_vs_echo']:>8.2f}x"
    )
    print(
        f"{'stream: total per token (vs engine)':<40}{s['salience_us_per_token']:>11.1f} us"
        f"{s['engine_us_per_token']:>11.1f} us{s['salience_us_per_token'] / s['engine_us_per_token']:>8.2f}x"
    )
    print(
        f"{'decode: per token (vs engine)':<40}{d['salience_ms_per_token']:>11.2f} ms"
        f"{d['engine_ms_per_token']:>11.2f} ms{d['salience_ms_per_token'] / d['engine_ms_per_token']:>8.2f}x"
    )
    print(
        f"{'wire bytes, ' + str(args.turns) + ' turns/' + str(w['tokens']) + ' tok (vs resend)':<40}"
        f"{w['session_bytes']:>14,}{w['resend_bytes']:>14,}{w['resend_bytes'] / w['session_bytes']:>8.2f}x"
    )
    print(
        f"{'  of which client -> server':<40}{w['session_upload_bytes']:>14,}{w['resend_upload_bytes']:>14,}"
        f"{w['resend_upload_bytes'] / w['session_upload_bytes']:>8.2f}x"
    )
    print(
        f"{'turn-' + str(args.turns) + ' TTFT, ' + str(t['prompt_tokens']) + ' tok (vs resend)':<40}"
        f"{t['session_s'] * 1e3:>11.1f} ms{t['resend_s'] * 1e3:>11.1f} ms{t['ratio']:>8.2f}x"
    )
    print(f"stream rows: a burst of {s['tokens']} Token events (prefill-only logprobs); overhead =")
    print("Generate minus the same request on the engine; echo = bare grpc.aio stream of")
    print(f"{s['echo_message_bytes']}-byte messages.")
    print("wire: protobuf bytes + 5-byte gRPC frames, both directions; ratios are baseline / salience.")
    return 0


def register(bench_sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]

    p = bench_sub.add_parser("salience", help="Salience gRPC: streaming overhead, wire bytes, session TTFT")
    add_model_args(p)
    p.add_argument("--json", action="store_true")
    p.add_argument("--stream-tokens", type=int, default=512, help="Token events in the overhead burst")
    p.add_argument("--decode-tokens", type=int, default=16)
    p.add_argument("--turns", type=int, default=20)
    p.add_argument("--tokens", type=int, default=4000, help="conversation length for wire bytes and TTFT")
    p.add_argument("--repeats", type=int, default=3)
    p.set_defaults(handler=lambda args: run_salience_bench(args, settings_from(args)))
