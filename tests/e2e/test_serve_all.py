"""`tokenwire serve` with every protocol on: each answers on its own port, then a clean stop."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import urllib.request

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tests.serve_process import kill_if_running, stop_cleanly, wait_ready
from tokenwire.bench.inprocess import free_ports


def _get_json(url: str) -> object:
    with urllib.request.urlopen(url, timeout=30) as response:
        assert response.status == 200
        return json.loads(response.read())


def _grpc_services(port: int) -> set[str]:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        check = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=30)
        assert check.status == health_pb2.HealthCheckResponse.SERVING
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        (reply,) = list(stub.ServerReflectionInfo(iter([request]), timeout=30))
        return {s.name for s in reply.list_services_response.service}


async def _lmtp_model_info(port: int) -> dict:
    from tokenwire.lmtp import Client

    async with await Client.connect(f"ws://127.0.0.1:{port}/") as client:
        return await client.model_info()


def test_serve_starts_every_protocol_and_stops_cleanly() -> None:
    lmtp, grpc_port, graphpipe, aici = free_ports(4)
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "tokenwire.cli", "serve", "--kv-cache-mb", "64",
            "--lmtp-port", str(lmtp), "--grpc-port", str(grpc_port),
            "--graphpipe-port", str(graphpipe), "--aici", "--aici-port", str(aici),
            "--http-port", "0", "--metrics-port", "0",
        ],
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        log = wait_ready(proc)
        assert "4 protocol servers" in log, log

        info = asyncio.run(asyncio.wait_for(_lmtp_model_info(lmtp), 60))
        assert info["model"] == "SmolLM2-135M-Instruct", info

        services = _grpc_services(grpc_port)
        assert {"salience.v1.Salience", "grpc.health.v1.Health"} <= services, services
        assert any(name.startswith("evergreen.v2.") for name in services), services

        metadata = _get_json(f"http://127.0.0.1:{graphpipe}/")
        assert isinstance(metadata, dict) and metadata.get("inputs"), metadata
        with urllib.request.urlopen(f"http://127.0.0.1:{graphpipe}/control/is_ready", timeout=30) as r:
            assert r.status == 200

        tags = _get_json(f"http://127.0.0.1:{aici}/v1/controllers/tags")
        assert "jsctrl-latest" in json.dumps(tags), tags

        stop_cleanly(proc)
    finally:
        kill_if_running(proc)
