"""The client's view of one Salience session, as the proto describes it (sans-IO).

The client is the source of truth for prompt content: it keeps the token list it believes the
server holds, sends only deltas with `offset` = that length, and marks deliberate rewinds with
`truncating`. This class holds that bookkeeping for both clients (client.py): it builds each
GenerateRequest and folds the streamed events back into the local token list.

When the outcome of a call is uncertain (the stream was cancelled, or broke before the server
said anything), the server may hold more tokens than we saw: the view is then marked for a
resync, and the next call first reloads the tokens with DumpSession.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import grpc

from tokenwire.protocols.salience.gen import salience_pb2 as pb

Range = tuple[int, int]


class SalienceError(Exception):
    """A gRPC status from the server (code + details), or a client-side misuse."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details

    @classmethod
    def from_rpc(cls, error: grpc.RpcError) -> SalienceError:
        return cls(error.code(), error.details() or "")  # type: ignore[attr-defined]


@dataclass
class GenerateParams:
    """GenerateRequest fields other than session/offset/append (proto defaults: all zero)."""

    max_tokens: int = 0
    logprobs_ranges: Sequence[Range] = ()
    logprob_top_k: int = 0
    readout_ranges: Sequence[Range] = ()
    temperature: float = 0.0  # 0 means 1.0 on the server, as the proto says
    top_p: float = 0.0  # 0 means 1.0
    top_k: int = 0  # 0 = disabled; top_k=1 is greedy
    stop_token_ids: Sequence[int] = ()
    priority: int = 0


def _ranges(ranges: Iterable[Range]) -> list[pb.PositionRange]:
    return [pb.PositionRange(start=s, end=e) for s, e in ranges]


class SessionView:
    def __init__(self, session_id: str, max_model_len: int, tokens: Sequence[int] = ()) -> None:
        self.session_id = session_id
        self.max_model_len = max_model_len
        self.tokens: list[int] = list(tokens)
        self.rewound = False  # tokens were cut locally: the next request must say truncating
        self.needs_resync = False
        self.last_done: pb.GenerateDone | None = None
        self._pending: list[int] | None = None  # append of the call in flight, until confirmed

    @property
    def length(self) -> int:
        return len(self.tokens)

    def truncate(self, length: int) -> None:
        """Rewind locally; the server rewinds with the next Generate (offset < its length)."""
        if not 0 <= length <= len(self.tokens):
            raise ValueError(f"cannot truncate to {length}: the session has {len(self.tokens)} tokens")
        if length < len(self.tokens):
            del self.tokens[length:]
            self.rewound = True

    def request(self, append: Sequence[int], params: GenerateParams) -> pb.GenerateRequest:
        if self.needs_resync:
            raise RuntimeError("resync the view (DumpSession) before the next request")
        self._pending = list(append)
        self.last_done = None
        return pb.GenerateRequest(
            session_id=self.session_id,
            append_tokens=self._pending,
            offset=len(self.tokens),
            truncating=self.rewound,
            max_tokens=params.max_tokens,
            logprobs_ranges=_ranges(params.logprobs_ranges),
            logprob_top_k=params.logprob_top_k,
            readout_ranges=_ranges(params.readout_ranges),
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            stop_token_ids=list(params.stop_token_ids),
            priority=params.priority,
        )

    def _confirm(self) -> None:
        """The server accepted the call: it has rewound and appended."""
        if self._pending is not None:
            self.tokens.extend(self._pending)
            self._pending = None
            self.rewound = False

    def on_event(self, event: pb.GenerateEvent) -> pb.Token | None:
        """Fold one streamed event into the view; returns the Token, or None for Done."""
        self._confirm()
        if event.HasField("done"):
            self.last_done = event.done
            return None
        token = event.token
        if not token.is_prefill:
            if token.position != len(self.tokens):
                self.needs_resync = True  # should not happen: the server skipped or repeated
            else:
                self.tokens.append(token.id)
        return token

    def on_error(self, error: SalienceError) -> None:
        """A status that ends the call. Before any event it means nothing changed (the server
        checks everything first); after events, or when cancelled, the outcome is uncertain."""
        if self._pending is None and error.code != grpc.StatusCode.CANCELLED:
            self.needs_resync = True  # failed mid-stream after tokens were appended
        elif error.code == grpc.StatusCode.CANCELLED:
            self.needs_resync = True  # the server may have decoded more than we received
        self._pending = None

    def on_cancel(self) -> None:
        """The caller stopped reading: tokens decoded so far stay on the server, maybe more
        than arrived here."""
        self._pending = None
        self.needs_resync = True

    def resync(self, server_tokens: Sequence[int]) -> None:
        self.tokens = list(server_tokens)
        self.rewound = False
        self.needs_resync = False
        self._pending = None

    def forked(self, session_id: str, at: int) -> SessionView:
        return SessionView(session_id, self.max_model_len, self.tokens[:at])
