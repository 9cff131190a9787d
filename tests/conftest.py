from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Tests convert GGUF files into throw-away cache directories dozens of times, nearly all over the
# shipped vocabulary: one tokenizer cache for the run (model/gguf.py) converts each tokenizer once
# (4-8 s each, in a child process) instead of once a test. Set before any server child starts,
# so theirs share it too; the cold-start test clears it for its own process. `make test`'s
# workers (pytest-xdist) share one through their run's id (its writes are atomic renames).
_RUN = os.environ.get("PYTEST_XDIST_TESTRUNUID")
if _RUN:
    _TOKENIZERS = os.path.join(tempfile.gettempdir(), f"tokenwire-test-tokenizers-{_RUN}")
    os.makedirs(_TOKENIZERS, exist_ok=True)
else:
    _TOKENIZERS = tempfile.mkdtemp(prefix="tokenwire-test-tokenizers-")
os.environ.setdefault("TOKENWIRE_TOKENIZER_CACHE", _TOKENIZERS)
# `serve` persists sessions under the cache directory by default (--state-dir): the suite's many
# servers would all restore each other's sessions from the user's cache (coupled tests, slower
# starts, state left behind). Off for every child server unless a test turns it on with a
# temporary --state-dir of its own (tests/reliability/test_persistence.py drops this variable).
os.environ.setdefault("TOKENWIRE_NO_PERSIST", "1")


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


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_source) -> Path:
    """A Hugging Face directory: SmolLM2's tokenizer with a 2-layer random-weight Llama
    (tests/tiny_models.py)."""
    from tests.tiny_models import hf_model

    out = tmp_path_factory.mktemp("tiny-smollm2")
    hf_model("smollm2").save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (smollm2_source.model_dir / name).exists():
            shutil.copy(smollm2_source.model_dir / name, out / name)
    return out


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_source):
    """transformers' model holding the shipped GGUF's weights, dequantised exactly (the fp32
    reference; the conversion cache keeps no weights, so they are read from the file)."""
    from tokenwire.bench.hf_baseline import transformers_model

    return transformers_model(str(smollm2_source.model_dir))
