"""The Salience client: `from tokenwire.salience import Client` (blocking) or `AsyncClient`."""

from tokenwire.protocols.salience.client import AsyncClient, AsyncSession, Client, Session
from tokenwire.protocols.salience.client_session import SalienceError

__all__ = ["AsyncClient", "AsyncSession", "Client", "SalienceError", "Session"]
