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


def test_precision_auto_becomes_bfloat16_only_where_the_device_computes_it_natively(monkeypatch):
    import torch

    from pipeline.models.settings import GenerationSettings, ModelSettings

    config = CONFIGS / "smol-signpost-corridor.yaml"
    for native in (True, False):
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda native=native: native)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
        settings = Settings(config=config)
        expected = "bfloat16" if native else "float32"
        # Resolved as the settings load, so the config a run records (and keys its warm starts by) says which.
        assert settings.actor_trainer.model.precision == expected
        assert settings.extractor_trainer.model.precision == expected
        assert settings.rollout.generation.precision == expected
        assert settings.extractor.generation.precision == expected
        assert settings.model_dump(mode="json")["rollout"]["generation"]["precision"] == expected
        assert ModelSettings(precision="float32").precision == "float32"  # what is given stays as given
        assert GenerationSettings(precision="bfloat16").precision == "bfloat16"
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    assert ModelSettings(precision="auto").precision == "bfloat16"
    if not torch.cuda.is_available():
        assert ModelSettings(precision="auto", device="cuda").precision == "float32"
