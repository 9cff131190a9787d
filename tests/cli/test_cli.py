"""The `tokenwire` command: serve lifecycle, concepts build, model flags, errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.serve_process import kill_if_running, stop_cleanly, wait_ready
from tokenwire.engine.concepts import ConceptSet

CMD = [sys.executable, "-m", "tokenwire.cli"]
# the lifecycle test serves no protocol (tests/e2e/test_serve_all.py starts them all)
NO_PROTOCOLS = [
    *("--lmtp-port", "0", "--grpc-port", "0", "--graphpipe-port", "0", "--http-port", "0"),
    *("--metrics-port", "0"),
]


def test_serve_logs_and_stops_cleanly_on_sigterm() -> None:
    proc = subprocess.Popen(
        [*CMD, "serve", "--kv-cache-mb", "32", "--model-name", "smol", *NO_PROTOCOLS],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        log = wait_ready(proc, timeout=120)
        assert "model smol (LlamaForCausalLM)" in log and "weights gguf" in log, log
        # the default fp16 cache (quantised weights): twice fp32's 720 tokens in the same MiB
        assert "KV cache 32 MiB = 1456 tokens (91 blocks, fp16, 23040 bytes a token)" in log, log
        assert "tokenwire ready" in log and "(0 protocol servers)" in log, log
        stop_cleanly(proc)
    finally:
        kill_if_running(proc)


def test_unknown_model_path_is_a_clear_error(tmp_path) -> None:
    out = subprocess.run(
        [*CMD, "generate", "hi", "--model", str(tmp_path / "missing.gguf")], capture_output=True, text=True
    )
    assert out.returncode == 2
    assert "missing.gguf" in out.stderr


def test_unsupported_architecture_fails_at_load(tmp_path, smollm2_source) -> None:
    import json
    import shutil

    model_dir = tmp_path / "gpt2ish"
    shutil.copytree(smollm2_source.model_dir, model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (model_dir / "config.json").write_text(json.dumps(cfg))
    out = subprocess.run([*CMD, "generate", "hi", "--model", str(model_dir)], capture_output=True, text=True)
    assert out.returncode == 2 and "GPT2LMHeadModel" in out.stderr


@pytest.mark.parametrize("raw", [False, True])
def test_generate_with_hf_directory_and_regex(tiny_model_dir, raw: bool) -> None:
    args = [
        *CMD,
        "generate",
        "Give me a year.",
        "--model",
        str(tiny_model_dir),
        "--regex",
        "[12][0-9]{3}",
    ]
    out = subprocess.run(
        args + (["--raw"] if raw else []) + ["--seed", "1", "--kv-cache-mb", "32"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    text = out.stdout.strip()  # no <|im_end|>: special tokens are not text
    assert len(text) == 4 and text.isdigit() and text[0] in "12", out.stdout


def test_generate_prints_no_special_tokens_but_json_keeps_their_ids(smollm2_source) -> None:
    base = [*CMD, "generate", "Say hi.", "--temperature", "0", "--max-tokens", "40", "--kv-cache-mb", "32"]
    plain = subprocess.run(base, capture_output=True, text=True, timeout=300)
    assert plain.returncode == 0 and "<|" not in plain.stdout, plain.stdout
    events = [json.loads(line) for line in subprocess.run(
        [*base, "--json"], capture_output=True, text=True, timeout=300
    ).stdout.splitlines()]  # fmt: skip
    tokens, finish = events[:-1], events[-1]
    assert finish["reason"] == "eos" and tokens[-1]["id"] in smollm2_source.tokenizer.eos_token_ids
    assert tokens[-1]["text"] == ""  # the id is exact, the text has no markup
    special = subprocess.run([*base, "--special"], capture_output=True, text=True, timeout=300)
    assert special.stdout.rstrip().endswith("<|im_end|>"), special.stdout  # asked for


def test_a_cold_start_without_a_terminal_logs_conversion_and_load(tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TOKENWIRE_TOKENIZER_CACHE"}  # cold: no tokenizer
    out = subprocess.run(
        [*CMD, "generate", "Hi", "--max-tokens", "1", "--kv-cache-mb", "16", "--cache-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert out.returncode == 0, out.stderr
    assert "reading the tokenizer and config of " in out.stderr, out.stderr
    assert "first start only" in out.stderr, out.stderr
    assert "model files ready in" in out.stderr and "loading gguf weights" in out.stderr, out.stderr
    assert " loaded in " in out.stderr, out.stderr


def test_concepts_build_then_readouts(tmp_path) -> None:
    pos = tmp_path / "pos.txt"
    neg = tmp_path / "neg.txt"
    pos.write_text("I am so happy today!\nWhat a wonderful, joyful day.\n")
    neg.write_text("I am so sad today.\nWhat a terrible, miserable day.\n")
    out_file = tmp_path / "c.safetensors"
    out = subprocess.run(
        [
            *CMD,
            "concepts",
            "build",
            "--name",
            "joy",
            "--positive",
            str(pos),
            "--negative",
            str(neg),
            "--layers",
            "0,10,30",
            "-o",
            str(out_file),
            "--kv-cache-mb",
            "16",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    concepts = ConceptSet.load(out_file, hidden_size=576, num_layers=30)
    assert concepts.names == ["joy"] and concepts.layers == [0, 10, 30]
    assert concepts.vectors.shape == (3, 1, 576)

    from tokenwire.engine.factory import EngineSettings, build_engine
    from tokenwire.engine.request import GenerateOptions

    engine = build_engine(EngineSettings(progress=False, kv_cache_mb=16, concepts=out_file))
    try:

        def joy(text: str) -> float:
            tokens = engine.tokenizer.encode(text)
            opts = GenerateOptions(max_tokens=0, readout_ranges=[(0, len(tokens))])
            events, _ = engine.generate(None, tokens, opts).result()
            assert all(e.readout.shape == (3, 1) for e in events)
            return sum(float(e.readout[1, 0]) for e in events) / len(events)

        assert joy("Such a happy, joyful moment!") > joy("Such a sad, miserable moment.")
    finally:
        engine.shutdown()


def test_a_terminal_gets_one_start_up_bar_and_a_pipe_only_the_log_lines() -> None:
    import os
    import threading

    argv = [*CMD, "generate", "Hi", "--max-tokens", "1", "--kv-cache-mb", "16", "--temperature", "0"]
    import fcntl
    import struct
    import termios

    leader, follower = os.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a real size
    chunks: list[bytes] = []

    def drain() -> None:
        while True:
            try:
                data = os.read(leader, 65536)
            except OSError:  # the child closed its end
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        proc = subprocess.run(argv, stdout=subprocess.PIPE, stderr=follower, timeout=600)
    finally:
        os.close(follower)
    reader.join(10)
    os.close(leader)
    on_tty = b"".join(chunks).decode(errors="replace")
    assert proc.returncode == 0, on_tty
    assert "model files" in on_tty and "load + warm-up" in on_tty and "2/2" in on_tty, on_tty
    assert " loaded in " in on_tty  # the log lines stay
    piped = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert piped.returncode == 0, piped.stderr
    assert " loaded in " in piped.stderr and "load + warm-up" not in piped.stderr, piped.stderr
