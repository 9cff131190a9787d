"""Prometheus metrics: one registry for the whole server, exposed at /metrics.

`tokenwire serve` serves it on --metrics-port (default 9464); an HTTP protocol may mount it on
its own port with `exposition()`. Request metrics come from the engine (`watch_engine` hooks
every finished request, labelled with the protocol in its GenerateOptions.origin); the engine's
state (running and queued requests, KV blocks, prefix-cache hits, sessions) is read at scrape
time. The AICI runtime and GraphPipe's batcher observe their own histograms here.
"""

from __future__ import annotations

import itertools
import logging
import socket
import ssl
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from tokenwire.engine import threads as engine_threads
from tokenwire.logs import access_log
from tokenwire.protocols.http_site import start_site
from tokenwire.protocols.serving import SocketListener, Stopper, bind_tcp

if TYPE_CHECKING:
    from tokenwire.engine.engine import Engine
    from tokenwire.engine.request import FinishEvent, Request

log = logging.getLogger("tokenwire.metrics")
disable_created_metrics()  # no `_created` series beside every counter and histogram
REGISTRY = CollectorRegistry(auto_describe=True)

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
REQUESTS = Counter(
    "tokenwire_requests", "Finished generation requests", ["protocol", "outcome"], registry=REGISTRY
)
TTFT = Histogram(
    "tokenwire_time_to_first_token_seconds",
    "From a request's arrival in the engine to its first generated token",
    ["protocol"],
    buckets=_LATENCY,
    registry=REGISTRY,
)
ITL = Histogram(
    "tokenwire_inter_token_latency_seconds",
    "Between consecutive generated tokens of one request",
    ["protocol"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28),
    registry=REGISTRY,
)
PROMPT_TOKENS = Counter(
    "tokenwire_prompt_tokens", "Prompt tokens of finished requests", ["protocol"], registry=REGISTRY
)
GENERATED_TOKENS = Counter(
    "tokenwire_generated_tokens", "Generated tokens of finished requests", ["protocol"], registry=REGISTRY
)
AICI_ROUND = Histogram(
    "tokenwire_aici_round_seconds",
    "AICI runtime rounds (pre/mid/post of every sequence of a step), as the engine waits for them",
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0),
    registry=REGISTRY,
)
GRAPHPIPE_BATCH = Histogram(
    "tokenwire_graphpipe_batch_size",
    "Rows per merged GraphPipe model call",
    ["model"],
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
    registry=REGISTRY,
)


class EngineCollector:
    """The engine's state, read at each scrape."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        stats = self.engine.stats()
        yield GaugeMetricFamily("tokenwire_requests_running", "Requests being run", stats["running"])
        yield GaugeMetricFamily("tokenwire_requests_queued", "Requests awaiting admission", stats["waiting"])
        blocks = GaugeMetricFamily("tokenwire_kv_blocks", "KV cache blocks by state", labels=["state"])
        free = stats["kv_blocks_available"]
        blocks.add_metric(["used"], stats["kv_blocks_total"] - free)
        blocks.add_metric(["free"], free)
        yield blocks
        if "kv_window_blocks_total" in stats:  # sliding-window layers' own pool (KVCache.window_pool)
            window = GaugeMetricFamily(
                "tokenwire_kv_window_blocks", "Blocks of the sliding-window layers' KV pool by state",
                labels=["state"],
            )  # fmt: skip
            held = stats["kv_window_blocks_held"]
            window.add_metric(["used"], held)
            window.add_metric(["free"], stats["kv_window_blocks_total"] - held)
            yield window
        # the budget in tokens and bytes as stored (--kv-dtype): fp16 holds twice fp32's tokens
        tokens = GaugeMetricFamily(
            "tokenwire_kv_cache_tokens", "Positions the KV cache holds", labels=["kv_dtype"]
        )
        tokens.add_metric([stats["kv_dtype"]], stats["kv_tokens_total"])
        yield tokens
        stored = GaugeMetricFamily(
            "tokenwire_kv_cache_bytes", "Bytes of the KV cache as stored", labels=["kv_dtype"]
        )
        stored.add_metric([stats["kv_dtype"]], stats["kv_tokens_total"] * stats["kv_bytes_per_token"])
        yield stored
        yield CounterMetricFamily(
            "tokenwire_prefix_cache_hit_tokens",
            "Prompt tokens whose KV came from the prefix cache",
            stats["prefix_cache_hits"] * self.engine.kv.block_size,
        )
        yield GaugeMetricFamily("tokenwire_sessions_open", "Engine sessions alive", stats["sessions"])
        # prompt-lookup speculation (engine/speculation.py)
        yield CounterMetricFamily(
            "tokenwire_spec_proposed_tokens", "Guessed tokens run through the model", stats["spec_proposed"]
        )
        yield CounterMetricFamily(
            "tokenwire_spec_accepted_tokens", "Guessed tokens kept", stats["spec_accepted"]
        )
        verifications = stats["spec_verifications"]
        yield GaugeMetricFamily(
            "tokenwire_spec_tokens_per_verification",
            "Tokens a step with guesses produced, on average (1 = no guess kept)",
            (stats["spec_accepted"] + verifications) / verifications if verifications else 0.0,
        )
        if "sessions_persisted" in stats:  # --state-dir (engine/persistence.py)
            yield from persistence_metrics(stats)
        choice = engine_threads.current()
        if choice is not None:  # source: flag, env, affinity or cgroup (engine/threads.py)
            threads = GaugeMetricFamily(
                "tokenwire_engine_threads", "CPU threads of the engine's kernels", labels=["source"]
            )
            threads.add_metric([choice.source], choice.threads)
            yield threads


def persistence_metrics(stats: dict[str, Any]) -> Iterator[Metric]:
    """Sessions that outlive the process: what is persisted, the KV block files, their traffic."""
    yield GaugeMetricFamily(
        "tokenwire_sessions_persisted", "Sessions kept in the session store (--state-dir)",
        stats["sessions_persisted"],
    )  # fmt: skip
    yield GaugeMetricFamily("tokenwire_kv_disk_blocks", "KV blocks in block files", stats["kv_disk_blocks"])
    yield GaugeMetricFamily("tokenwire_kv_disk_bytes", "Bytes of the KV block files", stats["kv_disk_bytes"])
    for op, what in (("reads", "read back instead of computed"), ("writes", "written")):
        yield CounterMetricFamily(f"tokenwire_kv_disk_{op}", f"KV block files {what}", stats[f"kv_disk_{op}"])
        yield CounterMetricFamily(
            f"tokenwire_kv_disk_{op[:-1]}_bytes",
            f"Bytes of KV block files {what}",
            stats[f"kv_disk_{op[:-1]}_bytes"],
        )
    yield CounterMetricFamily(
        "tokenwire_kv_disk_corrupt", "KV block files that failed their checks (computed again)",
        stats["kv_disk_corrupt"],
    )  # fmt: skip
    yield CounterMetricFamily(
        "tokenwire_kv_disk_evicted_sessions", "Idle sessions whose KV files went for --state-max-gb",
        stats["kv_disk_evicted_sessions"],
    )  # fmt: skip
    yield CounterMetricFamily(
        "tokenwire_state_write_errors", "Writes to --state-dir the disk refused (full, read-only)",
        stats["state_write_errors"],
    )  # fmt: skip


_engine_collector: EngineCollector | None = None


def observe_request(request: Request, finish: FinishEvent) -> None:
    """The engine's on_finish hook: latency and token metrics, and the access log line."""
    session = None if request.session.ephemeral else request.session.id
    spec = request.speculator  # its guesses run and kept, where it guessed (engine/speculation.py)
    guesses = {} if spec is None else {"guesses": spec.proposed, "guesses_kept": spec.accepted}
    if request.disk_tokens:  # prompt positions whose KV was read from the block files (--state-dir)
        guesses["disk_kv_tokens"] = request.disk_tokens
    record_request(request.options.origin, finish, request.arrived, request.token_times, session, **guesses)


def record_request(
    origin: Any, finish: FinishEvent, arrived: float, times: list[float], session: str | None, **fields: Any
) -> None:
    """One finished request: its counters, TTFT and inter-token histograms (`times`: when each
    generated token came, on the clock of `arrived`) and its access log line (+ `fields`)."""
    protocol = origin.protocol if origin is not None else "engine"
    REQUESTS.labels(protocol, finish.reason).inc()
    PROMPT_TOKENS.labels(protocol).inc(finish.prompt_tokens)
    GENERATED_TOKENS.labels(protocol).inc(finish.completion_tokens)
    ttft = times[0] - arrived if times else None
    if ttft is not None:
        TTFT.labels(protocol).observe(ttft)
    if len(times) > 1:
        itl = ITL.labels(protocol)
        for earlier, later in itertools.pairwise(times):
            itl.observe(later - earlier)
    end = times[-1] if times else arrived
    access_log(
        protocol,
        origin.method if origin is not None else "generate",
        finish.reason,
        peer=origin.peer if origin is not None else None,
        session=session,
        prompt_tokens=finish.prompt_tokens,
        generated_tokens=finish.completion_tokens,
        ttft_s=ttft,
        duration_s=max(end, arrived) - arrived,
        error=finish.error,
        **fields,
    )


def watch_engine(engine: Engine) -> None:
    """Report this engine's requests and state (one engine per process)."""
    global _engine_collector
    if _engine_collector is not None:
        REGISTRY.unregister(_engine_collector)  # type: ignore[arg-type]
    _engine_collector = EngineCollector(engine)
    REGISTRY.register(_engine_collector)  # type: ignore[arg-type]
    engine.on_finish = observe_request


def requests_by_protocol() -> dict[str, int]:
    """Finished requests per protocol label (every outcome): the playground's engine panel."""
    counts: dict[str, int] = {}
    for metric in REQUESTS.collect():
        for sample in metric.samples:
            if sample.name.endswith("_total"):
                protocol = sample.labels["protocol"]
                counts[protocol] = counts.get(protocol, 0) + int(sample.value)
    return dict(sorted(counts.items()))


def exposition() -> tuple[bytes, str]:
    """The text exposition of every metric and its content type (for a /metrics route)."""
    return generate_latest(REGISTRY), CONTENT_TYPE_LATEST


def bind_metrics(host: str, port: int, ssl_context: ssl.SSLContext | None = None) -> SocketListener | None:
    """--metrics-port: bound with the protocols' ports, served once the engine is up (over TLS
    with --tls-cert; open without a token, like the health probes: counters only)."""
    if not port:
        return None
    return SocketListener(
        bind_tcp(host, port, "--metrics-port"), lambda e, s: _serve_metrics(e, s, ssl_context)
    )


async def _serve_metrics(engine: Engine, sock: socket.socket, ssl_context: ssl.SSLContext | None) -> Stopper:
    async def metrics(request: web.Request) -> web.Response:
        body, content_type = exposition()
        return web.Response(body=body, headers={"Content-Type": content_type})

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner, port = await start_site(app, "", 0, sock, ssl_context=ssl_context)
    scheme = "https" if ssl_context is not None else "http"
    log.info("Prometheus metrics on %s://%s:%d/metrics", scheme, sock.getsockname()[0], port)
    return runner.cleanup
