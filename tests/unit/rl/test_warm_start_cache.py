"""The warm-start cache: the same settings give the same weights, computed once even when two processes (two runs,
or tests side by side) miss the same entry at the same time.

Run: pytest tests/unit/rl/test_warm_start_cache.py
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from pipeline.envs.settings import EnvSettings, TaskMix
from pipeline.models.checkpoints import weight_hash
from pipeline.models.settings import TinyModelSettings
from pipeline.models.tiny import build_tiny
from pipeline.rl.settings import WarmStartSettings
from pipeline.rl.warm_start import warm_start_actor

TINY = TinyModelSettings(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64,
                         vocab_size=512, corpus_episodes=4)
TASKS = [TaskMix(env_id="MiniHack-Room-Random-5x5-v0", max_turns=6)]


def _warm(cache_dir, policy=None):
    settings = WarmStartSettings(steps=3, episodes=4, batch_size=4, cache_dir=cache_dir)
    policy, stats = warm_start_actor(policy or build_tiny(TINY), settings, TASKS, EnvSettings(), history_turns=1)
    return weight_hash(policy.model), stats


def test_two_cold_warm_starts_side_by_side_compute_once_and_agree(tmp_path):
    policies = [build_tiny(TINY), build_tiny(TINY)]  # built here: transformers' lazy imports are not thread-safe
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(_warm, [tmp_path, tmp_path], policies))
    (first, first_stats), (second, second_stats) = results
    assert first == second
    assert sorted("cached" in stats for stats in (first_stats, second_stats)) == [False, True], \
        "one computed the entry, the other waited and loaded it"
    again, stats = _warm(tmp_path)
    assert again == first and stats["cached"]
    assert _warm(None)[0] == first, "the cache gives the weights a fresh computation gives"


def test_the_cache_key_follows_what_the_samples_depend_on_not_the_runs_task_seed(tmp_path):
    from pipeline.rl.warm_start import _cache_key, _env_options

    policy = build_tiny(TINY)

    def key(envs: EnvSettings) -> str:
        return _cache_key("actor", policy, {"envs": _env_options(envs)})

    base = key(EnvSettings())
    assert key(EnvSettings(seed=7, train_pool_size=16, eval_tasks_per_env=200, eval_seed=3, eval_repeats=4,
                           eval_recurring_per_env=5)) == base, \
        "the data episodes draw from the warm start's own seed: a run's task seed does not change them"
    assert key(EnvSettings(invalid_action="end")) != base, "how environments treat invalid actions does"
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1 if threads > 1 else 2)
        assert key(EnvSettings()) != base, "float sums, so the weights, depend on the thread count"
    finally:
        torch.set_num_threads(threads)

