"""`tokenwire salience`: an interactive chat over one Salience session, showing per-token logprobs.

Each user line is added to the conversation; the client renders the whole conversation with the
model's chat template, keeps the longest prefix the session already holds (rewinding past any
difference, e.g. where the template re-tokenizes the assistant's reply) and sends only the rest.
Reads lines until EOF, so it also works with piped input.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

from tokenwire.cli_args import HelpFormatter, add_model_args, unreachable
from tokenwire.model_spec import check_model_spec

DEFAULT_URL = "127.0.0.1:50051"


def register_cli(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "salience",
        help="Salience: chat over one gRPC session, with per-token logprobs",
        formatter_class=HelpFormatter,
    )
    add_model_args(p)  # only --model/--model-name/--cache-dir matter: the tokenizer is loaded locally
    g = p.add_argument_group("client")
    g.add_argument("--url", default=DEFAULT_URL, help="the server's gRPC address (HOST:PORT)")
    g.add_argument(
        "--auth-token",
        default=os.environ.get("TOKENWIRE_AUTH_TOKEN"),
        help="bearer token (default: $TOKENWIRE_AUTH_TOKEN)",
    )
    g.add_argument("--tls", action="store_true", help="connect with TLS")
    g.add_argument("--ca", help="PEM root certificate(s) to trust (implies --tls)")
    g.add_argument("--max-tokens", type=int, default=128, help="most tokens per reply")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (sent as top_k=1)")
    g.add_argument("--system", help="system message")
    g.add_argument("--no-logprobs", action="store_true", help="print the reply text only")
    p.set_defaults(handler=run_chat)


def _format(text: str, logprob: float | None, color: bool) -> str:
    if logprob is None:
        return text
    mark = f"[{logprob:.2f}]"
    if color:
        # dim for confident tokens, yellow below 50%, red below 10%
        style = "2" if logprob > math.log(0.5) else "33" if logprob > math.log(0.1) else "31"
        return f"{text}\x1b[{style}m{mark}\x1b[0m"
    return f"{text}{mark}"


def run_chat(args: argparse.Namespace) -> int:
    problem = unreachable(args.url, 50051)
    if problem is not None:
        print(f"tokenwire salience: {problem}", file=sys.stderr)
        return 1
    # local: the loader imports torch and grpc the client; only `tokenwire salience` needs them
    from tokenwire.engine.session import common_prefix
    from tokenwire.model.loader import resolve_model
    from tokenwire.protocols.salience.client import Client
    from tokenwire.protocols.salience.client_session import SalienceError

    model = check_model_spec(args.model)
    source = resolve_model(model, cache_dir=args.cache_dir, name=args.model_name)
    tok = source.tokenizer
    root = open(args.ca, "rb").read() if args.ca else None
    color = sys.stdout.isatty()
    messages: list[dict[str, str]] = [{"role": "system", "content": args.system}] if args.system else []
    sampling = {"top_k": 1} if args.temperature == 0 else {"temperature": args.temperature}
    interactive = sys.stdin.isatty()
    with Client(args.url, auth_token=args.auth_token, tls=args.tls, root_certificates=root) as client:
        try:
            session = client.open(source.name)
            while True:
                if interactive:
                    print("you> ", end="", flush=True)
                line = sys.stdin.readline()
                if not line:
                    break
                if not line.strip():
                    continue
                messages.append({"role": "user", "content": line.rstrip("\n")})
                full = tok.apply_chat_template(messages, add_generation_prompt=True)
                keep = common_prefix(session.tokens, full)
                session.truncate(keep)
                decoder = tok.incremental_decoder(skip_special_tokens=True)
                reply: list[int] = []
                print("model> ", end="", flush=True)
                for token in session.generate(
                    full[keep:],
                    max_tokens=args.max_tokens,
                    logprobs_ranges=[(len(full), session.view.max_model_len)],
                    stop_token_ids=sorted(tok.eos_token_ids),
                    **sampling,
                ):
                    reply.append(token.id)
                    text = decoder.feed(token.id)
                    if token.id in tok.eos_token_ids:
                        continue
                    lp = None if args.no_logprobs or not token.has_sampled_logprob else token.sampled_logprob
                    print(_format(text, lp, color), end="", flush=True)
                done = session.last_done
                print(f"\n  ({done.completion_tokens} tokens, session {len(session.tokens)} tokens)")
                ids = [t for t in reply if t not in tok.eos_token_ids]
                messages.append({"role": "assistant", "content": tok.decode(ids)})
            session.close()
        except SalienceError as exc:
            print(f"\ntokenwire salience: {exc}", file=sys.stderr)
            return 1
    return 0
