"""`crl run` end to end on signpost corridors (configs/tiny-signpost-corridor.yaml): every worker a process on an
embedded broker, lessons keyed by the goal and the first observation with no similarity floor, every evaluated
corridor unseen; then both replays must match, the run must print its extractor's rule share, and the report must
carry the lesson-quality panel."""

from __future__ import annotations

from pathlib import Path

import pytest
from crl_process import assert_replays_match, crl, crl_run, run_env

from pipeline.audit.learning import lesson_kinds
from pipeline.audit.views import Audit

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1500)]

# Short warm starts: what is checked here is the loop and its replays, not competence (docs/benchmarks.md has that).
SHORT = {"CRL_ACTOR_TRAINER__WARM_START__STEPS": "40", "CRL_ACTOR_TRAINER__WARM_START__EPISODES": "48",
         "CRL_EXTRACTOR_TRAINER__WARM_START__STEPS": "200", "CRL_EXTRACTOR_TRAINER__WARM_START__EPISODES": "32"}


@pytest.fixture(scope="module")
def signpost_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str], str]:
    # Three steps of two groups of 8: step 0 fills the bank, steps 1 and 2 are guided; 4 unseen corridors evaluated
    # twice each, guided and free, before training and at the last step.
    run_dir = tmp_path_factory.mktemp("e2e") / "signpost"
    env = run_env(**SHORT, CRL_ACTOR_TRAINER__GROUPS_PER_STEP="2", CRL_SCHEDULER__EVAL_EVERY="2",
                  CRL_ENVS__EVAL_TASKS_PER_ENV="4", CRL_ENVS__EVAL_REPEATS="2")
    output = crl_run("configs/tiny-signpost-corridor.yaml", 3, run_dir, env)
    return run_dir, env, output


def test_the_run_evaluates_unseen_corridors_and_keys_lessons_by_goal_and_first_observation(signpost_run):
    run_dir, _env, output = signpost_run
    assert "completed" in output
    for kind in ("guided", "free"):
        assert any(line.startswith(f"eval success, unseen tasks (4), {kind}: ") for line in output.splitlines())
    assert "  guided - free at step 2: " in output
    with Audit(run_dir) as audit:
        pools = {row[0] for row in audit.query(
            "SELECT DISTINCT split_part(group_id, '-', -1)[1] FROM trajectories WHERE split = 'eval'")[1]}
        assert pools == {"t"}, "every evaluated corridor is unseen"
        # no similarity floor: once the bank holds a lesson (it only adds and refines here: no merges, capacity far
        # off), every guided episode is served one, whichever corridor it plays
        unserved = audit.query("SELECT count(*) FROM trajectories WHERE guided AND bank_offset > 0 "
                               "AND json_array_length(served) = 0")[1][0][0]
    assert unserved == 0
    kinds = lesson_kinds(run_dir)
    if kinds:  # a short warm start may write no lesson of a revealing episode; when it does, the run says its share
        assert "lessons stating the rule, of revealing episodes: extractor version " in output


def test_both_replays_match_and_the_report_has_the_lesson_quality_panel(signpost_run):
    run_dir, env, _output = signpost_run
    assert_replays_match(run_dir, env, 2)
    report = crl("report", str(run_dir), env=env)
    assert report.returncode == 0, report.stdout + report.stderr
    assert 'id="lesson-quality"' in (run_dir / "report" / "report.html").read_text()
