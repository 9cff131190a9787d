from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tokenizer(smollm2_source):
    return smollm2_source.tokenizer
