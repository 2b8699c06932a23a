"""What `crl run` shows, from hand-made events: the warm starts' progress, how many of a step's episodes have finished,
the ETA (measured, or `-`), the live table's header, and the summary lines off a terminal; and how a trainer
publishes its warm start's progress (throttled, with ids a restart reproduces).

Run: pytest tests/unit/run/test_live_view.py
"""

from __future__ import annotations

import io
import re
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

from rich.console import Console

from pipeline.actor.schedule import finished_id
from pipeline.actor.settings import SchedulerSettings
from pipeline.rl.warm_progress import WarmStartReporter, warm_start_id
from pipeline.run.progress import RunProgress
from pipeline.run.supervisor import RunSupervisor
from pipeline.run.view import live_view, numbers, summary_line
from pipeline.settings import LaunchSettings, Settings
from schemas.base import Event, Producer
from schemas.runs import RunFinished
from schemas.tasks import EpisodeAssigned
from schemas.training import WarmStartProgressed
from schemas.trajectories import Timings, TrajectoryCompleted

WHO = Producer(worker="t", instance="t-0")
T0 = datetime(2026, 1, 1, tzinfo=UTC)


def _warm(role: str, phase: str, done: int, total: int, elapsed_s: float, loss: float | None = None,
          cached: bool = False) -> WarmStartProgressed:
    return WarmStartProgressed(run_id="r", producer=WHO, role=role, phase=phase, done=done, total=total,  # type: ignore[arg-type]
                               loss=loss, cached=cached, elapsed_s=elapsed_s)


def _assigned(step: int, slot: int, split: str = "train", at: float = 0.0) -> EpisodeAssigned:
    return EpisodeAssigned(run_id="r", producer=WHO, occurred_at=T0 + timedelta(seconds=at), step=step,
                           split=split, env_id="room", task_family="room", seed=1,  # type: ignore[arg-type]
                           group_id=f"s{step}-{split}", slot=slot, group_size=4, guided=slot < 2, policy_version=0,
                           max_turns=6)


def _played(assignment: EpisodeAssigned, success: bool, at: float) -> TrajectoryCompleted:
    return TrajectoryCompleted(
        run_id="r", producer=WHO, occurred_at=T0 + timedelta(seconds=at),
        trajectory_id=f"traj-{assignment.event_id}", assignment_event_id=str(assignment.event_id),
        step=assignment.step, split=assignment.split, env_id="room", task_family="room", seed=1,
        group_id=assignment.group_id, slot=assignment.slot, guided=assignment.guided, goal="g", turns=(),
        reward=float(success), success=success, num_actions=0, invalid_actions=0, truncated=False,
        policy_version=0, timings=Timings(generation_s=0, env_s=0, retrieval_s=0))


def _figures(progress: RunProgress, *events: Event, steps: int = 4) -> dict[str, str]:
    for event in events:
        progress.add(event, 0)
    return numbers(progress, threading.Lock(), steps)


def test_the_warm_starts_show_phase_step_loss_and_an_eta_from_their_own_step_rate():
    progress = RunProgress("r")
    figures = _figures(progress)
    assert "warm start" not in figures and figures["ETA"] == "-" and figures["train"] == "-"
    starting = numbers(progress, threading.Lock(), 12, warming=("actor", "extractor"))
    assert starting["warm start"] == "actor starting | extractor starting", "before their first progress event"
    figures = _figures(progress, _warm("actor", "data", 0, 256, 0.0))
    assert figures["warm start"] == "actor data 0/256" and figures["ETA"] == "-"
    assert numbers(progress, threading.Lock(), 12, warming=("actor", "extractor"))["warm start"] == \
        "extractor starting | actor data 0/256"
    figures = _figures(progress, _warm("actor", "train", 0, 250, 10.0), _warm("actor", "train", 100, 250, 60.0, 1.234),
                       _warm("extractor", "data", 40, 64, 20.0))
    assert figures["warm start"] == "actor train 100/250 loss 1.234 | extractor data 40/64"
    assert figures["ETA"] == "-", "the extractor's fine-tuning has not started: its rate is not measured yet"
    figures = _figures(progress, _warm("extractor", "train", 0, 400, 30.0),
                       _warm("extractor", "train", 200, 400, 80.0, 2.5))
    # actor: 0.5 s a step, 150 left = 75 s; extractor: 0.25 s a step, 200 left = 50 s; both run at once
    assert figures["ETA"] == "1m15s (warm start)"
    figures = _figures(progress, _warm("actor", "done", 250, 250, 135.0, 0.8),
                       _warm("extractor", "done", 400, 400, 0.1, 0.5, cached=True))
    assert figures["warm start"] == \
        "actor done 250/250 loss 0.800 in 2m15s | extractor done 400/400 loss 0.500 (cached)"
    assert figures["ETA"] == "-", "no train step has finished: nothing to measure the run's pace by"


def test_a_step_shows_how_many_of_its_episodes_finished_and_the_eta_follows_measured_step_times():
    progress = RunProgress("r")
    step0 = [_assigned(0, slot) for slot in range(4)]
    evaluation = [_assigned(0, slot, "eval") for slot in range(2)]
    figures = _figures(progress, *step0, *evaluation, _played(step0[0], True, 10), _played(step0[2], False, 12),
                       _played(step0[2], True, 13))  # the same episode again (re-delivered): counted once
    assert figures["step"] == "1/4"
    assert figures["train"] == "step 0: 2/4 done, guided 1.00, free 0.00"
    assert figures["eval"] == "-" and figures["ETA"] == "-"
    figures = _figures(progress, _played(step0[1], False, 20), _played(step0[3], True, 30),
                       _played(evaluation[0], True, 25))
    assert figures["train"] == "step 0: 4/4 done, guided 0.50, free 0.50"
    assert figures["eval"] == "step 0: 1/2 done, guided 1.00, free -"
    assert figures["ETA"] == "1m30s (3 steps x 30s)", "step 0: 30 s from its first assignment to its last episode"
    step1 = [_assigned(1, slot, at=31) for slot in range(4)]
    figures = _figures(progress, *step1, *(_played(a, True, 41 + i * 3) for i, a in enumerate(step1)))
    assert figures["train"] == "step 1: 4/4 done, guided 1.00, free 1.00"
    assert figures["ETA"] == "40s (2 steps x 20s)", "from step 0's last episode (30 s) to step 1's (50 s)"
    progress.add(RunFinished(run_id="r", producer=WHO, event_id=finished_id("r", 0), status="completed",
                             steps_completed=4), 0)
    assert numbers(progress, threading.Lock(), 4)["ETA"] == "done"


def test_a_step_whose_episodes_are_read_before_its_assignments_still_finishes_when_its_last_episode_did():
    # One read of several topics may bring a step's trajectories first (a busy machine, a view catching up).
    progress = RunProgress("r")
    step0 = [_assigned(0, slot) for slot in range(4)]
    figures = _figures(progress, *(_played(a, True, 10 + i) for i, a in enumerate(step0)))
    assert figures["ETA"] == "-", "no assignment read yet: nothing is known to have finished"
    assert _figures(progress, *step0[:3])["ETA"] == "-", "four played, three assigned so far: not yet the step"
    assert _figures(progress, step0[3])["ETA"] == "39s (3 steps x 13s)", "from its first assignment to 13 s"


def test_the_live_table_shows_elapsed_time_and_the_eta_in_its_header(tmp_path):
    progress = RunProgress("r")
    figures = _figures(progress, _warm("actor", "train", 0, 250, 10.0), _warm("actor", "train", 100, 250, 60.0, 1.234))
    console = Console(file=io.StringIO(), width=200, record=True)
    console.print(live_view(figures, run_id="r", arm="complementary", run_dir=tmp_path, started=time.monotonic() - 125,
                            workers=[]))
    screen = console.export_text()
    assert f"r  arm complementary  elapsed 2m05s  ETA 1m15s (warm start)  ({tmp_path})" in screen
    assert re.search(r"^warm start +actor train 100/250 loss 1\.234 *$", screen, re.M), screen
    assert not re.search(r"^ETA", screen, re.M), "the ETA is in the header, not a row of its own"


def test_off_a_terminal_the_same_figures_come_one_line_at_a_time(tmp_path):
    output = io.StringIO()
    settings = Settings(run_dir=tmp_path / "run", scheduler=SchedulerSettings(steps=12),
                        launch=LaunchSettings(progress_interval_s=0.01))
    supervisor = RunSupervisor(settings, Console(file=output, width=80))  # not a terminal: summary lines
    for event in (_warm("actor", "done", 250, 250, 95.0, 0.8), _warm("extractor", "train", 10, 400, 30.0, 3.0),
                  RunFinished(run_id=supervisor.run_id, producer=WHO, status="completed", steps_completed=0,
                              event_id=finished_id(supervisor.run_id, 0))):
        supervisor.progress.add(event.model_copy(update={"run_id": supervisor.run_id}), 0)
    supervisor.progress.last_record = time.time() - 10  # drained: nothing new for a while, no live worker
    supervisor._watch()
    lines = output.getvalue().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].endswith(
        "] ETA done | warm start actor done 250/250 loss 0.800 in 1m35s | extractor train 10/400 loss 3.000 | "
        "step 0/12 | train - | eval - | bank 0 active | ops - | parse - | versions actor v0, extractor v0 | "
        "actor loss - | extractor reward -"), lines[0]
    assert lines[0].split("] ", 1)[1] == summary_line(supervisor._figures(), supervisor.started).split("] ", 1)[1]


def test_the_reporter_publishes_the_first_and_last_of_each_phase_and_at_most_one_a_second_between():
    published: list[WarmStartProgressed] = []
    now = [100.0]
    reporter = WarmStartReporter("r", "actor", WHO, published.append, clock=lambda: now[0])
    for done in range(65):  # 64 data episodes, 1/8 s each
        reporter("data", done, 64)
        now[0] += 0.125
    for done in range(11):  # 10 steps, 1/2 s each
        reporter("train", done, 10, loss=None if done == 0 else 5.0 - done)
        now[0] += 0.5
    reporter("done", 10, 10, loss=float("nan"))
    points = [(e.phase, e.done) for e in published]
    assert points == [*(("data", done) for done in range(0, 65, 8)), *(("train", done) for done in range(0, 11, 2)),
                      ("done", 10)], points
    assert published[-2].loss == -5.0 and published[-1].loss is None, "a loss that is not finite is left out"
    assert published[0].elapsed_s == 0.0 and published[-1].elapsed_s == 13.625
    assert [e.event_id for e in published] == [warm_start_id("r", "actor", e.phase, e.done) for e in published]
    assert warm_start_id("r", "actor", "train", 3) != warm_start_id("r", "extractor", "train", 3)


def test_a_warm_start_from_the_cache_publishes_one_done(tmp_path: Path):
    from pipeline.actor.settings import RolloutSettings
    from pipeline.envs.settings import EnvSettings, TaskMix
    from pipeline.models.settings import TinyModelSettings
    from pipeline.models.tiny import build_tiny
    from pipeline.rl.settings import WarmStartSettings
    from pipeline.rl.warm_start import warm_start_actor

    tiny = TinyModelSettings(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64,
                             vocab_size=512, corpus_episodes=4)
    settings = WarmStartSettings(steps=3, episodes=4, batch_size=4, cache_dir=tmp_path)
    tasks = [TaskMix(env_id="MiniHack-Room-Random-5x5-v0", max_turns=6)]
    runs = []
    for _ in range(2):
        published: list[WarmStartProgressed] = []
        warm_start_actor(build_tiny(tiny), settings, tasks, EnvSettings(), RolloutSettings(history_turns=1),
                         progress=WarmStartReporter("r", "actor", WHO, published.append, interval_s=3600))
        runs.append([(e.phase, e.done, e.total, e.cached) for e in published])
    computed, cached = runs
    assert computed == [("data", 0, 4, False), ("data", 4, 4, False), ("train", 0, 3, False), ("train", 3, 3, False),
                        ("done", 3, 3, False)]
    assert cached == [("done", 3, 3, True)]


def test_a_missed_warm_start_gate_is_said_plainly_in_red(tmp_path):
    from schemas.training import WarmStartGateCheck

    passed = (WarmStartGateCheck(name="min_success_right", value=0.95, bound=0.8, samples=32, passed=True),)
    missed = (WarmStartGateCheck(name="min_parse_ok", value=1.0, bound=0.9, samples=96, passed=True),
              WarmStartGateCheck(name="min_states_revealed", value=0.42, bound=0.9, samples=74, passed=False))
    progress = RunProgress("r")
    figures = _figures(progress, _warm("actor", "train", 100, 250, 60.0, 1.234))
    assert "warm-start gate" not in figures, "no gate is known before a warm start is done"
    figures = _figures(progress, _warm("actor", "done", 250, 250, 90.0, 0.8).model_copy(update={"gate": passed}),
                       _warm("extractor", "done", 1000, 1000, 400.0, 0.1).model_copy(update={"gate": missed}))
    assert figures["warm-start gate"] == \
        "actor passed | extractor MISSED: states_revealed 0.42 >= 0.90 (74) MISSED"
    console = Console(file=io.StringIO(), width=200, record=True, force_terminal=True, color_system="truecolor")
    console.print(live_view(figures, run_id="r", arm="complementary", run_dir=tmp_path, started=time.monotonic(),
                            workers=[]))
    styled = console.export_html(inline_styles=True)
    row = next(line for line in styled.splitlines() if "extractor MISSED" in line)
    assert '<span style="color: #800000; text-decoration-color: #800000; font-weight: bold">actor passed | ' \
        'extractor MISSED' in row, row
