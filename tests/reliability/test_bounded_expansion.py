"""Issue 29: work is bounded before it starts. An Evergreen graph whose nodes share children
flattens to far more chunks than it has nodes (a chain of 30 diamonds: 31 nodes, 2^30 chunks);
every action that flattens its input measures the expansion first and refuses it with
RESOURCE_EXHAUSTED naming `--evergreen-max-flattened-chunks`, in well under a second and without
building any of it, and the server goes on serving."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from typing import Any

import grpc
import pytest

from tests.protocols.evergreen.helpers import action, inner, leaf
from tests.reliability.conftest import MODEL, Servers
from tokenwire.protocols.evergreen.gen import evergreen_pb2 as pb
from tokenwire.protocols.evergreen.gen import evergreen_service_pb2 as spb
from tokenwire.protocols.evergreen.gen import evergreen_service_pb2_grpc as spb_grpc

DEPTH = 30  # d0 .. d29 each list d{i+1} twice; d30 is a text leaf: 2^30 chunks


def rss_mib() -> float:
    with open("/proc/self/status") as status:  # the servers run in this process
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def diamond(prefix: str = "d", depth: int = DEPTH) -> list[pb.NodeFragment]:
    nodes = [inner(f"{prefix}{i}", f"{prefix}{i + 1}", f"{prefix}{i + 1}") for i in range(depth)]
    return [*nodes, leaf(f"{prefix}{depth}", "x")]


@pytest.fixture(scope="module")
def servers(engine: Any):
    servers = Servers(engine)
    yield servers
    servers.stop()


async def exchange(target: str, messages: list[spb.SessionMessage]) -> tuple[str, str]:
    """Send the messages on one StartSession stream; the session's final status (code, details)
    or the first fragment the server sends as ("OK", its data)."""
    async with grpc.aio.insecure_channel(target) as channel:
        call = spb_grpc.EvergreenServiceStub(channel).StartSession()
        for message in messages:
            await call.write(message)
        try:
            async for reply in call:
                for fragment in reply.node_fragments:
                    return "OK", fragment.chunk_fragment.data.decode(errors="replace")
        except grpc.aio.AioRpcError as exc:
            return exc.code().name, exc.details() or ""
        return "CLOSED", ""


def refuse(servers: Servers, messages: list[spb.SessionMessage]) -> tuple[str, str, float, float]:
    before = rss_mib()
    started = time.monotonic()
    code, details = asyncio.run(asyncio.wait_for(exchange(servers.url("grpc"), messages), 5))
    return code, details, time.monotonic() - started, rss_mib() - before


def answered_normally(servers: Servers) -> None:
    from tokenwire.protocols.evergreen.client import EvergreenSession

    async def run() -> int:
        async with await EvergreenSession.connect(servers.url("grpc")) as session:
            return await session.count_tokens("Hello there")

    assert asyncio.run(asyncio.wait_for(run(), 30)) > 0


def test_diamond_in_one_message_is_refused_at_once(servers: Servers) -> None:
    """The finding exactly: 31 nodes, depth 30, GENERATE(prompt=d0) in one SessionMessage."""
    message = spb.SessionMessage(
        node_fragments=diamond(),
        actions=[action("GENERATE", {"prompt": "d0"}, {"response": "out"})],
    )
    code, details, seconds, grown = refuse(servers, [message])
    assert code == "RESOURCE_EXHAUSTED", (code, details)
    assert "--evergreen-max-flattened-chunks" in details and str(2**DEPTH) in details, details
    assert seconds < 1.0, seconds
    assert grown < 50, f"RSS grew {grown:.0f} MiB"
    answered_normally(servers)


def test_diamond_assembled_over_several_messages_is_refused(servers: Servers) -> None:
    """The action arrives first and waits; the graph comes a few nodes per message, the leaf
    last: the expansion is measured again as it grows, refused before the leaf is read."""
    fragments = diamond("m")
    messages = [spb.SessionMessage(actions=[action("GENERATE", {"prompt": "m0"}, {"response": "o"})])]
    messages += [spb.SessionMessage(node_fragments=fragments[i : i + 4]) for i in range(0, len(fragments), 4)]
    code, details, seconds, grown = refuse(servers, messages)
    assert code == "RESOURCE_EXHAUSTED" and "max_flattened_chunks" in details, (code, details)
    assert seconds < 1.0 and grown < 50, (seconds, grown)
    answered_normally(servers)


@pytest.mark.parametrize("name, output", [("COUNT_TOKENS", "count"), ("TOKENIZE", "tokens")])
def test_diamond_refused_for_every_flattening_action(servers: Servers, name: str, output: str) -> None:
    shared = [leaf("big", "y"), *diamond("s", 20)[:-1], inner("s20", "big", "big")]  # 2^21 chunks
    message = spb.SessionMessage(node_fragments=shared, actions=[action(name, {"text": "s0"}, {output: "o"})])
    code, details, seconds, grown = refuse(servers, [message])
    assert code == "RESOURCE_EXHAUSTED" and "--evergreen-max-flattened-chunks" in details, (code, details)
    assert name in details and seconds < 1.0 and grown < 50, (details, seconds, grown)


def test_bytes_of_a_shared_leaf_count_every_time_it_is_used(servers: Servers) -> None:
    """Few chunks, many bytes: 1 MiB used 2^7 times flattens to 128 MiB, past --evergreen-max-bytes."""
    fragments = [*diamond("b", 7)[:-1], leaf("b7", b"z" * 2**20)]
    message = spb.SessionMessage(
        node_fragments=fragments, actions=[action("SCORE", {"continuation": "b0"}, {"score": "o"})]
    )
    code, details, seconds, _ = refuse(servers, [message])
    assert code == "RESOURCE_EXHAUSTED" and "--evergreen-max-bytes" in details, (code, details)
    assert seconds < 1.0
    answered_normally(servers)


def test_expansion_counts_shared_nodes_each_time_without_building() -> None:
    from tokenwire.protocols.evergreen.core import SessionCore
    from tokenwire.protocols.evergreen.errors import SessionAbort
    from tokenwire.protocols.evergreen.flatten import expansion, flatten
    from tokenwire.protocols.evergreen.nodes import SessionLimits

    core = SessionCore({"m"}, SessionLimits(max_depth=100))
    core.receive(spb.SessionMessage(node_fragments=[*diamond("d", 3), inner("top", "d0", "d3", "gone")]))
    started = time.monotonic()
    size = expansion(core.store, "top")
    assert (size.chunks, size.nbytes) == (2**3 + 1, 2**3 + 1)  # "gone" never arrived: empty
    assert [lv.id for lv in flatten(core.store, "d0").leaves] == ["d3"] * 8
    core.receive(spb.SessionMessage(node_fragments=diamond("e", 60)))  # 2^60: counted, not built
    assert expansion(core.store, "e0").chunks == 2**60 and time.monotonic() - started < 0.5
    with pytest.raises(SessionAbort, match="max_flattened_chunks=100000"):
        flatten(core.store, "e0")


LMTP_SENDER = """
import asyncio, json, sys, aiohttp
async def main():
    frame = 'GENERATE {"stream_id": 1, "model": "%s", "max_tokens": 2, "prompt": [%s1]}' % (
        sys.argv[2], "1, " * (int(sys.argv[3]) - 1))
    async with aiohttp.ClientSession() as session:
        async with session.ws_connect(sys.argv[1], max_msg_size=0, autoclose=False) as ws:
            try:
                await ws.send_str(frame)
            except ConnectionError:
                pass  # refused from its header: the server may close before the frame is sent
            del frame
            while True:
                msg = await ws.receive()
                if msg.type == aiohttp.WSMsgType.TEXT and msg.data.startswith("TOKEN"):
                    print(msg.data)
                    return
                if msg.type != aiohttp.WSMsgType.TEXT:
                    print("CLOSE " + json.dumps([msg.type.name, msg.data, msg.extra]))
                    return
asyncio.run(main())
"""


def send_lmtp_prompt(servers: Servers, ids: int) -> tuple[str, float]:
    """One GENERATE of `ids` token ids from another process (so this process's RSS is the
    server's); what came back (a TOKEN frame, or CLOSE [code, reason]) and the RSS growth."""
    before = rss_mib()
    sender = [sys.executable, "-c", LMTP_SENDER, servers.url("lmtp"), MODEL, str(ids)]
    reply = subprocess.run(sender, capture_output=True, text=True, timeout=60, check=True).stdout
    return reply, rss_mib() - before


def test_lmtp_prompt_of_ten_million_ids_is_refused_unread(servers: Servers) -> None:
    """Issue 29: one LMTP prompt of 10^7 token ids raised RSS ~110 MiB for good. The transport
    caps a message at 4x the model's frame budget (8.65 MB for the test model): the 30 MB frame
    is refused from its header, 1009 with a reason naming --max-model-len; the whole frame was
    received (+53 MiB) against the former 64 MiB cap."""
    reply, grown = send_lmtp_prompt(servers, 10**7)
    kind, _, body = reply.partition(" ")
    assert kind == "CLOSE", reply[:300]
    kind, code, reason = json.loads(body)
    assert (kind, code) == ("CLOSE", 1009) and "--max-model-len" in reason, reply
    assert grown < 50, f"RSS grew {grown:.0f} MiB"


def test_lmtp_prompt_over_the_frame_budget_gets_its_streams_error(servers: Servers) -> None:
    """10^6 ids (3 MB): over the frame budget, under the transport's cap: the error record of
    its stream naming --max-model-len, nothing parsed."""
    reply, grown = send_lmtp_prompt(servers, 10**6)
    record = json.loads(reply.partition(" ")[2])[0]
    assert record["stream_id"] == 1 and "--max-model-len" in record["error"], record
    assert grown < 50, f"RSS grew {grown:.0f} MiB"


def test_openai_prompt_of_token_ids_past_the_context_is_refused_before_the_id_check(servers: Servers) -> None:
    import openai

    client = openai.OpenAI(base_url=servers.url("http"), api_key="none", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt=[10**9] * 200_000, max_tokens=2)
    error = caught.value.body
    assert error["code"] == "context_length_exceeded" and "--max-model-len" in error["message"], error


def test_an_oversized_lmtp_frame_is_refused_on_its_stream_wherever_the_stream_id_is(engine: Any) -> None:
    """Our own client writes stream_id after the prompt: the refusal read unparsed must still
    find it (it was looked for in the first 4 KiB only, and the client waited forever)."""
    from tokenwire.protocols.lmtp.core import LmtpConnection

    for payload in (
        {"stream_id": 5, "model": MODEL, "prompt": [7] * 10**6, "max_tokens": 1},
        {"model": MODEL, "prompt": [7] * 10**6, "max_tokens": 1, "stream_id": 5},
    ):
        conn = LmtpConnection(engine, lambda handle, stream: None)
        try:
            conn.feed("GENERATE " + json.dumps(payload))
            (frame,) = conn.take_frames()
        finally:
            conn.close()
        (record,) = json.loads(frame.partition(" ")[2])
        assert record["stream_id"] == 5 and "refused unread" in record["error"], record


def layered(width: int, layers: int = 32) -> list[pb.NodeFragment]:
    """`layers` layers of `width` nodes, each node naming every node of the next: the most
    edges a depth-32 graph can have (width 56: 97,216 edges, under --evergreen-max-edges)."""
    rows = [[f"l{depth}_{i}" for i in range(width)] for depth in range(layers)]
    nodes = [inner(nid, *rows[depth + 1]) for depth in range(layers - 1) for nid in rows[depth]]
    return [*nodes, *(leaf(nid, "x") for nid in rows[-1])]


def hubs(parents: int = 9_900, count: int = 10, chain: int = 40) -> list[pb.NodeFragment]:
    """`parents` nodes each naming the same `count` hubs, then a chain grown under the hubs one
    edge at a time: every edge of the chain raises every parent's nesting height again."""
    names = [f"h{j}" for j in range(count)]
    fragments = [inner(f"p{i}", *names) for i in range(parents)]
    fragments += [inner(name, "c1") for name in names]
    return fragments + [inner(f"c{d}", f"c{d + 1}") for d in range(1, chain)]


@pytest.mark.parametrize(
    "fragments, code, words",
    [
        (layered(56), "OK", ""),  # accepted: 32 layers is within max_depth (31 edges deep)
        (layered(60), "RESOURCE_EXHAUSTED", "--evergreen-max-edges"),
        (hubs(), "RESOURCE_EXHAUSTED", "max_depth=32"),
        ([*hubs(chain=20), inner("c20", "p0")], "INVALID_ARGUMENT", "cycle"),
    ],
    ids=["layered-accepted", "layered-over-edges", "hubs-too-deep", "hubs-cycle"],
)
def test_the_worst_graph_under_the_limits_is_answered_at_once(
    servers: Servers, fragments: list[pb.NodeFragment], code: str, words: str
) -> None:
    """Each distinct edge cost a walk of the graph (cycle search, depth above, height below):
    12,400 edges in 32 layers held the event loop 15 s, 97,000 for hours. Heights are now kept
    as edges arrive and the child ids a session lists are capped: answered within a second."""
    last = fragments[-1].id  # a leaf when accepted: the action answers at once
    message = spb.SessionMessage(
        node_fragments=fragments, actions=[action("COUNT_TOKENS", {"text": last}, {"count": "o"})]
    )
    got, details, seconds, _ = refuse(servers, [message])
    assert got == code and words in details, (got, details)
    assert seconds < 1.0, f"answered in {seconds:.2f} s"
    answered_normally(servers)
