"""`tokenwire generate PROMPT`: stream one completion to the terminal."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tokenwire.engine.engine import Engine
from tokenwire.engine.errors import InvalidRequestError
from tokenwire.engine.factory import EngineSettings, build_engine
from tokenwire.engine.grammar import GrammarConstraint, check_grammar
from tokenwire.engine.request import FinishEvent, GenerateOptions, SamplingParams, TokenEvent, iter_events
from tokenwire.engine.vision import ImageInput


def _text_or_file(value: str) -> str:
    return Path(value[1:]).read_text() if value.startswith("@") else value


def prompt_tokens(engine: Engine, prompt: str, raw: bool) -> list[int]:
    tok = engine.tokenizer
    if raw or not tok.has_chat_template:
        return tok.encode(prompt)
    return tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)


def image_prompt(
    engine: Engine, prompt: str, raw: bool, images: list[bytes]
) -> tuple[list[int], list[ImageInput]]:
    """The prompt with each image's vision block before the text (Qwen2-VL's own order), and
    the images attached to those blocks. A text-only model refuses (InvalidRequestError)."""
    counts = [engine.image_tokens(data) for data in images]
    blocks = "".join("<|vision_start|>" + "<|image_pad|>" * n + "<|vision_end|>" for n in counts)
    tokens = prompt_tokens(engine, blocks + prompt, raw)
    vision_start = engine.config.vision.vision_start_token_id
    starts = [i for i, t in enumerate(tokens) if t == vision_start]
    if len(starts) != len(images):
        raise ValueError(f"the prompt holds {len(starts)} vision blocks for {len(images)} --image files")
    return tokens, [ImageInput(s, s + n + 2, data) for s, n, data in zip(starts, counts, images, strict=True)]


def _grammar_args(args: argparse.Namespace) -> tuple[str, str] | None:
    """(kind, source) of the one constraint flag given, or None."""
    flags = (("regex", args.regex), ("json_schema", args.json_schema), ("lark", args.lark))
    given = [(kind, value) for kind, value in flags if value]
    if len(given) > 1:
        raise ValueError("use at most one of --regex, --json-schema, --lark")
    if not given:
        return None
    kind, value = given[0]
    return kind, value if kind == "regex" else _text_or_file(value)


def check_args(args: argparse.Namespace) -> None:
    """Every check that needs no model: sampling values and the constraint's grammar."""
    sampling_from(args).validate()
    for path in getattr(args, "image", []):
        if not Path(path).is_file():
            raise ValueError(f"--image {path}: no such file")
    if args.max_tokens < 0:
        raise ValueError(f"--max-tokens must be >= 0, got {args.max_tokens}")
    grammar = _grammar_args(args)
    if grammar is not None:
        check_grammar(*grammar)


def sampling_from(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)


def options_from(args: argparse.Namespace, engine: Engine) -> GenerateOptions:
    constraint = None
    grammar = _grammar_args(args)
    if grammar is not None:
        kind, source = grammar
        hf, width = engine.tokenizer.hf, engine.logits_size
        constraint = getattr(GrammarConstraint, kind)(hf, width, source)
    return GenerateOptions(
        max_tokens=args.max_tokens,
        sampling=sampling_from(args),
        stop=list(args.stop),
        constraint=constraint,
        special_text=getattr(args, "special", False),
    )


def run_generate(args: argparse.Namespace, settings: EngineSettings) -> int:
    try:
        check_args(args)  # before the model loads: a typo costs no load
    except InvalidRequestError as exc:
        raise ValueError(str(exc)) from None
    settings.progress = sys.stderr.isatty()
    engine = build_engine(settings)
    try:
        images = [Path(p).read_bytes() for p in getattr(args, "image", [])]
        attached: list[ImageInput] = []
        if images:
            tokens, attached = image_prompt(engine, args.prompt, args.raw, images)
        else:
            tokens = prompt_tokens(engine, args.prompt, args.raw)
        handle = engine.generate(None, tokens, options_from(args, engine), images=attached)
        for event in iter_events(handle):
            if isinstance(event, TokenEvent):
                if args.json:
                    print(
                        json.dumps(
                            {
                                "type": "token",
                                "id": event.token_id,
                                "position": event.position,
                                "text": event.text,
                                "forced": event.forced,
                            },
                            ensure_ascii=False,
                        )
                    )
                else:
                    sys.stdout.write(event.text)
                sys.stdout.flush()
            elif isinstance(event, FinishEvent):
                if args.json:
                    print(
                        json.dumps(
                            {
                                "type": "finish",
                                "reason": event.reason,
                                "error": event.error,
                                "prompt_tokens": event.prompt_tokens,
                                "completion_tokens": event.completion_tokens,
                            }
                        )
                    )
                else:
                    sys.stdout.write("\n")
                if event.reason == "error":
                    print(f"tokenwire: error: {event.error}", file=sys.stderr)
                    return 1
        return 0
    finally:
        engine.shutdown()
