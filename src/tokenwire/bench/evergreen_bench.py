"""`tokenwire bench evergreen`: what Evergreen's streaming and reuse buy, measured side by side.

1. TTFT, streamed chain vs whole prompt: a long prompt produced in 20 chunks at a fixed
   interval (as an upstream producer would). "streamed": the action goes first and each chunk
   is sent as it is produced, so the server prefills while the input streams. "whole": the
   client waits for the whole prompt, then sends it after the action. TTFT is measured from
   the moment the last chunk exists to the first output fragment. Each run uses a fresh
   prompt (a nonce up front) so the prefix cache does not help either side.
2. Turn-2 cost: the seed's turn 2 ([prompt_1, response_1, question_2]) in the same session
   (reuse: forks turn 1's engine session) vs a server started with reuse off (fresh engine
   session, prefix cache off): turn-2 TTFT and model positions computed (engine counter).
3. Per-token streaming overhead: GENERATE of N tokens over the real engine with a no-model
   backend (RandomTokenModel: scheduler, sampler, KV still run), minus the same generation
   read straight from that engine, vs a bare grpc.aio bidi echo of N messages of the same
   shape; per-token microseconds and their ratio.
Server and client share one process and event loop; the model runs in the engine's thread.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc

from tokenwire.bench.random_tokens import random_twin
from tokenwire.cli_args import add_model_args, settings_from
from tokenwire.engine.factory import build_engine
from tokenwire.engine.request import GenerateOptions, SamplingParams, TokenEvent
from tokenwire.protocols.evergreen.gen import evergreen_pb2 as pb
from tokenwire.protocols.evergreen.gen import evergreen_service_pb2 as spb
from tokenwire.protocols.evergreen.gen import evergreen_service_pb2_grpc as rpc
from tokenwire.protocols.evergreen.gen import tokenwire_evergreen_pb2 as twpb
from tokenwire.protocols.evergreen.servicer import add_to_server as SERVICE
from tokenwire.protocols.grpc_server import GrpcServer

EOT = "application/x-protobuf; type=EndOfTurn"


def _action(prompt_id: str, out_id: str, max_tokens: int, ignore_eos: bool = False) -> pb.Action:
    action = pb.Action(
        name="GENERATE",
        inputs=[pb.NamedParameter(name="prompt", id=prompt_id)],
        outputs=[pb.NamedParameter(name="response", id=out_id)],
    )
    action.configs.add().Pack(
        twpb.GenerateConfig(temperature=0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    )
    return action


def _leaf(
    nid: str, data: bytes, seq: int = 0, continued: bool = False, mimetype: str = "text/plain"
) -> pb.NodeFragment:
    chunk = pb.Chunk(data=data)
    if seq == 0:
        chunk.metadata.mimetype = mimetype
    return pb.NodeFragment(id=nid, seq=seq, continued=continued, chunk_fragment=chunk)


class Call:
    """One StartSession stream driven from the benchmark."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.queue: asyncio.Queue[spb.SessionMessage | None] = asyncio.Queue()
        self.call = rpc.EvergreenServiceStub(channel).StartSession(self._requests())
        self.iter = self.call.__aiter__()

    async def _requests(self) -> AsyncIterator[spb.SessionMessage]:
        while (m := await self.queue.get()) is not None:
            yield m

    def send(self, *fragments: pb.NodeFragment, actions: tuple[pb.Action, ...] = ()) -> None:
        self.queue.put_nowait(spb.SessionMessage(node_fragments=list(fragments), actions=list(actions)))

    async def first_and_final(self, node_id: str) -> tuple[float, int, str]:
        """Time of the first fragment of node_id, fragment count, text (waits for the final)."""
        first, count, text = 0.0, 0, b""
        async for message in self.iter:
            for f in message.node_fragments:
                if f.id != node_id:
                    continue
                if not count:
                    first = time.perf_counter()
                count += 1
                text += f.chunk_fragment.data
                if not f.continued:
                    return first, count, text.decode()
        raise RuntimeError("session ended early")

    async def close(self) -> None:
        self.queue.put_nowait(None)
        async for _ in self.iter:
            pass


async def ttft(channel: grpc.aio.Channel, words: int, chunks: int, interval: float, streamed: bool) -> float:
    text = f"Note {uuid.uuid4().hex}. " + " ".join(
        f"fact{i % 97} is about jam and doughnuts." for i in range(words // 6)
    )
    step = -(-len(text) // chunks)
    pieces = [text[i : i + step].encode() for i in range(0, len(text), step)]
    call = Call(channel)
    call.send(actions=(_action("p", "r", 1),))
    call.send(pb.NodeFragment(id="p", child_ids=["body", "eot"]), _leaf("eot", b"", mimetype=EOT))
    for seq, piece in enumerate(pieces):
        await asyncio.sleep(interval)  # the producer makes the next chunk
        if streamed:
            call.send(_leaf("body", piece, seq, seq < len(pieces) - 1))
    ready = time.perf_counter()
    if not streamed:
        call.send(_leaf("body", b"".join(pieces)))
    first, _, _ = await call.first_and_final("r")
    await call.close()
    return first - ready


async def turn2(channel: grpc.aio.Channel, engine: Any, words: int) -> tuple[float, int]:
    call = Call(channel)
    text = f"Note {uuid.uuid4().hex}. " + " ".join(
        f"fact{i % 89} concerns an F1 race." for i in range(words // 6)
    )
    call.send(actions=(_action("p1", "r1", 16),))
    call.send(_leaf("p1", text.encode()))
    await call.first_and_final("r1")
    before = engine.stats()["computed_tokens"]
    start = time.perf_counter()
    call.send(actions=(_action("p2", "r2", 1),))
    call.send(pb.NodeFragment(id="p2", child_ids=["p1", "r1", "q2"]), _leaf("q2", b"Who's winning?"))
    first, _, _ = await call.first_and_final("r2")
    computed = engine.stats()["computed_tokens"] - before
    await call.close()
    return first - start, computed


async def per_token_evergreen(channel: grpc.aio.Channel, tokens: int) -> float:
    call = Call(channel)
    call.send(_leaf("p", b"Tell me a story."), actions=(_action("p", "r", tokens, ignore_eos=True),))
    first, count, _ = await call.first_and_final("r")
    end = time.perf_counter()
    await call.close()
    return (end - first) / max(count - 2, 1)  # between the first and the final fragment


async def per_token_engine(engine: Any, tokens: int) -> float:
    """The same generation read straight from the engine (no protocol): what is not overhead."""
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": "Tell me a story."}])
    options = GenerateOptions(max_tokens=tokens, ignore_eos=True, sampling=SamplingParams(temperature=0))
    first, count = 0.0, 0
    async for event in engine.generate(None, prompt, options):
        if isinstance(event, TokenEvent) and not event.is_prefill:
            if not count:
                first = time.perf_counter()
            count += 1
    return (time.perf_counter() - first) / max(count - 1, 1)


class EchoServicer(rpc.EvergreenServiceServicer):
    """A bare grpc.aio bidi echo: every client message straight back, nothing else."""

    async def StartSession(self, request_iterator, context):
        async for message in request_iterator:
            yield message


async def per_token_echo(channel: grpc.aio.Channel, tokens: int) -> float:
    call = rpc.EvergreenServiceStub(channel).StartSession()
    message = spb.SessionMessage(node_fragments=[_leaf("r", b" tok", 1, True, "")])
    start = time.perf_counter()

    async def writer() -> None:
        for _ in range(tokens):
            await call.write(message)
        await call.done_writing()

    task = asyncio.create_task(writer())
    received = 0
    async for _ in call:
        received += 1
    await task
    return (time.perf_counter() - start) / max(received, 1)


def _median(values: list[float]) -> float:
    return statistics.median(values)


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    engine = build_engine(settings_from(args, progress=False))
    results: dict[str, Any] = {"model": engine.name}
    ns = argparse.Namespace(evergreen_max_tokens=16)
    server = await GrpcServer(engine, ns, "127.0.0.1", 0, services=[SERVICE]).start()
    no_reuse = await GrpcServer(
        engine, argparse.Namespace(evergreen_reuse=False), "127.0.0.1", 0, services=[SERVICE]
    ).start()
    random_engine = random_twin(engine, name="random")
    random_server = await GrpcServer(random_engine, ns, "127.0.0.1", 0, services=[SERVICE]).start()
    echo = grpc.aio.server()
    rpc.add_EvergreenServiceServicer_to_server(EchoServicer(), echo)
    echo_port = echo.add_insecure_port("127.0.0.1:0")
    await echo.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
            streamed, whole = [], []
            for _ in range(args.repeats):
                streamed.append(await ttft(ch, args.prompt_words, 20, args.chunk_interval, True))
                whole.append(await ttft(ch, args.prompt_words, 20, args.chunk_interval, False))
            reuse = [await turn2(ch, engine, args.prompt_words) for _ in range(args.repeats)]
        async with grpc.aio.insecure_channel(f"127.0.0.1:{no_reuse.port}") as ch:
            fresh = [await turn2(ch, engine, args.prompt_words) for _ in range(args.repeats)]
        async with grpc.aio.insecure_channel(f"127.0.0.1:{random_server.port}") as ch:
            await per_token_evergreen(ch, 20)  # warm-up
            ours, alone = [], []
            for _ in range(args.repeats):  # interleaved, so machine load hits both alike
                ours.append(await per_token_evergreen(ch, args.tokens))
                alone.append(await per_token_engine(random_engine, args.tokens))
        async with grpc.aio.insecure_channel(f"127.0.0.1:{echo_port}") as ch:
            await per_token_echo(ch, 20)  # warm-up
            bare = [await per_token_echo(ch, args.tokens) for _ in range(args.repeats)]
    finally:
        await server.stop(0)
        await no_reuse.stop(0)
        await random_server.stop(0)
        await echo.stop(0)
        random_engine.shutdown()
        engine.shutdown()
    results["ttft_s"] = {"streamed_action_first": _median(streamed), "whole_after_action": _median(whole)}
    results["turn2"] = {
        "reuse": {
            "ttft_s": _median([r[0] for r in reuse]),
            "computed_tokens": _median([r[1] for r in reuse]),
        },
        "no_reuse": {
            "ttft_s": _median([r[0] for r in fresh]),
            "computed_tokens": _median([r[1] for r in fresh]),
        },
    }
    results["per_token_us"] = {
        "evergreen_random_model": _median(ours) * 1e6,
        "engine_alone_random_model": _median(alone) * 1e6,
        "evergreen_overhead": _median([a - b for a, b in zip(ours, alone, strict=True)]) * 1e6,
        "bare_grpc_echo": _median(bare) * 1e6,
    }
    return results


def run_evergreen_bench(args: argparse.Namespace) -> int:
    r = asyncio.run(_run(args))
    t, t2, pt = r["ttft_s"], r["turn2"], r["per_token_us"]
    ratios = {
        "ttft_whole_over_streamed": t["whole_after_action"] / t["streamed_action_first"],
        "turn2_ttft_no_reuse_over_reuse": t2["no_reuse"]["ttft_s"] / t2["reuse"]["ttft_s"],
        "turn2_computed_no_reuse_over_reuse": t2["no_reuse"]["computed_tokens"]
        / max(t2["reuse"]["computed_tokens"], 1),
        "per_token_overhead_over_echo": pt["evergreen_overhead"] / pt["bare_grpc_echo"],
    }
    r["ratios"] = ratios
    if args.json:
        print(json.dumps(r, indent=2))
        return 0
    print(
        f"Evergreen bench ({r['model']}, {args.prompt_words} words, "
        f"20 chunks every {args.chunk_interval * 1000:.0f} ms, "
        f"{args.tokens} tokens, median of {args.repeats})"
    )
    rows = [
        ("TTFT after last chunk, streamed, action first", f"{t['streamed_action_first'] * 1000:.1f} ms"),
        ("TTFT after last chunk, whole prompt after action", f"{t['whole_after_action'] * 1000:.1f} ms"),
        ("  ratio whole / streamed", f"{ratios['ttft_whole_over_streamed']:.2f}x"),
        ("turn-2 TTFT, reuse (same session)", f"{t2['reuse']['ttft_s'] * 1000:.1f} ms"),
        ("turn-2 TTFT, no reuse (fresh, prefix cache off)", f"{t2['no_reuse']['ttft_s'] * 1000:.1f} ms"),
        ("turn-2 positions computed, reuse", f"{t2['reuse']['computed_tokens']:.0f}"),
        ("turn-2 positions computed, no reuse", f"{t2['no_reuse']['computed_tokens']:.0f}"),
        ("per-token, Evergreen GENERATE (no-model backend)", f"{pt['evergreen_random_model']:.0f} us"),
        ("per-token, the same engine read directly", f"{pt['engine_alone_random_model']:.0f} us"),
        ("per-token Evergreen overhead (median difference)", f"{pt['evergreen_overhead']:.0f} us"),
        ("per-token, bare grpc.aio bidi echo", f"{pt['bare_grpc_echo']:.0f} us"),
        ("  ratio overhead / echo (target <= 2)", f"{ratios['per_token_overhead_over_echo']:.2f}x"),
    ]
    width = max(len(a) for a, _ in rows)
    for a, b in rows:
        print(f"{a:<{width}}  {b:>10}")
    return 0


def register(bench_sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]

    p = bench_sub.add_parser(
        "evergreen", help="Evergreen: streamed-chain TTFT, turn-2 reuse, per-token overhead"
    )
    add_model_args(p)
    p.add_argument("--prompt-words", type=int, default=600, help="long prompt size in words")
    p.add_argument("--chunk-interval", type=float, default=0.03, help="seconds between produced chunks")
    p.add_argument("--tokens", type=int, default=200, help="tokens for the per-token measurement")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=run_evergreen_bench)
