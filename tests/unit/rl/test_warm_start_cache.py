"""The warm-start cache: the same settings give the same weights, computed once even when two processes (two runs,
or tests side by side) miss the same entry at the same time.

Run: pytest tests/unit/rl/test_warm_start_cache.py
"""

from __future__ import annotations

import os
import shutil
from concurrent.futures import ThreadPoolExecutor

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


def _warm(cache_dir, policy=None):
    settings = WarmStartSettings(steps=3, episodes=4, batch_size=4, cache_dir=cache_dir)
    policy, stats = warm_start_actor(policy or build_tiny(TINY), settings, TASKS, EnvSettings(),
                                     RolloutSettings(history_turns=1))
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



def test_the_cache_key_covers_the_code_that_computes_the_warm_start(tmp_path, monkeypatch):
    """An entry computed by other code is never reused: the key hashes every module of `WARM_START_CODE` (the
    training step, the losses, the model backends among them), the libraries, the torch build and the CPU."""
    import pipeline.rl.warm_start as warm_start

    root = warm_start.REPOSITORY
    files = {path.relative_to(root).as_posix() for path in warm_start.source_files(root)}
    for needed in ("pipeline/rl/policy_step.py", "pipeline/rl/losses.py", "pipeline/rl/trainer.py",
                   "pipeline/rl/warm_start.py", "pipeline/rl/warm_data.py", "pipeline/models/transformers_backend.py",
                   "pipeline/models/tiny.py", "pipeline/extractor/protocol.py", "pipeline/envs/dark_corridor.py",
                   "pipeline/actor/episodes.py"):
        assert needed in files, needed
    fingerprint = warm_start.code_fingerprint()
    assert {"source", "torch", "torch_build", "cpu", "transformers", "tokenizers"} <= fingerprint.keys()

    # A copy of the tree whose training step gains one comment hashes to another source.
    for part in warm_start.WARM_START_CODE:
        if (root / part).is_dir():
            shutil.copytree(root / part, tmp_path / part, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(root / part, tmp_path / part)
    before = warm_start.code_fingerprint(tmp_path)["source"]
    assert before == warm_start.code_fingerprint()["source"], "the copy hashes as the tree does"
    update = tmp_path / "pipeline" / "rl" / "policy_step.py"
    update.write_text(update.read_text() + "\n# a change to the training step\n")
    warm_start.code_fingerprint.cache_clear()
    assert warm_start.code_fingerprint(tmp_path)["source"] != before

    # The same settings and weights on another CPU: another key.
    policy = build_tiny(TINY)
    key = warm_start._cache_key("extractor", policy, {})
    monkeypatch.setattr(warm_start.torch.backends.cpu, "get_cpu_capability", lambda: "ANOTHER_CPU")
    warm_start.code_fingerprint.cache_clear()
    try:
        assert warm_start._cache_key("extractor", policy, {}) != key
    finally:
        monkeypatch.undo()
        warm_start.code_fingerprint.cache_clear()


NOT_IN_THE_WEIGHTS = ("infra", "schemas", "pipeline.runtime", "pipeline.bank")
"""Project packages a warm start imports that cannot change its weights: errors, event schemas, durable file writes
and the bank's retrieval types (the gate's fixed lessons)."""


def test_every_module_a_warm_start_imports_is_hashed_or_cannot_change_the_weights():
    import subprocess
    import sys

    from pipeline.rl.warm_start import REPOSITORY, WARM_START_CODE

    script = (
        "import sys\n"
        "from pipeline.actor.settings import RolloutSettings\n"
        "from pipeline.envs.settings import EnvSettings, TaskMix\n"
        "from pipeline.extractor.settings import ExtractorSettings\n"
        "from pipeline.models.settings import TinyModelSettings\n"
        "from pipeline.models.tiny import build_tiny\n"
        "from pipeline.rl.settings import WarmStartSettings\n"
        "from pipeline.rl.warm_start import warm_start_actor, warm_start_extractor\n"
        "tiny = TinyModelSettings(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64, "
        "vocab_size=512, corpus_episodes=4)\n"
        "tasks = [TaskMix(env_id='MiniHack-DarkCorridor-v0', max_turns=9)]\n"
        "warm = dict(steps=2, episodes=8, batch_size=2, plays_per_task=4, cache_dir=None)\n"
        "warm_start_actor(build_tiny(tiny), WarmStartSettings(**warm, gate={'episodes': 8, "
        "'min_success_right': 0.5}), tasks, EnvSettings(), RolloutSettings(history_turns=1))\n"
        "warm_start_extractor(build_tiny(tiny), WarmStartSettings(**warm, gate={'episodes': 8, "
        "'min_states_revealed': 0.5}), tasks, EnvSettings(), ExtractorSettings())\n"
        "print('\\n'.join(sorted(m for m in sys.modules if m.split('.')[0] in ('pipeline', 'schemas', 'infra'))))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPOSITORY,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    covered = (*(part.removesuffix(".py").replace("/", ".") for part in WARM_START_CODE), *NOT_IN_THE_WEIGHTS)
    outside = [module for module in done.stdout.split()
               if module != "pipeline" and not any(module == p or module.startswith(f"{p}.") for p in covered)]
    assert outside == [], f"modules a warm start runs that its cache key does not hash: {outside}"
