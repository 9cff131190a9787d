"""The ref sandbox: `file://` refs are read only under the directories given with
--allow-ref-root, never outside them by `..` or symlinks, and always streamed in blocks.

Accepted forms: `file:///abs/path` (absolute) and `file://rel/path` (the seed's own form,
`file://path/to/file/part1`: host + path taken as a path relative to each allowed root in
turn). Everything else is PERMISSION_DENIED: other schemes, no roots configured, a path
whose real location (symlinks resolved) is outside every root.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

import grpc

from tokenwire.protocols.evergreen.errors import SessionAbort

BLOCK_BYTES = 1 << 20


def _denied(uri: str, why: str) -> SessionAbort:
    return SessionAbort(grpc.StatusCode.PERMISSION_DENIED, f"ref {uri!r}: {why}")


@dataclass
class RefSummary:
    size: int
    sha256: str


class RefSandbox:
    def __init__(self, roots: Sequence[str | Path] = ()) -> None:
        self.roots = [Path(os.path.realpath(r)) for r in roots]

    def resolve(self, uri: str) -> Path:
        parts = urlsplit(uri)
        if parts.scheme != "file":
            raise _denied(uri, f"scheme {parts.scheme or '(none)'!r} is not allowed (only file://)")
        if not self.roots:
            raise _denied(uri, "file refs are disabled (no --allow-ref-root given)")
        if parts.query or parts.fragment:
            raise _denied(uri, "file refs take no query or fragment")
        if parts.netloc in ("", "localhost"):
            candidates = [Path(unquote(parts.path))]
        else:  # file://rel/path: relative to each allowed root
            relative = unquote(parts.netloc + parts.path)
            candidates = [root / relative for root in self.roots]
        for candidate in candidates:
            real = Path(os.path.realpath(candidate))
            if not any(real == root or root in real.parents for root in self.roots):
                raise _denied(
                    uri, "the path is outside the allowed ref roots (after resolving '..' and symlinks)"
                )
            if real.exists():
                return real
        raise SessionAbort(
            grpc.StatusCode.NOT_FOUND, f"ref {uri!r}: no such file under the allowed ref roots"
        )

    def open_blocks(self, uri: str, block: int = BLOCK_BYTES) -> Iterator[bytes]:
        """The file's bytes in blocks; the opened file is checked to be the resolved one, so a
        symlink swapped in after resolving cannot redirect the read."""
        real = self.resolve(uri)
        flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0)
        try:
            fd = os.open(real, flags)
        except OSError as exc:
            raise _denied(uri, f"cannot open: {exc.strerror}") from exc
        with os.fdopen(fd, "rb") as f:
            opened = os.fstat(f.fileno())
            expected = os.stat(real)
            if (opened.st_dev, opened.st_ino) != (expected.st_dev, expected.st_ino):
                raise _denied(uri, "the file changed while opening it")
            while chunk := f.read(block):
                yield chunk

    def summarize(self, uri: str) -> RefSummary:
        digest = hashlib.sha256()
        size = 0
        for chunk in self.open_blocks(uri):
            digest.update(chunk)
            size += len(chunk)
        return RefSummary(size, digest.hexdigest())
