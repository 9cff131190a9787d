"""The engine's end of the channels recovers from a caller that stopped waiting: a side-channel
reply to a cancelled call does not end the reader thread, and a main-channel reply that comes
after its command timed out is not taken as the answer to the next command."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tokenwire.protocols.aici.client import AiciClient, AiciError
from tokenwire.protocols.aici.engine_bridge import Coordinator


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AiciClient]:
    client = AiciClient(runtime_args=[f"--store-dir={tmp_path_factory.mktemp('aici-client')}"])
    yield client
    client.close()


def test_side_replies_to_cancelled_calls_leave_the_reader_running(client: AiciClient) -> None:
    for _ in range(5):
        client.side_future("get_tags").cancel()  # the caller gave up before the reply came
    time.sleep(0.5)  # the replies arrive for nobody
    assert client._reader.is_alive()
    assert "tags" in client.side("get_tags", timeout=10)


def test_a_reply_after_its_command_timed_out_is_not_the_next_ones(client: AiciClient) -> None:
    pid = client.proc.pid
    os.kill(pid, signal.SIGSTOP)  # the runtime stops answering for a while
    try:
        with pytest.raises(AiciError, match="no reply to 'ping'"):
            client.main({"op": "ping"}, timeout=1.0)
    finally:
        os.kill(pid, signal.SIGCONT)
    state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    assert state != "T"
    # the late pong is skipped: each command gets its own reply again
    assert client.main({"op": "tokens"}, timeout=10)["vocab_size"] == client.vocab_size
    assert client.main({"op": "ping"}, timeout=10) == {"pong": 1}


def test_a_controller_of_a_run_that_is_gone_is_dropped_by_the_runtime(client: AiciClient) -> None:
    """Instantiated, then its run refused or cancelled before a round assigned it: the
    Coordinator assigns it in one round and frees it in the next, so the runtime holds no
    controller for it (its req_id may be instantiated again) and no sequence is left."""
    coord = Coordinator(client, client.vocab_size)
    try:
        args = {"req_id": "gone-1", "prompt": [1], "module_id": "regex", "module_arg": "a"}
        assert not client.side("instantiate", timeout=30, **args).get("error")
        coord.drop_instance("gone-1")
        deadline = time.monotonic() + 10
        while coord.seqs or coord.rounds < 2:
            assert time.monotonic() < deadline, (coord.seqs, coord.rounds)
            time.sleep(0.01)
        with coord._lock:
            coord.wait_idle()
        reply = client.side("instantiate", timeout=30, **args)  # "already in use" if still held
        assert not reply.get("error"), reply
        coord.drop_instance("gone-1")
    finally:
        coord.close()
