"""Issue 29: work is bounded before it starts. An Evergreen graph whose nodes share children
flattens to far more chunks than it has nodes (a chain of 30 diamonds: 31 nodes, 2^30 chunks);
every action that flattens its input measures the expansion first and refuses it with
RESOURCE_EXHAUSTED naming `--evergreen-max-flattened-chunks`, without building any of it, and
the server goes on serving. "At once" is asserted as work, never as time (a loaded machine is
slow, not wrong): the node totals the expansion measure makes, the leaves `flatten` builds, the
nesting heights `nodes.py` raises and the graph walks it does are counted (`Work`), and the
process's memory growth is bounded."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import tracemalloc
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest

from tests.protocols.evergreen.helpers import action, inner, leaf
from tests.reliability.conftest import MODEL, Servers
from tokenwire.protocols.evergreen.gen import evergreen_pb2 as pb
from tokenwire.protocols.evergreen.gen import evergreen_service_pb2 as spb
from tokenwire.protocols.evergreen.gen import evergreen_service_pb2_grpc as spb_grpc

DEPTH = 30  # d0 .. d29 each list d{i+1} twice; d30 is a text leaf: 2^30 chunks
MAX_DEPTH = 32  # the servers' --evergreen-max-depth (its default)


def rss_mib() -> float:
    with open("/proc/self/status") as status:  # the servers run in this process
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def diamond(prefix: str = "d", depth: int = DEPTH) -> list[pb.NodeFragment]:
    nodes = [inner(f"{prefix}{i}", f"{prefix}{i + 1}", f"{prefix}{i + 1}") for i in range(depth)]
    return [*nodes, leaf(f"{prefix}{depth}", "x")]


class Budget(AssertionError):
    """More work than the bound the test allows: raised where the work is done, so a regression
    to building the expansion fails at once instead of running for minutes."""


@dataclass
class Work:
    """What the Evergreen code did, counted: `totals` node totals made by the expansion measure
    (flatten.expansion: one per node it reaches, reused wherever the node is shared), `leaves`
    LeafViews built by flatten (the expansion itself), `visits` child lists read (every walk
    over the graph reads one per node it passes), `raised` nesting heights written by nodes.py
    (each node's at most max_depth times a session) and `walks` nodes.py's cycle searches (only
    when a chain meets the depth limit)."""

    totals: int = 0
    leaves: int = 0
    visits: int = 0
    raised: int = 0
    walks: int = 0
    budget: int = 10**6

    def count(self, what: str, n: int = 1) -> None:
        setattr(self, what, getattr(self, what) + n)
        if getattr(self, what) > self.budget:
            raise Budget(f"{what} passed {self.budget}: the expansion is being built, not counted")

    def reset(self) -> None:
        self.totals = self.leaves = self.visits = self.raised = self.walks = 0


@pytest.fixture
def work(monkeypatch: pytest.MonkeyPatch) -> Iterator[Work]:
    """Counts the Evergreen code's work in this process (the in-process servers' too) by
    wrapping what it builds; nothing of its behaviour changes."""
    from tokenwire.protocols.evergreen import flatten, nodes

    counted = Work()
    real_expansion, real_leaf = flatten.Expansion, flatten.LeafView

    def expansion(*args: Any) -> Any:
        counted.count("totals")
        return real_expansion(*args)

    def leaf_view(*args: Any) -> Any:
        counted.count("leaves")
        return real_leaf(*args)

    class Heights(dict):  # NodeStore.height: every write is one height raised
        def __setitem__(self, key: str, value: int) -> None:
            counted.count("raised")
            super().__setitem__(key, value)

    real_init, real_reaches = nodes.NodeStore.__init__, nodes.NodeStore._reaches
    real_children, real_all_children = nodes.Node.children, nodes.Node.all_children

    def init(self: Any, *args: Any, **kw: Any) -> None:
        real_init(self, *args, **kw)
        self.height = Heights(self.height)

    def reaches(self: Any, *args: Any) -> bool:
        counted.count("walks")
        return real_reaches(self, *args)

    def children(self: Any) -> list[str]:
        counted.count("visits")
        return real_children(self)

    def all_children(self: Any) -> list[str]:
        counted.count("visits")
        return real_all_children(self)

    monkeypatch.setattr(flatten, "Expansion", expansion)
    monkeypatch.setattr(nodes.Node, "children", children)
    monkeypatch.setattr(nodes.Node, "all_children", all_children)
    monkeypatch.setattr(flatten, "LeafView", leaf_view)
    monkeypatch.setattr(nodes.NodeStore, "__init__", init)
    monkeypatch.setattr(nodes.NodeStore, "_reaches", reaches)
    yield counted


def assert_measured_not_built(work: Work, nodes: int, measures: int = 1) -> None:
    """The refusal's work: at most `measures` expansion measures, each totalling every node once
    and reading an inner node's children at most twice (to push them, then to sum them); not a
    leaf of the expansion built; no node's nesting height raised more than max_depth times."""
    assert work.leaves == 0, work
    assert work.totals <= measures * nodes and work.visits <= measures * 2 * nodes, work
    assert work.raised <= MAX_DEPTH * nodes and work.walks == 0, work


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


def refuse(servers: Servers, messages: list[spb.SessionMessage]) -> tuple[str, str, float]:
    """The session's answer (code, details) and the process's RSS growth meanwhile, in MiB. The
    30 s is a hang guard only (the answer takes milliseconds); the work is counted by `Work`."""
    before = rss_mib()
    code, details = asyncio.run(asyncio.wait_for(exchange(servers.url("grpc"), messages), 30))
    return code, details, rss_mib() - before


def answered_normally(servers: Servers) -> None:
    from tokenwire.protocols.evergreen.client import EvergreenSession

    async def run() -> int:
        async with await EvergreenSession.connect(servers.url("grpc")) as session:
            return await session.count_tokens("Hello there")

    assert asyncio.run(asyncio.wait_for(run(), 30)) > 0


def test_diamond_in_one_message_is_refused_at_once(servers: Servers, work: Work) -> None:
    """The finding exactly: 31 nodes, depth 30, GENERATE(prompt=d0) in one SessionMessage."""
    message = spb.SessionMessage(
        node_fragments=diamond(),
        actions=[action("GENERATE", {"prompt": "d0"}, {"response": "out"})],
    )
    code, details, grown = refuse(servers, [message])
    assert code == "RESOURCE_EXHAUSTED", (code, details)
    assert "--evergreen-max-flattened-chunks" in details and str(2**DEPTH) in details, details
    assert_measured_not_built(work, nodes=DEPTH + 1)
    assert grown < 50, f"RSS grew {grown:.0f} MiB"
    answered_normally(servers)


def test_diamond_assembled_over_several_messages_is_refused(servers: Servers, work: Work) -> None:
    """The action arrives first and waits; the graph comes a few nodes per message, the leaf
    last: the expansion is measured again as it grows, refused before the leaf is read."""
    fragments = diamond("m")
    messages = [spb.SessionMessage(actions=[action("GENERATE", {"prompt": "m0"}, {"response": "o"})])]
    messages += [spb.SessionMessage(node_fragments=fragments[i : i + 4]) for i in range(0, len(fragments), 4)]
    code, details, grown = refuse(servers, messages)
    assert code == "RESOURCE_EXHAUSTED" and "max_flattened_chunks" in details, (code, details)
    assert_measured_not_built(work, nodes=DEPTH + 1, measures=len(messages))  # once a message at most
    assert grown < 50, f"RSS grew {grown:.0f} MiB"
    answered_normally(servers)


@pytest.mark.parametrize("name, output", [("COUNT_TOKENS", "count"), ("TOKENIZE", "tokens")])
def test_diamond_refused_for_every_flattening_action(
    servers: Servers, work: Work, name: str, output: str
) -> None:
    shared = [leaf("big", "y"), *diamond("s", 20)[:-1], inner("s20", "big", "big")]  # 2^21 chunks
    message = spb.SessionMessage(node_fragments=shared, actions=[action(name, {"text": "s0"}, {output: "o"})])
    code, details, grown = refuse(servers, [message])
    assert code == "RESOURCE_EXHAUSTED" and "--evergreen-max-flattened-chunks" in details, (code, details)
    assert name in details and grown < 50, (details, grown)
    assert_measured_not_built(work, nodes=len(shared))


def test_bytes_of_a_shared_leaf_count_every_time_it_is_used(servers: Servers, work: Work) -> None:
    """Few chunks, many bytes: 1 MiB used 2^7 times flattens to 128 MiB, past --evergreen-max-bytes."""
    fragments = [*diamond("b", 7)[:-1], leaf("b7", b"z" * 2**20)]
    message = spb.SessionMessage(
        node_fragments=fragments, actions=[action("SCORE", {"continuation": "b0"}, {"score": "o"})]
    )
    code, details, grown = refuse(servers, [message])
    assert code == "RESOURCE_EXHAUSTED" and "--evergreen-max-bytes" in details, (code, details)
    assert_measured_not_built(work, nodes=len(fragments))  # the 128 MiB never assembled
    assert grown < 50, f"RSS grew {grown:.0f} MiB"
    answered_normally(servers)


def test_expansion_counts_shared_nodes_each_time_without_building(work: Work) -> None:
    from tokenwire.protocols.evergreen.core import SessionCore
    from tokenwire.protocols.evergreen.errors import SessionAbort
    from tokenwire.protocols.evergreen.flatten import expansion, flatten
    from tokenwire.protocols.evergreen.nodes import SessionLimits

    work.budget = 10_000  # 2^60 chunks built, or walked path by path, passes this at once
    core = SessionCore({"m"}, SessionLimits(max_depth=100))
    core.receive(spb.SessionMessage(node_fragments=[*diamond("d", 3), inner("top", "d0", "d3", "gone")]))
    work.reset()
    size = expansion(core.store, "top")
    assert (size.chunks, size.nbytes) == (2**3 + 1, 2**3 + 1)  # "gone" never arrived: empty
    assert work.totals == 6, work  # top, d0 .. d3 and "gone": each node totalled once
    work.reset()
    assert [lv.id for lv in flatten(core.store, "d0").leaves] == ["d3"] * 8
    assert work.leaves == 8, work  # flatten builds what it returns: the shared leaf once a use
    core.receive(spb.SessionMessage(node_fragments=diamond("e", 60)))  # 2^60: counted, not built
    nodes = 61
    work.reset()
    tracemalloc.start()
    try:
        assert expansion(core.store, "e0").chunks == 2**60
        with pytest.raises(SessionAbort, match="max_flattened_chunks=100000"):
            flatten(core.store, "e0")  # measures again, then refuses
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # two measures: each totals every node once and reads an inner node's children at most
    # twice (once to push them, once to sum them); not one leaf was built
    assert work.totals == 2 * nodes and work.leaves == 0, work
    assert work.visits <= 2 * 2 * (nodes - 1), work
    assert peak < 2**20, f"traced peak {peak} bytes"


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
    servers: Servers, work: Work, fragments: list[pb.NodeFragment], code: str, words: str
) -> None:
    """Each distinct edge cost a walk of the graph (cycle search, depth above, height below):
    12,400 edges in 32 layers held the event loop 15 s, 97,000 for hours. Heights are now kept
    as edges arrive and the child ids a session lists are capped. Counted, not timed: each
    node's height raised at most max_depth times, and no graph walk but the one that tells a
    cycle from a chain too deep."""
    last = fragments[-1].id  # a leaf when accepted: the action answers at once
    message = spb.SessionMessage(
        node_fragments=fragments, actions=[action("COUNT_TOKENS", {"text": last}, {"count": "o"})]
    )
    got, details, _ = refuse(servers, [message])
    assert got == code and words in details, (got, details)
    nodes = len(fragments)  # one fragment a node
    assert work.raised <= MAX_DEPTH * nodes, work  # what edges cost: each height raised <= max_depth times
    assert work.walks <= 1 and work.visits <= nodes, work  # no walk per edge: one at most, at the limit
    answered_normally(servers)
