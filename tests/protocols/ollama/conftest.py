"""The OpenAI tests' no-model engine, for the in-process tests here."""

from tests.protocols.openai.conftest import random_engine  # noqa: F401
