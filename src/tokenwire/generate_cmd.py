"""`tokenwire generate PROMPT`: stream one completion to the terminal."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tokenwire.engine.engine import Engine
from tokenwire.engine.factory import EngineSettings, build_engine
from tokenwire.engine.request import FinishEvent, GenerateOptions, SamplingParams, TokenEvent


def _text_or_file(value: str) -> str:
    return Path(value[1:]).read_text() if value.startswith("@") else value


def prompt_tokens(engine: Engine, prompt: str, raw: bool) -> list[int]:
    tok = engine.tokenizer
    if raw or not tok.has_chat_template:
        return tok.encode(prompt)
    return tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)


def options_from(args: argparse.Namespace, engine: Engine) -> GenerateOptions:
    constraint = None
    grammar_args = [a for a in (args.regex, args.json_schema, args.lark) if a]
    if len(grammar_args) > 1:
        raise ValueError("use at most one of --regex, --json-schema, --lark")
    if grammar_args:
        from tokenwire.engine.grammar import GrammarConstraint

        hf, width = engine.tokenizer.hf, engine.logits_size
        if args.regex:
            constraint = GrammarConstraint.regex(hf, width, args.regex)
        elif args.json_schema:
            constraint = GrammarConstraint.json_schema(hf, width, _text_or_file(args.json_schema))
        else:
            constraint = GrammarConstraint.lark(hf, width, _text_or_file(args.lark))
    return GenerateOptions(
        max_tokens=args.max_tokens,
        sampling=SamplingParams(
            temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed
        ),
        stop=list(args.stop),
        constraint=constraint,
    )


def run_generate(args: argparse.Namespace, settings: EngineSettings) -> int:
    settings.progress = sys.stderr.isatty()
    engine = build_engine(settings)
    try:
        tokens = prompt_tokens(engine, args.prompt, args.raw)
        handle = engine.generate(None, tokens, options_from(args, engine))
        for event in handle:
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
