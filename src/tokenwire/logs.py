"""Logging set-up: tokenwire's own loggers at INFO (DEBUG with -v), other libraries at WARNING,
as text or one JSON object per line (--log-format json).

Access log lines (one per request, per protocol) go to the `tokenwire.access` logger through
`access_log(...)`: the text form is `key=value` pairs, the JSON form has them as fields.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

ACCESS = logging.getLogger("tokenwire.access")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if fields:
            entry.update(fields)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False, default=str)


class StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever `sys.stderr` is at the time of the record, not the stream that was
    there at set-up: a CLI entry point called in-process (tests, embedding) must not leave a
    handler on a stream its caller has since closed ("I/O operation on closed file")."""

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, _value: Any) -> None:
        """StreamHandler's __init__ and setStream assign a stream: ignored, stderr is looked up."""


def setup_logging(verbose: bool = False, json_format: bool = False) -> None:
    handler = StderrHandler()
    text = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    handler.setFormatter(JsonFormatter() if json_format else text)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.WARNING)  # -v must not turn on grpc's, asyncio's or aiohttp's DEBUG
    logging.getLogger("tokenwire").setLevel(logging.DEBUG if verbose else logging.INFO)


def _text(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4f}"
    text = str(value)
    return json.dumps(text) if (" " in text or not text) else text


def access_log(protocol: str, method: str, outcome: str, **fields: Any) -> None:
    """One line for one finished request: protocol, method/action, outcome, and whatever the
    protocol knows (peer, session, prompt_tokens, generated_tokens, ttft_s, duration_s)."""
    if not ACCESS.isEnabledFor(logging.INFO):
        return
    entry = {"protocol": protocol, "method": method, "outcome": outcome}
    entry.update({k: v for k, v in fields.items() if v is not None})
    ACCESS.info(" ".join(f"{k}={_text(v)}" for k, v in entry.items()), extra={"fields": entry})
