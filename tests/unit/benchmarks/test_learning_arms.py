"""The learning benchmark's arms as the runs see them (`benchmarks/learning.py`, `run_env`): every arm of a seed
plays the same tasks with the same draws and differs only by what the arm is, and each control sets exactly the
setting it is named for. The settings are read as `crl run` reads them: the experiment's config under the run's
environment."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

from pipeline.settings import Settings

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def learning():
    spec = importlib.util.spec_from_file_location("learning_benchmark", ROOT / "benchmarks" / "learning.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _settings(monkeypatch, config: Path, env: dict[str, str]) -> Settings:
    for key in [key for key in os.environ if key.startswith("CRL_")]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        if key.startswith("CRL_"):
            monkeypatch.setenv(key, value)
    return Settings(config=config)


def test_every_signpost_arm_plays_the_same_draws_and_each_control_sets_its_one_setting(learning, monkeypatch,
                                                                                      tmp_path):
    args = learning.arguments(["--experiments", "signpost", "--quick", "--out", str(tmp_path)])
    experiment = learning.EXPERIMENTS["signpost"]
    assert [arm.name for arm in experiment.arms] == [
        "complementary", "grpo", "static_extractor", "extractor_trained", "extractor_frozen", "flipped", "shuffled",
        "same_instance"]
    assert {arm.name: arm.arm for arm in experiment.arms} == {
        "complementary": "complementary", "grpo": "grpo", "static_extractor": "static_extractor",
        "extractor_trained": "exp_only", "extractor_frozen": "frozen", "flipped": "complementary",
        "shuffled": "complementary", "same_instance": "complementary"}
    seen = {}
    for arm in experiment.arms:
        settings = _settings(monkeypatch, experiment.config, learning.run_env(experiment, arm, 7, args, args.steps))
        seen[arm.name] = settings
        assert settings.envs.seed == 7
        assert settings.rollout.generation.seed == settings.extractor.generation.seed == 7  # common random numbers
        assert settings.envs.eval_seed == args.eval_seed
        assert (settings.envs.eval_tasks_per_env, settings.envs.eval_repeats) == (8, 2)  # --quick's unseen pool
        assert settings.scheduler.eval_every == 3  # before training and at the last of --quick's 3 steps
        assert settings.actor_trainer.warm_start.cache_dir == settings.extractor_trainer.warm_start.cache_dir == (
            tmp_path / "warm-start-cache").resolve()
        assert settings.envs.signpost.flip_unseen == (arm.name == "flipped")
        assert settings.retrieval.serve == ("other-task" if arm.name == "shuffled" else "match")
        assert settings.retrieval.min_similarity == (0.99 if arm.name == "same_instance" else None)
        assert settings.retrieval.key == "goal-and-first-observation"
    variants = {name: settings.scheduler.variant for name, settings in seen.items()}
    assert variants["flipped"] == "flipped" and variants["shuffled"] == "shuffled"
    assert variants["same_instance"] == "same_instance"


def test_independent_draws_give_each_arm_its_own_sampling_seeds_on_the_same_tasks(learning, monkeypatch, tmp_path):
    args = learning.arguments(["--experiments", "signpost", "--quick", "--independent-draws", "--out", str(tmp_path)])
    experiment = learning.EXPERIMENTS["signpost"]
    draws, tasks = set(), set()
    for arm in experiment.arms:
        settings = _settings(monkeypatch, experiment.config, learning.run_env(experiment, arm, 7, args, args.steps))
        draws.add(settings.rollout.generation.seed)
        tasks.add(settings.envs.seed)
    assert len(draws) == len(experiment.arms) and tasks == {7}


def test_a_set_setting_reaches_every_arm_after_the_arms_own(learning, monkeypatch, tmp_path):
    args = learning.arguments(["--experiments", "signpost", "--quick", "--out", str(tmp_path),
                               "--set", "CRL_RETRIEVAL__KEY=goal", "--set", "CRL_RETRIEVAL__MIN_SIMILARITY=0.5"])
    experiment = learning.EXPERIMENTS["signpost"]
    for arm in experiment.arms:
        settings = _settings(monkeypatch, experiment.config, learning.run_env(experiment, arm, 0, args, args.steps))
        assert settings.retrieval.key == "goal" and settings.retrieval.min_similarity == 0.5


def test_the_smollm2_signpost_experiment_runs_smollm2_in_both_roles_on_its_own_smaller_unseen_pool(
        learning, monkeypatch, tmp_path):
    experiment = learning.EXPERIMENTS["smol-signpost"]
    assert experiment.signpost and not experiment.goals and [arm.name for arm in experiment.arms] == ["complementary"]
    for argv, pool in (([], (16, 4)), (["--quick"], (8, 2)), (["--signpost-tasks", "12"], (12, 4))):
        args = learning.arguments(["--experiments", "smol-signpost", "--out", str(tmp_path), *argv])
        settings = _settings(monkeypatch, experiment.config,
                             learning.run_env(experiment, experiment.arms[0], 2, args, args.steps or experiment.steps))
        assert (settings.envs.eval_tasks_per_env, settings.envs.eval_repeats) == pool
        assert settings.envs.tasks[0].env_id == experiment.env_id and settings.envs.seed == 2
        assert settings.actor_trainer.model.preset == settings.extractor_trainer.model.preset == "smollm2-135m-instruct"
        assert settings.retrieval.key == "goal-and-first-observation"
        assert settings.scheduler.eval_every == (3 if "--quick" in argv else 6)


def test_later_seeds_of_an_arm_skip_the_gates_of_the_warm_starts_the_first_one_checked(learning, monkeypatch, tmp_path):
    from pipeline.rl.warm_start import _env_options

    args = learning.arguments(["--experiments", "smol-signpost", "--out", str(tmp_path)])
    experiment = learning.EXPERIMENTS["smol-signpost"]
    arm = experiment.arms[0]
    first = _settings(monkeypatch, experiment.config, learning.run_env(experiment, arm, 0, args, 6))
    later = _settings(monkeypatch, experiment.config, learning.run_env(experiment, arm, 1, args, 6, gated=True))
    assert first.actor_trainer.warm_start.gate is not None and first.extractor_trainer.warm_start.gate is not None
    assert later.actor_trainer.warm_start.gate is None and later.extractor_trainer.warm_start.gate is None
    # what a warm start's cache key is made of does not depend on the seed: the later seed loads the weights gated
    for role in ("actor_trainer", "extractor_trainer"):
        a, b = getattr(first, role), getattr(later, role)
        assert a.warm_start.model_dump(exclude={"gate"}) == b.warm_start.model_dump(exclude={"gate"})
        assert a.model == b.model
    assert _env_options(first.envs) == _env_options(later.envs) and first.envs.seed != later.envs.seed
