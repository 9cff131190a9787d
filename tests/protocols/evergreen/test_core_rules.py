"""The sans-IO session core: every abort rule with its status, duplicates, late binding."""

from __future__ import annotations

import grpc
import pytest

from tests.protocols.evergreen.helpers import action, inner, leaf, message
from tokenwire.protocols.evergreen.core import ERROR_MIMETYPE, SessionCore
from tokenwire.protocols.evergreen.errors import SessionAbort
from tokenwire.protocols.evergreen.flatten import flatten
from tokenwire.protocols.evergreen.gen import tokenwire_evergreen_pb2 as twpb
from tokenwire.protocols.evergreen.nodes import SessionLimits

GEN = {"prompt": "p"}, {"response": "r"}


def core(**limits: int) -> SessionCore:
    return SessionCore({"tiny"}, SessionLimits(**limits))


def abort(c: SessionCore, *items) -> SessionAbort:
    with pytest.raises(SessionAbort) as info:
        for item in items:
            c.receive(message(item))
    return info.value


def test_duplicates_ignored_first_wins():
    c = core()
    c.receive(message(leaf("a", "first", continued=True)))
    effects = c.receive(message(leaf("a", "second", continued=True)))
    assert not effects.changed
    c.receive(message(leaf("a", " tail", seq=1, mimetype=None)))
    c.receive(message(leaf("a", " other tail", seq=1, mimetype=None)))
    flat = flatten(c.store, "a")
    assert flat.complete and flat.leaves[0].data == b"first tail"


def test_seq_1_may_repeat_seq_0_metadata_as_the_seeds_example_does():
    c = core()
    c.receive(message(leaf("v", "B", seq=1, mimetype="video/mp4")))
    c.receive(message(leaf("v", "A", mimetype="video/mp4", continued=True)))
    assert flatten(c.store, "v").leaves[0].data == b"AB"


def test_defaults_seq_0_and_final():
    c = core()
    c.receive(message(leaf("a", "x")))
    assert c.store.nodes["a"].complete


def test_late_binding_children_before_parents_and_out_of_order_seqs():
    c = core()
    c.receive(message(leaf("b", "B2", seq=1, mimetype=None)))
    c.receive(message(inner("root", "a", "b")))
    flat = flatten(c.store, "root")
    assert not flat.complete and flat.waiting_for == "a"
    c.receive(message(leaf("a", "A")))
    assert flatten(c.store, "root").waiting_for == "b"
    c.receive(message(leaf("b", "B1", continued=True)))
    flat = flatten(c.store, "root")
    assert flat.complete and [leaf_.data for leaf_ in flat.leaves] == [b"A", b"B1B2"]


def test_shared_node_in_two_parents():
    c = core()
    c.receive(message(leaf("s", "S"), inner("x", "s", "s"), inner("y", "x", "s")))
    assert [leaf_.data for leaf_ in flatten(c.store, "y").leaves] == [b"S", b"S", b"S"]


@pytest.mark.parametrize(
    ("items", "code", "words"),
    [
        (
            [leaf("a", "x", seq=1), leaf("a", "y", seq=2, mimetype=None)],
            "INVALID_ARGUMENT",
            "past the node's final seq",
        ),
        (
            [leaf("a", "y", seq=3, mimetype=None, continued=True), leaf("a", "x", seq=1, mimetype=None)],
            "INVALID_ARGUMENT",
            "past the node's final seq",
        ),
        (
            [leaf("a", "x", continued=True), leaf("a", "y", seq=1, mimetype="text/html")],
            "INVALID_ARGUMENT",
            "metadata on seq 1",
        ),
        (
            [leaf("a", "y", seq=1, mimetype="text/html"), leaf("a", "x", continued=True)],
            "INVALID_ARGUMENT",
            "metadata on seq 1",
        ),
        (
            [leaf("a", "x", mimetype=None)],
            "INVALID_ARGUMENT",
            "seq 0 of a leaf must carry the chunk metadata",
        ),
        (
            [inner("a", "b", continued=True), leaf("a", "y", seq=1, mimetype=None)],
            "INVALID_ARGUMENT",
            "exclusive",
        ),
        ([leaf("a", "x", continued=True), inner("a", "b", seq=1)], "INVALID_ARGUMENT", "exclusive"),
        ([inner("a", "b"), inner("b", "c"), inner("c", "a")], "INVALID_ARGUMENT", "cycle"),
        ([inner("a", "a")], "INVALID_ARGUMENT", "cycle"),
        ([leaf("a", "x", seq=-1)], "INVALID_ARGUMENT", "negative"),
        ([leaf("", "x")], "INVALID_ARGUMENT", "without an id"),
    ],
)
def test_node_rules(items, code, words):
    error = abort(core(), *items)
    assert error.code.name == code and words in error.message
    assert "'a'" in error.message or "id" in error.message


def test_both_child_ids_and_chunk_in_one_fragment():
    f = leaf("a", "x")
    f.child_ids.append("b")
    error = abort(core(), f)
    assert (
        error.code == grpc.StatusCode.INVALID_ARGUMENT
        and "both child_ids and chunk_fragment" in error.message
    )


def test_depth_limit():
    error = abort(core(max_depth=3), inner("a", "b"), inner("b", "c"), inner("c", "d"), inner("d", "e"))
    assert error.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_depth=3" in error.message


def test_depth_limit_counts_chains_joined_later():
    c = core(max_depth=3)
    c.receive(message(inner("c", "d"), inner("d", "e"), inner("a", "b")))
    error = abort(c, inner("b", "c"))
    assert "max_depth=3" in error.message and "'b'" in error.message


def test_node_count_limit():
    error = abort(core(max_nodes=3), *(leaf(f"n{i}", "x") for i in range(4)))
    assert (
        error.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        and "max_nodes=3" in error.message
        and "'n3'" in error.message
    )


def test_byte_limit():
    error = abort(core(max_bytes=100), leaf("a", "x" * 60), leaf("b", "y" * 60))
    assert (
        error.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        and "max_bytes=100" in error.message
        and "'b'" in error.message
    )


def test_action_limit():
    c = core(max_actions=1)
    c.receive(message(action("GENERATE", {"prompt": "p"}, {"response": "r1"})))
    error = abort(c, action("GENERATE", {"prompt": "p"}, {"response": "r2"}))
    assert error.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_actions=1" in error.message


@pytest.mark.parametrize(
    ("bad", "code", "words"),
    [
        (action("EXPLODE", {"prompt": "p"}), "UNIMPLEMENTED", "unknown action 'EXPLODE'"),
        (
            action("GENERATE", {"a": "p", "b": "q"}, {"response": "r"}),
            "INVALID_ARGUMENT",
            "exactly one input",
        ),
        (
            action("GENERATE", {"prompt": "p"}, {"video": "r"}),
            "INVALID_ARGUMENT",
            "unknown output name 'video'",
        ),
        (
            action("GENERATE", {"prompt": "p"}, {"response": "p"}),
            "INVALID_ARGUMENT",
            "output id 'p' is not new",
        ),
        (
            action("GENERATE", {"prompt": "p"}, {"response": "r"}, target="gpt-9"),
            "NOT_FOUND",
            "target 'gpt-9'",
        ),
        (
            action("GENERATE", {"prompt": "p"}, {"response": "r"}, [twpb.TtlConfig(ttl_seconds=1)]),
            "INVALID_ARGUMENT",
            "does not apply",
        ),
        (
            action("SCORE", {"prompt": "p"}, {"score": "r"}),
            "INVALID_ARGUMENT",
            "missing input 'continuation'",
        ),
        (action("SET_TTL", {"node": "p"}), "INVALID_ARGUMENT", "needs a tokenwire.evergreen.v1.TtlConfig"),
        (action("CANCEL", {"action": "nope"}), "NOT_FOUND", "no action has output 'nope'"),
        (action("DROP", {"node": "ghost"}), "NOT_FOUND", "node 'ghost' does not exist"),
    ],
)
def test_action_rules(bad, code, words):
    c = core()
    c.receive(message(leaf("p", "hello")))
    error = abort(c, bad)
    assert error.code.name == code and words in error.message
    assert bad.name in error.message  # names the action


def test_duplicate_parameter_name():
    a = action("GENERATE", {"prompt": "p"}, {"response": "r"})
    a.outputs.add(name="response", id="r2")
    error = abort(core(), a)
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT and "'response' used twice" in error.message


def test_unknown_config_type():
    a = action("GENERATE", {"prompt": "p"}, {"response": "r"})
    a.configs.add(type_url="type.googleapis.com/acme.Magic", value=b"")
    error = abort(core(), a)
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT and "acme.Magic" in error.message


def test_empty_target_and_own_model_are_accepted():
    c = core()
    c.receive(message(action("GENERATE", {"prompt": "p"}, {"response": "r1"}, target="")))
    c.receive(message(action("GENERATE", {"prompt": "p"}, {"response": "r2"}, target="tiny")))
    assert len(c.actions) == 2


def test_client_cannot_write_an_output_node():
    c = core()
    c.receive(message(action(*("GENERATE",), *GEN)))
    error = abort(c, leaf("r", "forged"))
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT and "only the server writes it" in error.message


def test_output_fragments_and_reuse_as_input():
    c = core()
    (state,) = c.receive(message(action("GENERATE", *GEN))).start
    first = c.emit(state, "response", b"Hel", [1, 2])
    last = c.emit(state, "response", b"lo", [3], final=True)
    assert first.seq == 0 and first.continued and first.chunk_fragment.metadata.mimetype == "text/plain"
    assert last.seq == 1 and not last.continued and not last.chunk_fragment.HasField("metadata")
    c.receive(message(inner("turn2", "p", "r")))
    c.receive(message(leaf("p", "hi")))
    flat = flatten(c.store, "turn2")
    assert (
        flat.complete and flat.leaves[1].token_ids == [1, 2, 3] and flat.leaves[1].produced_by == "GENERATE"
    )


def test_failure_aborts_without_partial_failures():
    c = core()
    (state,) = c.receive(message(action("GENERATE", *GEN))).start
    with pytest.raises(SessionAbort) as info:
        c.fail(state, SessionAbort(grpc.StatusCode.INVALID_ARGUMENT, "bad input"))
    assert "GENERATE(p) -> r" in info.value.message


def test_partial_failure_reports_error_chunk():
    c = core()
    c.receive(message(action("SET_SESSION_OPTIONS", configs=[twpb.SessionOptions(partial_failures=True)])))
    (state,) = c.receive(message(action("GENERATE", *GEN))).start
    (fragment,) = c.fail(state, SessionAbort(grpc.StatusCode.INVALID_ARGUMENT, "bad input"))
    assert fragment.chunk_fragment.metadata.mimetype == ERROR_MIMETYPE and not fragment.continued
    error = twpb.ActionError.FromString(fragment.chunk_fragment.data)
    assert (error.code_name, error.message, error.output_id) == ("INVALID_ARGUMENT", "bad input", "r")


def test_cancel_finalizes_outputs():
    c = core()
    (state,) = c.receive(message(action("GENERATE", *GEN))).start
    c.emit(state, "response", b"partial", [5])
    effects = c.receive(message(action("CANCEL", {"action": "r"})))
    assert effects.cancel == [state] and state.state == "cancelled"
    (final,) = effects.out
    assert final.id == "r" and final.seq == 1 and not final.continued
    assert c.emit(state, "response", b"late") is None  # nothing after the cancel


def test_drop_frees_and_forbids_reuse():
    c = core()
    c.receive(message(leaf("a", "x" * 50)))
    used = c.store.total_bytes
    effects = c.receive(message(action("DROP", {"node": "a"})))
    assert effects.dropped == ["a"] and c.store.total_bytes == used - 50 and "a" not in c.store.nodes
    error = abort(c, inner("p", "a"))
    assert error.code == grpc.StatusCode.NOT_FOUND and "dropped" in error.message
    error = abort(core(), leaf("a", "x"), action("DROP", {"node": "a"}), leaf("a", "y", seq=0))
    assert error.code == grpc.StatusCode.NOT_FOUND


def test_set_ttl_expires_node_and_descendants():
    c = core()
    c.receive(message(leaf("a", "x"), inner("p", "a"), leaf("keep", "k")))
    c.receive(message(action("SET_TTL", {"node": "p"}, configs=[twpb.TtlConfig(ttl_seconds=5)])), now=100.0)
    assert c.next_deadline() == 105.0
    assert c.expire(104.9).dropped == []
    assert sorted(c.expire(105.0).dropped) == ["a", "p"]
    assert "keep" in c.store.nodes and c.next_deadline() is None


def test_child_ids_per_session_are_capped_before_their_edges_are_checked():
    c = core(max_edges=5)
    c.receive(message(inner("a", "x", "y", "x")))  # a child listed twice counts twice (its bytes do)
    error = abort(c, inner("b", "x", "y", "z"))
    assert error.code == grpc.StatusCode.RESOURCE_EXHAUSTED, error
    assert (
        "max_edges=5" in error.message and "--evergreen-max-edges" in error.message and "'b'" in error.message
    )


def test_cycle_closed_under_a_graph_whose_heights_are_kept():
    """Heights are kept as edges arrive; a cycle raises them until the depth limit, where the
    graph is walked once to name it a cycle rather than a chain too deep."""
    c = core(max_depth=30)
    c.receive(message(inner("top", "a"), inner("a", "b"), inner("b", "c"), inner("side", "c")))
    error = abort(c, inner("c", "a"))
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT and "cycle" in error.message, error
