"""`tokenwire serve` settings: flag > $TOKENWIRE_<FLAG> > --config file > default."""

from __future__ import annotations

import argparse

import pytest

from tokenwire.config import config_defaults, env_name
from tokenwire.server import add_serve_args


def serve_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_serve_args(parser, argv)
    return parser


def parse(argv: list[str], monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> argparse.Namespace:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return serve_parser(argv).parse_args(argv)


def test_precedence_flag_env_file_default(tmp_path, monkeypatch) -> None:
    for name in ("TOKENWIRE_LMTP_PORT", "TOKENWIRE_KV_CACHE_MB", "TOKENWIRE_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    config = tmp_path / "tw.toml"
    config.write_text('lmtp-port = 1111\nkv_cache_mb = 64\nhost = "0.0.0.0"\n')
    file = ["--config", str(config)]
    assert parse([], monkeypatch, {}).lmtp_port == 8080  # default
    args = parse(file, monkeypatch, {})
    assert (args.lmtp_port, args.kv_cache_mb, args.host) == (1111, 64.0, "0.0.0.0")  # file
    args = parse(file, monkeypatch, {"TOKENWIRE_LMTP_PORT": "2222"})
    assert (args.lmtp_port, args.kv_cache_mb) == (2222, 64.0)  # env over file
    assert parse([*file, "--lmtp-port", "3333"], monkeypatch, {}).lmtp_port == 3333  # flag over env


def test_booleans_lists_and_the_config_from_the_environment(tmp_path, monkeypatch) -> None:
    config = tmp_path / "tw.toml"
    config.write_text('aici = true\nallow-ref-root = ["/a", "/b"]\n')
    args = parse([], monkeypatch, {"TOKENWIRE_CONFIG": str(config), "TOKENWIRE_NO_COMPILE": "yes"})
    assert args.aici is True and args.allow_ref_root == ["/a", "/b"] and args.compile is False
    monkeypatch.setenv("TOKENWIRE_ALLOW_REF_ROOT", "/c,/d")
    assert serve_parser([]).parse_args([]).allow_ref_root == ["/c", "/d"]


@pytest.mark.parametrize(
    ("text", "env", "message"),
    [
        ("frobnicate = 1\n", {}, "unknown setting 'frobnicate'"),
        ("lmtp-port = [1, 2]\n", {}, "expected a single value"),
        ("", {"TOKENWIRE_DTYPE": "fp8"}, "'fp8' is not one of fp32, bf16"),
        ("", {"TOKENWIRE_AICI": "maybe"}, "$TOKENWIRE_AICI: expected true or false"),
        ("lmtp-port = \n", {}, "not valid TOML"),
    ],
)
def test_bad_settings_name_where_they_came_from(tmp_path, monkeypatch, text, env, message) -> None:
    config = tmp_path / "tw.toml"
    config.write_text(text)
    parser = argparse.ArgumentParser()
    with pytest.raises(ValueError) as err:
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        add_serve_args(parser, ["--config", str(config)])
    assert message in str(err.value)


def test_env_names_follow_the_flags() -> None:
    assert env_name("--kv-cache-mb") == "TOKENWIRE_KV_CACHE_MB"
    assert env_name("cache-dir") == "TOKENWIRE_CACHE_DIR"  # the loader's own variable, same meaning
    parser = argparse.ArgumentParser()
    parser.add_argument("--graphpipe-port", type=int, default=9000)
    assert config_defaults(parser, [], {"TOKENWIRE_GRAPHPIPE_PORT": "0"}) == {"graphpipe_port": "0"}
