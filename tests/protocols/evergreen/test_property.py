"""Property: any interleaving, reordering across nodes and duplication of a valid fragment stream
gives the same outputs. Runs the sans-IO core with a deterministic fake executor that, once an
action's input is complete, outputs the prompt tokens the real executor would prefill (the
PromptBuilder on the real tokenizer), checked against the chat template as an oracle."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.protocols.evergreen.helpers import EOT, action, inner, leaf, message
from tokenwire.protocols.evergreen.content import PromptBuilder
from tokenwire.protocols.evergreen.core import SessionCore
from tokenwire.protocols.evergreen.gen import evergreen_pb2 as pb

WORDS = st.lists(
    st.sampled_from(["jam", "doughnut", "hero", "F1", "race", "video", "Who", "is"]), min_size=1, max_size=6
)


@pytest.fixture(scope="module")
def builder(smollm2_source):
    return PromptBuilder(smollm2_source.tokenizer)


@st.composite
def streams(draw):
    """A valid fragment stream: root -> (groups streamed as root seqs) -> text leaves split in
    fragments, one leaf shared twice, an optional EndOfTurn; plus the expected user text."""
    n_leaves = draw(st.integers(1, 4))
    texts = [" ".join(draw(WORDS)) + " " for _ in range(n_leaves)]
    fragments: list[pb.NodeFragment] = []
    leaf_ids = []
    for i, text in enumerate(texts):
        data = text.encode()
        cuts = sorted(draw(st.sets(st.integers(1, max(1, len(data) - 1)), max_size=3)))
        pieces = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True) if b > a]
        for seq, piece in enumerate(pieces):
            fragments.append(
                leaf(
                    f"t{i}",
                    piece,
                    seq=seq,
                    continued=seq < len(pieces) - 1,
                    mimetype="text/plain" if seq == 0 else None,
                )
            )
        leaf_ids.append(f"t{i}")
    children = [*leaf_ids, "t0"]  # t0 shared: used twice
    eot = draw(st.booleans())
    if eot:
        fragments.append(leaf("eot", b"", mimetype=EOT))
        children.append("eot")
    split = draw(st.integers(1, len(children)))
    groups = [children[:split], children[split:]] if split < len(children) else [children]
    for seq, group in enumerate(groups):
        fragments.append(inner("root", *group, seq=seq, continued=seq < len(groups) - 1))
    expected_text = "".join(texts) + texts[0]
    return fragments, expected_text


def run(fragments: list[pb.NodeFragment], builder: PromptBuilder, action_first: bool) -> list[int]:
    core = SessionCore({"m"})
    actions = []
    outputs: dict[str, list[int]] = {}
    start = message(action("GENERATE", {"prompt": "root"}, {"response": "out"}))
    items = (
        ([start] if action_first else [])
        + [message(f) for f in fragments]
        + ([] if action_first else [start])
    )
    for item in items:
        actions += core.receive(item).start
        for state in actions:
            if state.running:
                flat = core.input(state)
                prompt = builder.build(flat, lambda uri: "", lambda uri: 0)
                if prompt.complete:
                    core.emit(state, "response", b"done", prompt.tokens, final=True)
                    core.finish(state)
                    outputs["out"] = list(core.store.nodes["out"].token_ids)
    return outputs["out"]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(streams(), st.data())
def test_any_order_and_duplication_gives_the_same_output(builder, stream, data):
    fragments, expected_text = stream
    in_order = run(fragments, builder, action_first=True)
    oracle = builder.tokenizer.apply_chat_template([{"role": "user", "content": expected_text}])
    assert in_order == oracle
    shuffled = data.draw(st.permutations(fragments))
    copies = data.draw(st.lists(st.sampled_from(fragments), max_size=6))
    mixed = list(shuffled)
    for copy in copies:
        mixed.insert(data.draw(st.integers(0, len(mixed))), copy)
    assert run(mixed, builder, action_first=data.draw(st.booleans())) == in_order
