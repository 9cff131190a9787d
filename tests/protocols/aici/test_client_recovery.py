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
