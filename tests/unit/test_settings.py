"""The settings edge (`pipeline.settings.Settings`): a config file, then CRL_* variables over it.

Run: pytest tests/unit/test_settings.py
"""

from __future__ import annotations

from pathlib import Path

from pipeline.settings import Settings

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def test_a_variable_set_to_null_turns_an_optional_setting_off(monkeypatch):
    config = CONFIGS / "tiny-dark-corridor.yaml"
    assert Settings(config=config).retrieval.min_similarity == 0.99
    monkeypatch.setenv("CRL_RETRIEVAL__MIN_SIMILARITY", "null")
    monkeypatch.setenv("CRL_RETRIEVAL__SIMILARITY_MARGIN", "null")
    settings = Settings(config=config)
    assert settings.retrieval.min_similarity is None and settings.retrieval.similarity_margin is None
    monkeypatch.setenv("CRL_RETRIEVAL__MIN_SIMILARITY", "0.5")
    assert Settings(config=config).retrieval.min_similarity == 0.5
