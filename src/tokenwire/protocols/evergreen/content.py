"""Flattened chunks -> the token sequence the model sees, through the model's chat template.

Mapping (docs/evergreen.md has the full table):
* text/* (and application/x-latex, application/json) chunks are text. Consecutive text chunks
  of one turn are concatenated and tokenized together (chunk boundaries carry no meaning).
* ChunkMetadata.role opens a turn with that role (`model` is an alias of `assistant`). A
  chunk without a role continues the turn a client chunk opened, or else opens a `user` turn.
* Server outputs (earlier actions' output nodes) are `assistant` turns made of the exact
  tokens generated, so a later prompt that contains them extends the same token sequence.
* `application/x-protobuf; type=EndOfTurn` closes the open turn.
* At the end of a GENERATE input an open `assistant` turn is continued; otherwise the turn
  is closed and the template's generation prompt follows.
* video/* and audio/* refs or data are checked and measured (refs through the sandbox,
  streamed) and shown to this text-only model as a one-line attachment descriptor.
* image/png, image/jpeg, image/webp data, for a vision model, become the image's block
  `<|vision_start|> + N*<|image_pad|> + <|vision_end|>` inside the turn (N = the vision encoder's
  count for it) and the image is attached to those positions (Prompt.images); for a text-only
  model, and for every other mimetype, INVALID_ARGUMENT naming the mimetype.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable
from dataclasses import dataclass, field

from tokenwire.engine.api import EngineAPI
from tokenwire.engine.errors import InvalidRequestError
from tokenwire.engine.vision import ImageBlock, ImageInput
from tokenwire.model.images import IMAGE_MIMES
from tokenwire.model.tokenizer import Tokenizer
from tokenwire.protocols.evergreen.errors import invalid
from tokenwire.protocols.evergreen.flatten import Flattened, LeafView, Ref

END_OF_TURN = "application/x-protobuf; type=EndOfTurn"
TEXT_APPLICATION_TYPES = {"application/x-latex", "application/json"}
ROLES = {"user": "user", "system": "system", "assistant": "assistant", "model": "assistant"}
# Tokens at the end of a still-growing text run that may change when more text arrives
# (BPE merges across the boundary); they are prefilled only once the run is settled.
HOLDBACK_TOKENS = 2


def base_mimetype(mimetype: str) -> str:
    return mimetype.split(";", 1)[0].strip().lower()


def is_end_of_turn(mimetype: str) -> bool:
    return mimetype.replace(" ", "").lower() == END_OF_TURN.replace(" ", "").lower()


def is_text(mimetype: str) -> bool:
    base = base_mimetype(mimetype)
    return base.startswith("text/") or base in TEXT_APPLICATION_TYPES


@dataclass
class ChatLayout:
    """The chat template cut into pieces, found by rendering it around sentinel contents."""

    preamble: str  # before the first turn unless that turn is `system` (a default system prompt)
    headers: dict[str, str]
    footers: dict[str, str]
    generation: str  # the generation prompt (assistant header)

    @classmethod
    def plain(cls) -> ChatLayout:
        return cls(
            "",
            {r: "" for r in ("user", "system", "assistant")},
            {r: "" for r in ("user", "system", "assistant")},
            "",
        )

    @classmethod
    def from_tokenizer(cls, tokenizer: Tokenizer) -> ChatLayout:
        if not tokenizer.has_chat_template:
            return cls.plain()
        a, b = "\u2063AAAA\u2063", "\u2063BBBB\u2063"
        try:
            render = tokenizer.chat_prompt
            one = render([{"role": "user", "content": a}], add_generation_prompt=False)
            headers: dict[str, str] = {}
            footers: dict[str, str] = {}
            for role in ("user", "assistant"):
                two = render(
                    [{"role": "user", "content": a}, {"role": role, "content": b}],
                    add_generation_prompt=False,
                )
                assert two.startswith(one)
                headers[role], footers[role] = two[len(one) :].split(b)
            sys_only = render([{"role": "system", "content": b}], add_generation_prompt=False)
            headers["system"], footers["system"] = sys_only.split(b)
            before_user = one.split(a)[0]
            assert before_user.endswith(headers["user"])
            preamble = before_user[: len(before_user) - len(headers["user"])]
            generation = render([{"role": "user", "content": a}], add_generation_prompt=True)[len(one) :]
        except (AssertionError, ValueError, Exception):  # an unusual template: no chat layout
            return cls.plain()
        return cls(preamble, headers, footers, generation)


@dataclass
class Prompt:
    tokens: list[int]
    stable: int  # tokens[:stable] cannot change as more input arrives
    complete: bool
    images: list[ImageInput] = field(default_factory=list)  # attached to blocks of `tokens`


TextReader = Callable[[str], str]  # file:// ref -> its text (through the sandbox)
MediaMeter = Callable[[str], int]  # file:// ref -> its size in bytes (streamed)


class VisionBlock:
    """Image leaves as a vision model's image blocks (engine/vision.py's ImageBlock)."""

    def __init__(self, block: ImageBlock) -> None:
        self.block = block

    def tokens(self, leaf: LeafView) -> tuple[list[int], bytes, str]:
        base = base_mimetype(leaf.mimetype)
        if base not in IMAGE_MIMES:
            raise invalid(
                f"node {leaf.id!r}: mimetype {leaf.mimetype!r}: use image/png, image/jpeg or image/webp"
            )
        if any(isinstance(p, Ref) for p in leaf.parts):
            raise invalid(f"node {leaf.id!r}: image refs are not read; send the image as data")
        try:
            n = self.block.count(leaf.data, base)
        except InvalidRequestError as exc:
            raise invalid(f"node {leaf.id!r}: {exc}") from None
        return self.block.tokens(n), leaf.data, base


def vision_block(engine: EngineAPI) -> VisionBlock | None:
    """The engine's image blocks when it takes images, else None."""
    block = engine.image_block()
    return None if block is None else VisionBlock(block)


class PromptBuilder:
    def __init__(
        self, tokenizer: Tokenizer, layout: ChatLayout | None = None, vision: VisionBlock | None = None
    ) -> None:
        self.tokenizer = tokenizer
        self.layout = layout or ChatLayout.from_tokenizer(tokenizer)
        self.vision = vision
        self._piece_cache: dict[str, list[int]] = {}

    def _piece(self, text: str) -> list[int]:
        if text not in self._piece_cache:
            self._piece_cache[text] = self.tokenizer.encode(text, add_special_tokens=False) if text else []
        return self._piece_cache[text]

    def build(
        self, flat: Flattened, read_text: TextReader, measure: MediaMeter, *, for_generation: bool = True
    ) -> Prompt:
        turn = _TurnWriter(self)
        for leaf in flat.leaves:
            if not self._add_leaf(turn, leaf, read_text, measure):
                return turn.finish_partial()
        if not flat.complete:
            return turn.finish_partial()
        return turn.finish(for_generation)

    def _add_leaf(
        self, turn: _TurnWriter, leaf: LeafView, read_text: TextReader, measure: MediaMeter
    ) -> bool:
        """Adds what is known of the leaf; False when the rest must wait."""
        mimetype = leaf.mimetype
        if leaf.produced_by is not None:
            if is_end_of_turn(mimetype) or not is_text(mimetype):
                raise invalid(
                    f"node {leaf.id!r}: output of mimetype {mimetype!r} cannot be used as model input"
                )
            turn.server_tokens(leaf.token_ids)
            return leaf.complete
        role = ROLES.get(leaf.role) if leaf.role else None
        if leaf.role and role is None:
            raise invalid(f"node {leaf.id!r}: unknown role {leaf.role!r} (user, system, assistant, model)")
        if is_end_of_turn(mimetype):
            turn.close()
            return leaf.complete
        if is_text(mimetype):
            decoder = codecs.getincrementaldecoder("utf-8")()
            pieces: list[str] = []
            try:
                for part in leaf.parts:
                    if isinstance(part, Ref):
                        pieces.append(read_text(part.uri))
                    else:
                        pieces.append(decoder.decode(part))
                pieces.append(decoder.decode(b"", final=leaf.complete))
            except UnicodeDecodeError as exc:
                raise invalid(f"node {leaf.id!r}: {mimetype} data is not valid UTF-8 ({exc.reason})") from exc
            turn.client_text("".join(pieces), role)
            return leaf.complete
        base = base_mimetype(mimetype)
        if base.startswith(("video/", "audio/")):
            if not leaf.complete:
                return False
            size = sum(measure(p.uri) if isinstance(p, Ref) else len(p) for p in leaf.parts)
            name = f" {leaf.original_file_name}" if leaf.original_file_name else ""
            turn.client_text(f"[{base} attachment{name}: {size} bytes]", role)
            return True
        if base.startswith("image/") and self.vision is not None:
            if not leaf.complete:
                return False
            block, data, mime = self.vision.tokens(leaf)
            turn.client_image(block, data, mime, role)
            return True
        if base.startswith("image/"):
            raise invalid(f"node {leaf.id!r}: mimetype {mimetype!r}: images need a vision model")
        raise invalid(f"node {leaf.id!r}: unsupported mimetype {mimetype!r}")


class _TurnWriter:
    """Writes turns as tokens: template pieces, tokenized text runs and server tokens."""

    def __init__(self, builder: PromptBuilder) -> None:
        self.b = builder
        self.layout = builder.layout
        self.tokens: list[int] = []
        self.role: str | None = None
        self.opened_by_server = False
        self.started = False
        self.run = ""
        self.images: list[ImageInput] = []

    def _flush(self) -> None:
        if self.run:
            self.tokens += self.b.tokenizer.encode(self.run, add_special_tokens=False)
            self.run = ""

    def _open(self, role: str, by_server: bool) -> None:
        if not self.started:
            self.started = True
            if role != "system":
                self.tokens += self.b._piece(self.layout.preamble)
        self.tokens += self.b._piece(self.layout.headers[role])
        self.role = role
        self.opened_by_server = by_server

    def close(self) -> None:
        if self.role is not None:
            self._flush()
            self.tokens += self.b._piece(self.layout.footers[self.role])
            self.role = None

    def client_text(self, text: str, role: str | None) -> None:
        if role is None:
            if self.role is None or self.opened_by_server:
                self.close()
                self._open("user", by_server=False)
        elif role != self.role:
            self.close()
            self._open(role, by_server=False)
        self.run += text

    def client_image(self, block: list[int], data: bytes, mime: str, role: str | None) -> None:
        self.client_text("", role)  # opens the turn as text would
        self._flush()
        start = len(self.tokens)
        self.tokens += block
        self.images.append(ImageInput(start, start + len(block), data, mime))

    def server_tokens(self, token_ids: list[int]) -> None:
        if self.role != "assistant":
            self.close()
            self._open("assistant", by_server=True)
        self._flush()
        self.tokens += token_ids
        self.opened_by_server = True

    def finish_partial(self) -> Prompt:
        settled = len(self.tokens)
        run_tokens = self.b.tokenizer.encode(self.run, add_special_tokens=False) if self.run else []
        tokens = self.tokens + run_tokens
        return Prompt(tokens, settled + max(0, len(run_tokens) - HOLDBACK_TOKENS), False, self.images)

    def finish(self, for_generation: bool) -> Prompt:
        if for_generation and self.role == "assistant":
            self._flush()  # an open assistant turn at the end: the model continues it
        elif for_generation:
            self.close()
            if not self.started:
                self.tokens += self.b._piece(self.layout.preamble)
            self.tokens += self.b._piece(self.layout.generation)
        else:
            self._flush()
        return Prompt(self.tokens, len(self.tokens), True, self.images)


def count_plain(
    flat: Flattened, read_text: TextReader, tokenizer: Tokenizer, vision: VisionBlock | None
) -> int:
    """COUNT_TOKENS: the text runs' tokens plus, on a vision model, each image's whole block."""

    def text_tokens(leaves: list[LeafView]) -> int:
        text = plain_text(Flattened(leaves, True, None), read_text)
        return len(tokenizer.encode(text, add_special_tokens=False)) if text else 0

    run: list[LeafView] = []
    total = 0
    for leaf in flat.leaves:
        if base_mimetype(leaf.mimetype).startswith("image/") and vision is not None:
            total += text_tokens(run) + len(vision.tokens(leaf)[0])
            run = []
        else:
            run.append(leaf)
    return total + text_tokens(run)


def plain_text(flat: Flattened, read_text: TextReader) -> str:
    """The text of a node's text chunks, concatenated (TOKENIZE, COUNT_TOKENS: no template)."""
    out: list[str] = []
    for leaf in flat.leaves:
        if is_end_of_turn(leaf.mimetype):
            continue
        if not is_text(leaf.mimetype):
            raise invalid(f"node {leaf.id!r}: unsupported mimetype {leaf.mimetype!r} (text expected)")
        for part in leaf.parts:
            try:
                out.append(read_text(part.uri) if isinstance(part, Ref) else part.decode("utf-8"))
            except UnicodeDecodeError as exc:
                raise invalid(f"node {leaf.id!r}: data is not valid UTF-8 ({exc.reason})") from exc
    return "".join(out)
