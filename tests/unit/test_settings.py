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


def test_each_role_has_its_trainer_its_temperature_and_its_loss():
    settings = Settings(rollout={"generation": {"temperature": 0.7}}, extractor={"generation": {"temperature": 0.3}},
                        extractor_trainer={"loss": "grpo"})
    assert settings.trainer("actor") is settings.actor_trainer
    assert settings.trainer("extractor") is settings.extractor_trainer
    assert (settings.sampling_temperature("actor"), settings.sampling_temperature("extractor")) == (0.7, 0.3)
    assert (Settings().actor_trainer.loss, Settings().extractor_trainer.loss) == ("grpo", "cispo")
    assert settings.extractor_trainer.loss == "grpo"


def test_the_tracker_and_the_scheduler_build_one_schedule():
    from pipeline.tracking.fold import schedule_from
    from schemas.base import Producer
    from schemas.runs import RunStarted

    settings = Settings(config=CONFIGS / "tiny-minihack-room.yaml", actor_trainer={"group_size": 6})
    started = RunStarted(run_id="r", producer=Producer(worker="scheduler", instance="s"),
                         config=settings.run_config(), code_version="test")
    assert schedule_from(started) == settings.schedule()
    assert settings.schedule().group_size == 6
