"""The `SMALL` model the model tests share: its tokenizer corpus and the policy built from it, once a module."""

from __future__ import annotations

import pytest
from tiny_models import SMALL

from pipeline.models import TransformersPolicy, build_tiny, tokenizer_corpus


@pytest.fixture(scope="module")
def corpus() -> list[str]:
    return tokenizer_corpus(SMALL)


@pytest.fixture(scope="module")
def policy(corpus: list[str]) -> TransformersPolicy:
    return build_tiny(SMALL, corpus=corpus)
