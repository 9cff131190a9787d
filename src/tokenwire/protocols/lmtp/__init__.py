"""LMTP, the Language Model Transport Protocol of LMQL, with four opt-in extensions (docs/lmtp.md)."""

from tokenwire.protocols.lmtp.client import Client, LmtpError
from tokenwire.protocols.lmtp.core import LmtpConnection
from tokenwire.protocols.lmtp.ws_server import LmtpServer

__all__ = ["Client", "LmtpConnection", "LmtpError", "LmtpServer"]
