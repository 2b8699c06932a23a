"""The run's schedule (`Settings.schedule()`) as pure functions of the settings and the step (hand-worked values),
episode metrics, the rollout worker's prompt and held-back positions, and the run configs in configs/."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from pipeline.actor.episodes import Episode, EpisodePlayer, actor_prompt
from pipeline.actor.metrics import episode_metrics, summary_line
from pipeline.actor.schedule import scheduled_id
from pipeline.envs.registry import task_pool
from pipeline.errors import ConfigError
from pipeline.settings import Settings
from schemas.base import Producer
from schemas.trajectories import Timings, TrajectoryCompleted, Turn
from workers.rollout import Rollout

CONFIGS = sorted((Path(__file__).resolve().parents[3] / "configs").glob("*.yaml"))
PRODUCER = Producer(worker="scheduler", instance="s-0")


def _settings(eval_tasks_per_env: int = 8, **scheduler: object) -> Settings:
    return Settings(scheduler={"steps": 6, **scheduler},
                    envs={"tasks": [{"env_id": "MiniHack-Room-Random-5x5-v0"}],
                          "eval_tasks_per_env": eval_tasks_per_env},
                    actor_trainer={"group_size": 4, "groups_per_step": 2, "warmup_steps": 2})


def test_required_version_is_the_staleness_bound():
    on_policy = _settings()
    assert [on_policy.schedule().required_version(s) for s in range(6)] == [0, 0, 0, 1, 2, 3]  # steps 0, 1 are warm-up
    stale = _settings(staleness=1)
    assert [stale.schedule().required_version(s) for s in range(6)] == [0, 0, 0, 0, 1, 2]
    for frozen_actor in ("exp_only", "frozen"):
        assert [_settings(arm=frozen_actor).schedule().required_version(s) for s in range(6)] == [0] * 6


def test_guided_slots_merges_and_evaluations():
    settings = _settings(merge_every=2, eval_every=4)
    assert [settings.schedule().guided_slots(s) for s in range(4)] == [0, 0, 2, 2]
    assert [_settings(arm="grpo").schedule().guided_slots(s) for s in range(4)] == [0, 0, 0, 0]
    assert [settings.schedule().merge_due(s) for s in range(6)] == [False, False, True, False, True, False]
    assert not any(_settings(arm="grpo", merge_every=2).schedule().merge_due(s) for s in range(6))
    # Evaluation every 4 steps and after the last.
    assert [settings.schedule().eval_due(s) for s in range(6)] == [True, False, False, False, True, True]
    assert not any(_settings(eval_every=0).schedule().eval_due(s) for s in range(6))


def test_train_assignments_are_groups_of_one_task_with_deterministic_ids():
    schedule = _settings().schedule()
    step3 = schedule.train_assignments("run", PRODUCER, 3)
    assert len(step3) == 8 and [(a.group_id, a.slot, a.guided) for a in step3[:4]] == [
        ("s000003-g000", 0, True), ("s000003-g000", 1, True), ("s000003-g000", 2, False), ("s000003-g000", 3, False)]
    assert len({a.seed for a in step3[:4]}) == 1 and all(a.policy_version == 1 for a in step3)
    assert all(a.max_turns == 30 and a.task_family == "minihack-room" and a.split == "train" for a in step3)
    assert [a.event_id for a in step3] == [a.event_id for a in schedule.train_assignments("run", PRODUCER, 3)]
    assert step3[0].event_id == scheduled_id("run", "train", 3, 0, 0)
    assert not {a.event_id for a in step3} & {a.event_id for a in schedule.train_assignments("other", PRODUCER, 3)}


def test_eval_assignments_cover_the_fixed_eval_pool_guided_and_free():
    settings = _settings(eval_tasks_per_env=3)
    episodes = settings.schedule().eval_assignments("run", PRODUCER, 4)
    pool = task_pool("MiniHack-Room-Random-5x5-v0", "eval", 3, 0)
    assert [(a.seed, a.slot, a.guided) for a in episodes] == [(s, slot, slot == 0) for s in pool for slot in (0, 1)]
    assert all(a.split == "eval" and a.group_size == 2 for a in episodes)
    grpo = _settings(arm="grpo", eval_tasks_per_env=3).schedule().eval_assignments("run", PRODUCER, 4)
    assert [(a.slot, a.guided, a.group_size) for a in grpo] == [(0, False, 1)] * 3
    fixed = Settings(envs={"seed": 5, "eval_seed": 0, "eval_tasks_per_env": 3})  # another run's seed, the same pool
    assert [a.seed for a in fixed.schedule().eval_assignments("run", PRODUCER, 4)][::2] == list(pool)


def test_recurring_train_tasks_are_evaluated_beside_the_unseen_ones():
    settings = Settings(envs={"tasks": [{"env_id": "MiniHack-DarkCorridor-v0"}], "eval_tasks_per_env": 2,
                              "train_pool_size": 5, "eval_recurring_per_env": 3},
                        actor_trainer={"group_size": 4, "groups_per_step": 2, "warmup_steps": 1})
    episodes = settings.schedule().eval_assignments("run", PRODUCER, 4)
    unseen = task_pool("MiniHack-DarkCorridor-v0", "eval", 2, 0)
    recurring = task_pool("MiniHack-DarkCorridor-v0", "train", 5, 0)[:3]
    assert [(a.group_id[-4:], a.seed, a.slot) for a in episodes] == \
        [(f"t{t:03d}", seed, slot) for t, seed in enumerate(unseen) for slot in (0, 1)] + \
        [(f"r{t:03d}", seed, slot) for t, seed in enumerate(recurring) for slot in (0, 1)]
    assert len({a.event_id for a in episodes}) == 10 and all(a.split == "eval" for a in episodes)
    repeated = settings.model_copy(update={"envs": settings.envs.model_copy(update={"eval_repeats": 3})})
    episodes = repeated.schedule().eval_assignments("run", PRODUCER, 4)
    assert len(episodes) == 5 * 6 and all(a.group_size == 6 for a in episodes)
    assert [(a.slot, a.guided) for a in episodes[:6]] == [(0, True), (1, True), (2, True), (3, False), (4, False),
                                                          (5, False)]
    grpo = repeated.model_copy(update={"scheduler": repeated.scheduler.model_copy(update={"arm": "grpo"})})
    assert [(a.slot, a.guided) for a in grpo.schedule().eval_assignments("run", PRODUCER, 4)[:3]] == [
        (0, False), (1, False), (2, False)]
    with pytest.raises(ValidationError, match="exceeds train_pool_size"):
        Settings(envs={"train_pool_size": 2, "eval_recurring_per_env": 3})


def _trajectory(env_id: str, guided: bool, success: bool, actions: int, invalid: int) -> TrajectoryCompleted:
    turn = Turn(observation="o", prompt_token_ids=(1,), response_token_ids=(2,), sampling_logprobs=(-1.0,),
                response_text="x", action="east", valid=True, reward=0.0)
    return TrajectoryCompleted(
        run_id="r", producer=PRODUCER, trajectory_id=f"t-{env_id}-{guided}-{success}-{actions}",
        assignment_event_id="a", step=0, split="train", env_id=env_id, task_family="f", seed=0, group_id="g", slot=0,
        guided=guided, goal="g", turns=(turn,), reward=float(success), success=success, num_actions=actions,
        invalid_actions=invalid, truncated=not success, timings=Timings(generation_s=0, env_s=0, retrieval_s=0),
        retrieved=(), policy_version=0)


def test_episode_metrics_hand_worked():
    trajectories = [_trajectory("Room", True, True, 4, 1), _trajectory("Room", True, False, 10, 5),
                    _trajectory("Room", False, True, 8, 0), _trajectory("Maze", False, False, 6, 0)]
    m = episode_metrics(trajectories, "train")
    assert m["train/all/episodes"] == 4 and m["train/all/success"] == 0.5
    assert m["train/all/actions_per_solved"] == 6.0  # (4 + 8) / 2
    assert m["train/all/invalid_rate"] == 6 / 28
    assert m["train/guided/success"] == 0.5 and m["train/free/success"] == 0.5
    assert m["train/Room/guided/actions_per_solved"] == 4.0 and m["train/Room/invalid_rate"] == 6 / 22
    assert "train/Maze/actions_per_solved" not in m and m["train/Maze/free/success"] == 0.0
    assert summary_line(m, "train") == "success 0.50 (guided 0.50, free 0.50), 6.0 actions per solved, 21% invalid"


def test_actor_prompt_shows_the_experience_but_the_observation_stays_clean():
    assignment = _settings().schedule().train_assignments("run", PRODUCER, 3)[0]
    episode = Episode(assignment, ("crl.tasks", 0), 7, env=None, goal="reach the staircase down (>)",  # type: ignore[arg-type]
                      observation="Map:\n.@>", experience="Walk east to the stairs.", history=["east", "(invalid)"])
    prompt = actor_prompt(episode, history_turns=1, asks_left=0)
    assert prompt == ("Task: MiniHack-Room-Random-5x5-v0. Goal: reach the staircase down (>)\n"
                      "Experience: Walk east to the stairs.\nPrevious actions: (invalid)\nObservation:\nMap:\n.@>\n"
                      "Action:")
    assert "ask <question> (2 left)" in actor_prompt(episode, history_turns=0, asks_left=2)


def test_rollout_commits_no_further_than_its_oldest_unfinished_episode():
    rollout = Rollout.__new__(Rollout)  # only the bookkeeping is under test
    from collections import deque

    from pipeline.runtime.runner import Origin

    assignment = _settings().schedule().train_assignments("run", PRODUCER, 0)[0]
    rollout.player = EpisodePlayer.__new__(EpisodePlayer)
    rollout.player.active = [Episode(assignment, ("crl.tasks", 1), 5, None, "g", "o")]  # type: ignore[arg-type]
    rollout.queue = deque([(assignment, Origin("crl.tasks", 2, 9, 0, None))])
    assert rollout.committable({("crl.tasks", 0): 4, ("crl.tasks", 1): 12, ("crl.tasks", 2): 10}) == {
        ("crl.tasks", 0): 4, ("crl.tasks", 1): 5, ("crl.tasks", 2): 9}


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_run_config_validates(path):
    settings = Settings(config=path)
    assert settings.config == path
    assert settings.envs.tasks and settings.actor_trainer.group_size % 2 == 0
    if path.name.startswith("paper-"):
        assert settings.actor_trainer.group_size == 8 and settings.rollout.generation.backend == "vllm"
        assert settings.extractor.generation.backend == "vllm"
        assert settings.actor_trainer.lr == 1e-6 and settings.extractor_trainer.buffer_size == 64
    else:
        assert settings.actor_trainer.model.path is None  # the tiny preset


def test_run_config_errors_name_the_problem(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        Settings(config=tmp_path / "missing.yaml")
    (tmp_path / "typo.yaml").write_text("schedular: {steps: 3}\n")
    with pytest.raises(ConfigError, match=r"schedular in .*typo.yaml: unknown key; did you mean scheduler\?"):
        Settings(config=tmp_path / "typo.yaml")
    (tmp_path / "env.yaml").write_text("envs: {tasks: [{env_id: Pong}]}\n")
    with pytest.raises(ValidationError, match=r"envs.tasks\[0\].env_id: unknown env id 'Pong'"):
        Settings(config=tmp_path / "env.yaml")


def test_environment_variables_override_the_run_config(monkeypatch):
    monkeypatch.setenv("CRL_SCHEDULER__STEPS", "3")
    settings = Settings(config=next(p for p in CONFIGS if p.name == "tiny-minihack-room.yaml"))
    assert settings.scheduler.steps == 3 and settings.actor_trainer.group_size == 8
