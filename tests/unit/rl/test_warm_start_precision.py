"""Warm starts under bfloat16 autocast (a trainer with `model.precision: bfloat16`): their own cache entry, as
deterministic as float32 ones, float32 weights, a first loss that differs from float32's by rounding only, and the
model and torch left as they were (attention implementation, deterministic mode's fills). Both trainer workers hand
their trainer's precision to the warm start.

Run: pytest tests/unit/rl/test_warm_start_precision.py
"""

from __future__ import annotations

from typing import Any

import torch

from pipeline.actor.settings import RolloutSettings
from pipeline.envs.settings import EnvSettings, TaskMix
from pipeline.models.checkpoints import weight_hash
from pipeline.models.settings import TinyModelSettings
from pipeline.models.tiny import build_tiny
from pipeline.rl.settings import WarmStartSettings
from pipeline.rl.warm_start import warm_start_actor

TINY = TinyModelSettings(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64,
                         vocab_size=512, corpus_episodes=4)
TASKS = [TaskMix(env_id="MiniHack-Room-Random-5x5-v0", max_turns=6)]


def _warm(cache_dir: Any, precision: str) -> tuple[Any, dict[str, Any]]:
    settings = WarmStartSettings(steps=3, episodes=4, batch_size=4, cache_dir=cache_dir)
    return warm_start_actor(build_tiny(TINY), settings, TASKS, EnvSettings(), RolloutSettings(history_turns=1),
                            precision=precision)


def test_a_bfloat16_warm_start_is_deterministic_its_own_entry_and_leaves_model_and_torch_as_they_were(tmp_path):
    attention = build_tiny(TINY).model.config._attn_implementation
    fills = torch.utils.deterministic.fill_uninitialized_memory  # type: ignore[attr-defined]
    full, full_stats = _warm(tmp_path, "float32")
    half, half_stats = _warm(tmp_path, "bfloat16")
    assert "cached" not in half_stats, "bfloat16 is a cache entry of its own, not float32's"
    assert weight_hash(half.model) != weight_hash(full.model)
    assert all(p.dtype == torch.float32 for p in half.model.parameters()), "autocast: the weights stay float32"
    # The first loss is taken before any update: the two differ by bfloat16's rounding only.
    assert abs(half_stats["loss_first"] - full_stats["loss_first"]) < 0.02 * full_stats["loss_first"]
    assert half_stats["loss_first"] != full_stats["loss_first"]
    assert half_stats["loss_last"] < half_stats["loss_first"]
    again, _stats = _warm(None, "bfloat16")
    assert weight_hash(again.model) == weight_hash(half.model), "computed again, the same bits"
    cached, cached_stats = _warm(tmp_path, "bfloat16")
    assert cached_stats["cached"] and weight_hash(cached.model) == weight_hash(half.model)
    assert half.model.config._attn_implementation == attention, "the model attends as it did before"
    assert torch.utils.deterministic.fill_uninitialized_memory is fills  # type: ignore[attr-defined]


def test_both_trainer_workers_warm_start_at_their_trainers_precision(monkeypatch):
    from pipeline.rl import warm_start
    from pipeline.settings import Settings
    from workers.actor_trainer import actor_warm_start
    from workers.extractor_trainer import extractor_warm_start

    seen: dict[str, str] = {}
    monkeypatch.setattr(warm_start, "warm_start_actor",
                        lambda *args, precision, **kwargs: seen.setdefault("actor", precision))
    monkeypatch.setattr(warm_start, "warm_start_extractor",
                        lambda *args, precision, **kwargs: seen.setdefault("extractor", precision))
    warm = {"steps": 2}
    settings = Settings(actor_trainer={"warm_start": warm, "model": {"precision": "bfloat16"}},
                        extractor_trainer={"warm_start": warm, "model": {"precision": "float32"}})
    actor, extractor = actor_warm_start(settings), extractor_warm_start(settings)
    assert actor is not None and extractor is not None
    actor(build_tiny(TINY), lambda *args, **kwargs: None)
    extractor(build_tiny(TINY), lambda *args, **kwargs: None)
    assert seen == {"actor": "bfloat16", "extractor": "float32"}
