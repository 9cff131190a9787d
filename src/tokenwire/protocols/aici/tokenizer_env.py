"""`--tokenizer` resolution and the TokenizerEnv controllers see (tokenizer only, no weights)."""

from __future__ import annotations

from pathlib import Path

from transformers import PreTrainedTokenizerFast

from tokenwire.engine.grammar import lltokenizer_for
from tokenwire.model.loader import DEFAULT_MODEL_NAME, resolve_model
from tokenwire.model.tokenizer import Tokenizer
from tokenwire.protocols.aici.controller import TokenizerEnv

__all__ = ["env_for", "load_tokenizer"]


def load_tokenizer(spec: str) -> Tokenizer:
    """`default` (or the default model's served name), a model directory, a .gguf file or a
    tokenizer.json file. AICI's built-in names (llama, gpt4, ...) need files we do not ship."""
    if spec in ("default", DEFAULT_MODEL_NAME):
        return resolve_model(None).tokenizer
    path = Path(spec).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file():
            return resolve_model(path).tokenizer
        return Tokenizer.from_dir(path)
    if path.is_file() and path.suffix.lower() == ".gguf":
        return resolve_model(path).tokenizer
    if path.is_file() and path.suffix.lower() == ".json":
        return Tokenizer(PreTrainedTokenizerFast(tokenizer_file=str(path)))
    raise ValueError(
        f"unknown tokenizer {spec!r}: use 'default', {DEFAULT_MODEL_NAME!r}, a model directory, "
        "a .gguf file or a tokenizer.json file"
    )


def env_for(tokenizer: Tokenizer, vocab_size: int | None = None) -> TokenizerEnv:
    token_bytes = tokenizer.all_token_bytes()

    def detokenize(ids: list[int]) -> bytes:
        return b"".join(token_bytes[i] if 0 <= i < len(token_bytes) else b"" for i in ids)

    eos = tokenizer.eos_token_ids
    return TokenizerEnv(
        vocab_size=vocab_size or tokenizer.vocab_size,
        eos_token_id=eos[0] if eos else 0,
        token_bytes=token_bytes,
        tokenize=lambda text: tokenizer.encode(text, add_special_tokens=False),
        detokenize=detokenize,
        ll_tokenizer=lltokenizer_for(tokenizer.hf, eos or None),
    )
