from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def smollm2_source():
    """The default model, converted once into the user's cache (as `tokenwire serve` does)."""
    from tokenwire.model.loader import resolve_model

    return resolve_model(None)


@pytest.fixture(scope="session")
def smollm2_engine():
    """One engine on the real default model, shared by every test that needs one."""
    from tokenwire.engine.factory import EngineSettings, build_engine

    engine = build_engine(EngineSettings(progress=False, kv_cache_mb=256))
    yield engine
    engine.shutdown()
