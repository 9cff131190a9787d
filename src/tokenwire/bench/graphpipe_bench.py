"""`tokenwire bench graphpipe`: our GraphPipe server against the alternatives, in one run.

One ONNX MLP (calibrated to about 2 ms per single-row call in onnxruntime, 2 intra-op
threads) served three ways and driven by the same load generator (asyncio + aiohttp, one
request = one row, `concurrency` requests in flight):
  (a) tokenwire: aiohttp server, zero-copy codec, dynamic batching, a lone request run inline
      (subprocess, default options);
  (b) http.server: Python's ThreadingHTTPServer (HTTP/1.1 keep-alive) with Oracle's
      `graphpipe.convert` for the flatbuffers, what a graphpipe-py user would write (subprocess);
  (c) in-process: onnxruntime `session.run` one request at a time (the unbatched limit),
      measured before and after the servers, the better run kept.
Plus the codec: encode / decode GB/s of a 64 MB float32 tensor against a plain memory copy.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import aiohttp
import flatbuffers
import numpy as np
import onnxruntime as ort

from tokenwire.protocols.graphpipe.client import build_request, read_outputs
from tokenwire.protocols.graphpipe.codec import decode_infer_response, encode_infer_response
from tokenwire.protocols.graphpipe.models.onnx_model import OnnxModel, session_options
from tokenwire.protocols.graphpipe.server import GraphPipeServer

WIDTH = 1024


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("graphpipe", help="GraphPipe server vs http.server+graphpipe-py vs onnxruntime")
    p.add_argument("--duration", type=float, default=3.0, help="seconds per measurement")
    p.add_argument("--concurrency", default="1,16", help="comma-separated client concurrencies")
    p.add_argument("--target-ms", type=float, default=2.0, help="single-row onnxruntime cost to calibrate to")
    p.add_argument("--codec-mb", type=int, default=64, help="tensor size for the codec figures")
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=run_bench)


# ------------------------------------------------------------------ the model
def build_mlp(path: Path, depth: int, width: int = WIDTH) -> Path:
    # local: onnx is a dev extra; only this bench's model builder needs it
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    nodes, inits, prev = [], [], "x"
    for i in range(depth):
        w = (rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32)
        inits.append(numpy_helper.from_array(w, f"w{i}"))
        nodes.append(helper.make_node("MatMul", [prev, f"w{i}"], [f"m{i}"]))
        nodes.append(helper.make_node("Relu", [f"m{i}"], ["y" if i == depth - 1 else f"h{i}"]))
        prev = f"h{i}"
    graph = helper.make_graph(
        nodes,
        "bench_mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", width])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", width])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def _session(path: Path) -> Any:
    return ort.InferenceSession(
        # the in-process baseline alone on the machine: onnxruntime's default (spinning) pool
        str(path),
        sess_options=session_options(2, spin_us=None),
        providers=["CPUExecutionProvider"],
    )


def _single_row_ms(path: Path) -> float:
    session = _session(path)
    x = np.ones((1, WIDTH), np.float32)
    for _ in range(20):
        session.run(["y"], {"x": x})
    times = []
    for _ in range(100):
        t = time.perf_counter()
        session.run(["y"], {"x": x})
        times.append(time.perf_counter() - t)
    return float(np.percentile(times, 25)) * 1000  # low quantile: robust to other load on the machine


def calibrate(workdir: Path, target_ms: float) -> tuple[Path, int, float]:
    depth = 8
    path = build_mlp(workdir / "mlp.onnx", depth)
    ms = _single_row_ms(path)
    depth = max(1, round(depth * target_ms / ms))
    path = build_mlp(workdir / "mlp.onnx", depth)
    return path, depth, _single_row_ms(path)


# ------------------------------------------------------------------ servers (subprocesses)
def _serve_tokenwire(path: str, conn: Any) -> None:
    async def main() -> None:
        executor = ThreadPoolExecutor(max_workers=2)
        server = GraphPipeServer([OnnxModel("mlp", path, executor)], "127.0.0.1", 0, executor=executor)
        await server.start()
        conn.send(server.port)
        await asyncio.Event().wait()

    asyncio.run(main())


def _serve_http_server(path: str, conn: Any) -> None:
    # local: Oracle's graphpipe package is this bench's baseline only (the Makefile installs it)
    from graphpipe import convert
    from graphpipe.graphpipefb import InferResponse

    session = _session(Path(path))

    def infer_response(outputs: list[np.ndarray]) -> bytes:
        # convert.serialize_infer_response in graphpipe 1.0.4 writes a broken `errors` vector
        # (its length is the number of tensors, with no elements), which its own client then
        # misreads; a user has to assemble the response from convert.make_tensor instead
        builder = flatbuffers.Builder(sum(o.nbytes for o in outputs) + 1024)
        tensors = [convert.make_tensor(builder, o) for o in outputs[::-1]]
        InferResponse.InferResponseStartOutputTensorsVector(builder, len(tensors))
        for t in tensors:
            builder.PrependUOffsetTRelative(t)
        vec = builder.EndVector()
        InferResponse.InferResponseStart(builder)
        InferResponse.InferResponseAddOutputTensors(builder, vec)
        return bytes(convert.output(builder, InferResponse.InferResponseEnd(builder)))

    class Handler(BaseHTTPRequestHandler):
        # keep-alive and no Nagle delay (headers and body go out in two writes), as fair to
        # this baseline as we can be
        protocol_version = "HTTP/1.1"
        disable_nagle_algorithm = True

        def do_POST(self) -> None:
            body = bytearray(self.rfile.read(int(self.headers["Content-Length"])))
            req = convert.deserialize_request(body)
            outputs = session.run(["y"], {"x": req.input_tensors[0]})
            data = infer_response(outputs)
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    conn.send(server.server_address[1])
    server.serve_forever()


def _start(target: Callable[[str, Any], None], path: Path) -> tuple[Any, int]:
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(str(path), child), daemon=True)
    proc.start()
    if not parent.poll(120):
        proc.kill()
        raise RuntimeError(f"{target.__name__} did not start")
    return proc, parent.recv()


# ------------------------------------------------------------------ load generation
def _summary(latencies: list[float], elapsed: float) -> dict[str, float]:
    lat = np.array(latencies) * 1000
    return {
        "req_s": len(latencies) / elapsed,
        "p50_ms": float(np.percentile(lat, 50)),
        "p99_ms": float(np.percentile(lat, 99)),
        "requests": len(latencies),
    }


async def _drive(url: str, concurrency: int, duration: float) -> dict[str, float]:
    rng = np.random.default_rng(1)
    bodies = [bytes(build_request([rng.standard_normal((1, WIDTH)).astype(np.float32)], None, None, None))]
    latencies: list[float] = []
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def one(body: bytes) -> float:
            t = time.perf_counter()
            async with session.post(url, data=body) as answer:
                outputs = read_outputs(answer.status, await answer.read())
            assert outputs[0].shape == (1, WIDTH)
            return time.perf_counter() - t

        for _ in range(3 * concurrency):  # warm-up: connections, first calls
            await one(bodies[0])
        stop = time.perf_counter() + duration
        start = time.perf_counter()

        async def worker() -> None:
            while time.perf_counter() < stop:
                latencies.append(await one(bodies[0]))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
    return _summary(latencies, elapsed)


def _in_process(path: Path, duration: float) -> dict[str, float]:
    session = _session(path)
    x = np.random.default_rng(1).standard_normal((1, WIDTH)).astype(np.float32)
    for _ in range(20):
        session.run(["y"], {"x": x})
    latencies = []
    start = time.perf_counter()
    while time.perf_counter() - start < duration:
        t = time.perf_counter()
        session.run(["y"], {"x": x})
        latencies.append(time.perf_counter() - t)
    return _summary(latencies, time.perf_counter() - start)


# ------------------------------------------------------------------ codec
def _best_gbs(fn: Callable[[], object], nbytes: int, repeats: int = 7) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return nbytes / statistics.median(times) / 1e9


def codec_figures(mb: int) -> dict[str, float]:
    x = np.random.default_rng(0).standard_normal(mb * 2**20 // 4).astype(np.float32)
    body = bytes(encode_infer_response([x]))
    out = {
        "memcpy_gbs": _best_gbs(lambda: x.copy(), x.nbytes),
        "encode_gbs": _best_gbs(lambda: encode_infer_response([x]), x.nbytes),
        "decode_gbs": _best_gbs(lambda: decode_infer_response(body), x.nbytes),
    }
    try:
        # local: Oracle's graphpipe package, when installed (see _serve_http_server)
        from graphpipe import convert

        out["oracle_encode_gbs"] = _best_gbs(lambda: convert.serialize_tensor(x), x.nbytes)
        out["oracle_decode_gbs"] = _best_gbs(
            lambda: convert.deserialize_tensor(convert.serialize_tensor(x)), x.nbytes
        )
    except ImportError:
        pass
    out["encode_vs_memcpy"] = out["encode_gbs"] / out["memcpy_gbs"]
    return out


# ------------------------------------------------------------------ main
def run_bench(args: argparse.Namespace) -> int:
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    results: dict[str, Any] = {"concurrency": concurrencies}
    with tempfile.TemporaryDirectory() as tmp:
        path, depth, ms = calibrate(Path(tmp), args.target_ms)
        results["model"] = {"depth": depth, "width": WIDTH, "single_row_ms": ms}
        before = _in_process(path, args.duration)
        for name, target in (("tokenwire", _serve_tokenwire), ("http_server", _serve_http_server)):
            proc, port = _start(target, path)
            try:
                url = f"http://127.0.0.1:{port}/" + ("mlp" if name == "tokenwire" else "")
                results[name] = {str(c): asyncio.run(_drive(url, c, args.duration)) for c in concurrencies}
            finally:
                proc.kill()
                proc.join(10)
        # measured before and after the servers; the better run is the baseline (the machine
        # may be shared, and a slow baseline would flatter the ratios)
        after = _in_process(path, args.duration)
        results["in_process"] = max(before, after, key=lambda s: s["req_s"])
    results["codec"] = codec_figures(args.codec_mb)
    base = results["in_process"]["req_s"]
    results["ratios_vs_in_process"] = {
        name: {str(c): results[name][str(c)]["req_s"] / base for c in concurrencies}
        for name in ("tokenwire", "http_server")
    }
    if args.json:
        print(json.dumps(results, indent=1))
    else:
        print(format_table(results))
    return 0


def format_table(r: dict[str, Any]) -> str:
    m = r["model"]
    lines = [
        f"ONNX MLP: {m['depth']} x MatMul {m['width']}x{m['width']} + Relu, "
        f"{m['single_row_ms']:.2f} ms per single-row call (onnxruntime, 2 threads)",
        "",
        f"{'server':<28}{'conc':>6}{'req/s':>10}{'p50 ms':>9}{'p99 ms':>9}{'vs in-proc':>12}",
    ]
    ip = r["in_process"]
    row = f"{ip['req_s']:>10.0f}{ip['p50_ms']:>9.2f}{ip['p99_ms']:>9.2f}"
    lines.append(f"{'(c) onnxruntime in-process':<28}{1:>6}{row}{1.0:>11.2f}x")
    for name, label in (("tokenwire", "(a) tokenwire"), ("http_server", "(b) http.server+graphpipe-py")):
        for c in r["concurrency"]:
            s = r[name][str(c)]
            ratio = r["ratios_vs_in_process"][name][str(c)]
            lines.append(
                f"{label:<28}{c:>6}{s['req_s']:>10.0f}{s['p50_ms']:>9.2f}{s['p99_ms']:>9.2f}{ratio:>11.2f}x"
            )
    cd = r["codec"]
    lines += [
        "",
        "codec, 64 MB float32 tensor (GB/s, median of 7):",
        f"  memcpy (x.copy())        {cd['memcpy_gbs']:8.2f}",
        f"  encode InferResponse     {cd['encode_gbs']:8.2f}  ({cd['encode_vs_memcpy']:.0%} of memcpy)",
        f"  decode InferResponse     {cd['decode_gbs']:8.1f}  (zero-copy view)",
    ]
    if "oracle_encode_gbs" in cd:
        lines.append(f"  graphpipe.convert encode {cd['oracle_encode_gbs']:8.2f}")
        lines.append(f"  graphpipe.convert enc+dec{cd['oracle_decode_gbs']:8.2f}")
    return "\n".join(lines)
