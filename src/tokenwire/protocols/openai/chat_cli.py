"""`tokenwire chat`: an interactive chat with any OpenAI-compatible server (default: ours).

Replies stream as they are generated. With `--session` (tokenwire servers only) the
conversation lives in a server session: each turn sends only the new message and the server
computes only its tokens; the session is deleted on exit.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, TextIO

DEFAULT_URL = "http://127.0.0.1:8000/v1"


def register_cli(sub: Any) -> None:
    p = sub.add_parser("chat", help="chat with an OpenAI-compatible server (default: tokenwire serve's)")
    p.add_argument(
        "--url", default=os.environ.get("TOKENWIRE_URL", DEFAULT_URL), help=f"API base URL ({DEFAULT_URL})"
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get("TOKENWIRE_API_KEY") or os.environ.get("OPENAI_API_KEY") or "none",
        help="bearer key ($TOKENWIRE_API_KEY, else $OPENAI_API_KEY)",
    )
    p.add_argument("--model", help="model name (default: the server's first model)")
    p.add_argument("--system", help="a system message to start with")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--session", action="store_true", help="keep the conversation in a tokenwire session")
    p.set_defaults(handler=run_chat)


def run_chat(args: argparse.Namespace, stdin: TextIO = sys.stdin, stdout: TextIO = sys.stdout) -> int:
    # local: the openai package is a dev extra; only `tokenwire chat` needs it
    import openai

    client = openai.OpenAI(base_url=args.url, api_key=args.api_key)
    try:
        model = args.model or client.models.list().data[0].id
    except openai.APIError as exc:
        print(f"tokenwire chat: {args.url}: {exc}", file=sys.stderr)
        return 1
    pending: list[dict[str, Any]] = [{"role": "system", "content": args.system}] if args.system else []
    history: list[dict[str, Any]] = []  # without a session, every turn resends it
    session = client.post("/sessions", body={}, cast_to=object)["id"] if args.session else None
    interactive = stdin.isatty()
    try:
        while True:
            if interactive:
                stdout.write("you> ")
                stdout.flush()
            line = stdin.readline()
            if not line or line.strip() in ("/quit", "/exit"):
                return 0
            if not line.strip():
                continue
            pending.append({"role": "user", "content": line.rstrip("\n")})
            messages = pending if session is not None else history + pending
            extra = {"session": session} if session is not None else {}
            reply = _stream_reply(client, model, messages, args, extra, stdout)
            history += [*pending, {"role": "assistant", "content": reply}]
            pending = []
    except KeyboardInterrupt:
        return 130
    except openai.APIError as exc:
        print(f"tokenwire chat: {exc}", file=sys.stderr)
        return 1
    finally:
        if session is not None:
            client.delete(f"/sessions/{session}", cast_to=object)


def _stream_reply(
    client: Any,
    model: str,
    messages: list[dict[str, Any]],
    args: argparse.Namespace,
    extra: dict[str, Any],
    stdout: TextIO,
) -> str:
    parts = []
    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        temperature=args.temperature,
        max_tokens=args.max_tokens,
        stream=True,
        extra_body=extra,
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
            stdout.write(parts[-1])
            stdout.flush()
    stdout.write("\n")
    return "".join(parts)
