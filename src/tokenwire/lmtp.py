"""The LMTP client: `from tokenwire.lmtp import Client`."""

from tokenwire.protocols.lmtp.client import Client, LmtpError

__all__ = ["Client", "LmtpError"]
