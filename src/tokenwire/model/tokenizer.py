"""Tokenizer: a thin, fast wrapper around the model's own Hugging Face (tokenizers-backed) tokenizer.

Besides encode/decode it knows the raw bytes of every token (for streaming and constrained
decoding) and offers an IncrementalDecoder that turns a token stream into text, holding back a
multi-byte UTF-8 character until all of its bytes have arrived.
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Iterable, Mapping
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenwire.errors import InvalidRequestError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

    from tokenwire.model.config import ModelConfig

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: printable stand-in character -> byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def _decoder_types(hf: PreTrainedTokenizerFast) -> list[dict[str, Any]]:
    decoder = hf.backend_tokenizer.decoder
    if decoder is None:
        return []
    spec = json.loads(decoder.__getstate__())
    return spec.get("decoders", [spec]) if spec.get("type") == "Sequence" else [spec]


def _names_the_generic_class(model_dir: Path) -> bool:
    """Whether the directory's tokenizer is transformers' generic tokenizers-backed class, as
    every GGUF's conversion writes it: AutoTokenizer then loads that same class, but resolving
    it imports every model's registry on the way (683 modules; SmolLM2's load peaked 66 MiB
    higher). Anything else (a named class, remote code, Mistral's own files) goes through
    AutoTokenizer."""
    try:
        config = json.loads((model_dir / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return False
    generic = config.get("tokenizer_class") in ("PreTrainedTokenizerFast", "TokenizersBackend")
    mistral = any(model_dir.glob("tekken*.json")) or any(model_dir.glob("tokenizer.model*"))
    return generic and "auto_map" not in config and not mistral


class Tokenizer:
    def __init__(
        self,
        hf: PreTrainedTokenizerFast,
        *,
        eos_token_ids: Iterable[int] = (),
        bos_token_id: int | None = None,
    ) -> None:
        self.hf = hf
        self.vocab_size: int = len(hf)
        eos = [*eos_token_ids, *([hf.eos_token_id] if hf.eos_token_id is not None else [])]
        self.eos_token_ids: list[int] = list(dict.fromkeys(int(e) for e in eos))
        self.bos_token_id: int | None = hf.bos_token_id if hf.bos_token_id is not None else bos_token_id
        self.special_token_ids: frozenset[int] = frozenset(
            i for i, tok in hf.added_tokens_decoder.items() if tok.special
        )
        decoders = _decoder_types(hf)
        kinds = {d.get("type") for d in decoders}
        self._byte_level = "ByteLevel" in kinds
        self._byte_fallback = "ByteFallback" in kinds
        self._metaspace = "Metaspace" in kinds or any(
            d.get("type") == "Replace" and d.get("content") == " " for d in decoders
        )
        # Llama-2-style decoders drop the space sentencepiece puts before the first word.
        self._strip_first_space = any(
            (d.get("type") == "Strip" and d.get("content") == " " and d.get("start", 0) > 0)
            or (d.get("type") == "Metaspace" and d.get("prepend_scheme", "always") != "never")
            for d in decoders
        )

    @classmethod
    def from_dir(cls, model_dir: Path, config: ModelConfig | None = None) -> Tokenizer:
        """Load the tokenizer of an HF model directory, offline. EOS ids come from config.json,
        generation_config.json and the tokenizer itself."""
        # local: transformers takes seconds to import; the protocols' clients use this module without it
        import transformers

        model_dir = Path(model_dir)
        # transformers.AutoTokenizer's name alone imports its registry of every model
        loader = transformers.PreTrainedTokenizerFast if _names_the_generic_class(model_dir) else None
        try:
            hf = (loader or transformers.AutoTokenizer).from_pretrained(str(model_dir), local_files_only=True)
        except Exception as e:
            raise ValueError(f"cannot load the tokenizer in {model_dir}: {e}") from e
        if not isinstance(hf, transformers.PreTrainedTokenizerFast):
            raise ValueError(f"tokenizer in {model_dir} is not tokenizers-backed (fast): {type(hf).__name__}")
        eos = list(config.eos_token_ids) if config else []
        gen = model_dir / "generation_config.json"
        if gen.is_file():
            try:
                value = json.loads(gen.read_text()).get("eos_token_id")
            except (OSError, ValueError):
                value = None
            eos += [value] if isinstance(value, int) else list(value or [])
        return cls(hf, eos_token_ids=eos, bos_token_id=config.bos_token_id if config else None)

    # -- text <-> ids ---------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        try:
            return list(self.hf.encode(text, add_special_tokens=add_special_tokens))
        except TypeError:
            check_text(text, "text")
            raise

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        # No clean-up of spaces, so a decode equals what an IncrementalDecoder streams out.
        return self.hf.decode(
            list(ids), skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
        )

    # -- raw token bytes -------------------------------------------------------------------------

    @cached_property
    def _token_bytes(self) -> list[bytes]:
        tokens = self.hf.convert_ids_to_tokens(list(range(self.vocab_size)))
        added = {i: tok.content for i, tok in self.hf.added_tokens_decoder.items()}
        byte_of = _byte_decoder()
        table: list[bytes] = []
        for i, tok in enumerate(tokens):
            if i in added:  # added/special tokens decode to their literal text
                table.append(added[i].encode())
            elif tok is None:
                table.append(b"")
            elif self._byte_level:
                table.append(b"".join(bytes([byte_of[c]]) if c in byte_of else c.encode() for c in tok))
            elif self._byte_fallback and (m := _BYTE_TOKEN.fullmatch(tok)):
                table.append(bytes([int(m.group(1), 16)]))
            elif self._metaspace:
                table.append(tok.replace("\u2581", " ").encode())
            else:
                table.append(self.hf.decode([i], clean_up_tokenization_spaces=False).encode())
        return table

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes token `token_id` stands for (special tokens: their text, UTF-8 encoded).

        Ids past the tokenizer's vocabulary (padding rows of a larger embedding) give b""."""
        table = self._token_bytes
        return table[token_id] if 0 <= token_id < len(table) else b""

    def all_token_bytes(self) -> list[bytes]:
        """token_bytes for every id in 0 .. vocab_size - 1 (a shared list: do not modify)."""
        return self._token_bytes

    def incremental_decoder(self, skip_special_tokens: bool = False) -> IncrementalDecoder:
        return IncrementalDecoder(self, skip_special_tokens=skip_special_tokens)

    # -- chat ------------------------------------------------------------------------------------

    @property
    def has_chat_template(self) -> bool:
        return bool(self.hf.chat_template)

    def chat_prompt(
        self, messages: list[Mapping[str, Any]], add_generation_prompt: bool = True, **template_kwargs: Any
    ) -> str:
        """The chat template rendered to text."""
        if not self.has_chat_template:
            raise ValueError("this model's tokenizer has no chat template")
        return self.hf.apply_chat_template(
            [dict(m) for m in messages],
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            **template_kwargs,
        )

    def apply_chat_template(
        self, messages: list[Mapping[str, Any]], add_generation_prompt: bool = True, **template_kwargs: Any
    ) -> list[int]:
        """Token ids of the rendered chat template. The template writes any BOS itself, so no
        special tokens are added on top (as transformers does with tokenize=True)."""
        prompt = self.chat_prompt(messages, add_generation_prompt, **template_kwargs)
        return self.encode(prompt, add_special_tokens=False)


class IncrementalDecoder:
    """Feed token ids one at a time; each call returns the text completed by that token.

    Bytes of a UTF-8 character split across tokens are held back until the character is whole;
    invalid bytes become U+FFFD as in a full decode. The concatenated output equals
    `tokenizer.decode(ids, skip_special_tokens)` (plus `flush()` for a dangling partial character).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False) -> None:
        self._tokenizer = tokenizer
        self._skip = tokenizer.special_token_ids if skip_special_tokens else frozenset()
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self._strip_first_space = tokenizer._strip_first_space
        self._started = False

    def feed(self, token_id: int) -> str:
        if token_id in self._skip:
            return ""
        return self._emit(self._utf8.decode(self._tokenizer.token_bytes(token_id)))

    def feed_many(self, token_ids: Iterable[int]) -> str:
        return "".join(self.feed(t) for t in token_ids)

    def flush(self) -> str:
        """Text still held back (an incomplete character, as U+FFFD); resets the byte buffer."""
        return self._emit(self._utf8.decode(b"", final=True))

    def _emit(self, text: str) -> str:
        if text and not self._started:
            self._started = True
            if self._strip_first_space and text.startswith(" "):
                text = text[1:]
        return text


Tokenizer.IncrementalDecoder = IncrementalDecoder  # type: ignore[attr-defined]


def check_text(text: object, what: str) -> None:
    """Found by the fuzzer: a lone UTF-16 surrogate (JSON `"\\ud800"`) in a prompt made the
    tokenizer raise a bare TypeError (an HTTP 500); it is the client's error, named as such."""
    if isinstance(text, str):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InvalidRequestError(
                f"{what} is not valid Unicode: a lone UTF-16 surrogate at character {exc.start}"
            ) from None
