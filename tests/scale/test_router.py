"""The router and the session table without Ray; `--replicas 0` imports no Ray."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tokenwire.scale.directory import SessionTable
from tokenwire.scale.router import KV_WEIGHT, Router, prefix_keys


def test_new_sessions_go_to_the_least_loaded_live_replica() -> None:
    router = Router(3, prefix_aware=False)
    router.report(0, tokens=300, free_blocks=100, total_blocks=100, sessions=0)
    router.report(1, tokens=100, free_blocks=100, total_blocks=100, sessions=0)
    router.report(2, tokens=200, free_blocks=100, total_blocks=100, sessions=0)
    assert router.place().replica == 1
    router.dispatched(1, 250)  # what this router sent since the report counts at once
    assert router.place().replica == 2
    router.set_up(2, False)
    assert router.place().replica == 0
    router.finished(1, 250)
    assert router.place().replica == 1
    for r in range(3):
        router.set_up(r, False)
    with pytest.raises(LookupError, match="no replica is up"):
        router.place()


def test_fuller_kv_cache_and_open_sessions_break_ties() -> None:
    router = Router(2, prefix_aware=False)
    router.report(0, tokens=10, free_blocks=10, total_blocks=100, sessions=0)  # 90% used
    router.report(1, tokens=10, free_blocks=90, total_blocks=100, sessions=0)
    assert router.place().replica == 1
    router.report(0, tokens=10 + KV_WEIGHT / 2, free_blocks=100, total_blocks=100, sessions=0)
    router.report(1, tokens=10, free_blocks=0, total_blocks=100, sessions=0)  # a full KV cache
    assert router.place().replica == 0  # counts as KV_WEIGHT tokens of load
    # idle sessions spread: each opened session counts on its replica until the next report
    router = Router(2, prefix_aware=False)
    picks = []
    for _ in range(6):
        r = router.place().replica
        router.opened(r)
        picks.append(r)
    assert picks == [0, 1, 0, 1, 0, 1]


def test_prefix_aware_placement_follows_the_longest_prefix_within_the_slack() -> None:
    system = list(range(100, 164))  # 4 blocks of 16 tokens
    router = Router(4, prefix_aware=True, balance_slack=100)
    first = router.place(prefix_keys([*system, 1, 2, 3]))
    assert not first.prefix_hit
    router.dispatched(first.replica, 50)  # busier than the others, within the slack
    again = router.place(prefix_keys([*system, 4, 5, 6]))
    assert again.prefix_hit and again.replica == first.replica
    router.dispatched(first.replica, 500)  # past the slack: load wins over the cached prefix
    far = router.place(prefix_keys([*system, 7]))
    assert not far.prefix_hit and far.replica != first.replica
    blind = Router(4, prefix_aware=False)
    blind.place(prefix_keys(system))
    blind.dispatched(0, 50)
    assert not blind.place(prefix_keys(system)).prefix_hit


def test_a_lost_replica_forgets_its_prefixes() -> None:
    router = Router(2, prefix_aware=True)
    keys = prefix_keys(list(range(32)))
    placed = router.place(keys).replica
    router.set_up(placed, False)
    router.set_up(placed, True)
    router.dispatched(placed, 1)  # a hit would now be taken within the slack, if remembered
    assert not router.place(keys).prefix_hit


def test_prefix_keys_are_chained_per_block() -> None:
    a = prefix_keys(list(range(40)))
    b = prefix_keys(list(range(32)) + [9] * 8)
    assert len(a) == 2 and a == b  # only full blocks; the partial third block is not a key
    c = prefix_keys([0, *list(range(1, 40))])
    assert c == a
    d = prefix_keys([5, *list(range(1, 40))])
    assert d[0] != a[0] and d[1] != a[1]  # a different first block changes every later key


def test_session_table_records_replica_and_incarnation() -> None:
    table = SessionTable()
    table.assign("s1", 3, "inc-a")
    table.assign("s2", 3, "inc-a")
    table.assign("s3", 700, "inc-b")
    assert table.lookup("s1") == (3, "inc-a") and table.lookup("s3") == (700, "inc-b")
    assert table.lookup("nope") is None
    assert table.per_replica() == {3: 2, 700: 1}
    assert table.forget(["s2", "nope"]) == 1 and len(table) == 2
    assert table.remove("s1") and not table.remove("s1")


def test_replicas_zero_imports_no_ray() -> None:
    code = (
        "import sys\n"
        "from tokenwire.cli import build_parser\n"
        "import tokenwire.server, tokenwire.scale.serve, tokenwire.scale.status_cmd\n"
        "args = build_parser(['serve']).parse_args(['serve'])\n"
        "assert args.replicas == 0, args.replicas\n"
        "tokenwire.scale.serve.check_scale_args(args)\n"
        "import tokenwire.engine.factory\n"
        "bad = sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.'))\n"
        "assert not bad, bad\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--replicas", "-1"], "--replicas must be >= 0, got -1"),
        (["--replicas", "2", "--replica-cpus", "-0.5"], "--replica-cpus must be >= 0"),
        (["--ray-address", "127.0.0.1:6379"], "--ray-address needs --replicas N"),
    ],
)
def test_bad_scale_flags_fail_before_anything_loads(flags: list[str], message: str) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "tokenwire.cli", "serve", "--metrics-port", "0", "--lmtp-port", "0",
         "--grpc-port", "0", "--graphpipe-port", "0", "--http-port", "0", *flags],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr[-2000:]
    assert message in out.stderr
    assert "loading" not in out.stderr  # refused before the model
