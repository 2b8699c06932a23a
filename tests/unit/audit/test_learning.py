"""Learning statistics of runs (`pipeline.audit.learning`): what is read from an archive, and every statistic worked
out by hand on small runs.

Run: pytest tests/unit/audit/test_learning.py
"""

from __future__ import annotations

import pytest
from test_report import KEY, archived, common, episode

from pipeline.audit.learning import (
    RunOutcomes,
    TrainGroup,
    arm_difference,
    arm_ratio,
    arm_table,
    eval_rise,
    eval_success,
    gap_curve,
    guided_gap,
    load_outcomes,
    ratio_at_equal_env_steps,
    success_curve,
    verdict,
    verdict_lines,
    within_budget,
)
from pipeline.audit.stats import Estimate
from pipeline.errors import InvalidArgumentError
from schemas.runs import RunStarted

ENV = "MiniHack-Room-Random-5x5-v0"


def outcomes(evals, train=(), arm="complementary", warmup=0, name="r") -> RunOutcomes:
    return RunOutcomes(run_dir=None, run_id=name, arm=arm, warmup=warmup, evals=evals,  # type: ignore[arg-type]
                       train=tuple(train))


def test_an_archive_gives_outcomes_per_eval_task_and_per_train_group(tmp_path):
    def eval_episode(step, pool, task, slot, guided, success):
        e = episode("run-a", step, "eval", slot, success, 3, guided=guided)
        return e.model_copy(update={"group_id": f"eval-s{step:06d}-{ENV}-{pool}{task:03d}", "seed": 100 + task,
                                    "trajectory_id": f"eval-{step}-{pool}{task}-{slot}"})

    events = [
        RunStarted(**common("run-a"), config={"scheduler": {"arm": "grpo"}, "actor_trainer": {"warmup_steps": 1}},
                   code_version="x"),
        episode("run-a", 0, "train", 0, True, 4, guided=True), episode("run-a", 0, "train", 1, False, 6),
        episode("run-a", 1, "train", 0, False, 5), episode("run-a", 1, "train", 1, True, 2),
        eval_episode(0, "t", 0, 0, True, True), eval_episode(0, "t", 0, 1, False, False),
        eval_episode(0, "r", 1, 0, False, True), eval_episode(2, "t", 0, 0, True, False),
    ]
    run = load_outcomes(archived(tmp_path / "a", events))
    assert (run.run_id, run.arm, run.warmup) == ("run-a", "grpo", 1)
    named = RunStarted(**common("run-b"), config={"scheduler": {"arm": "grpo", "variant": "grpo-frozen"}},
                       code_version="x")
    assert load_outcomes(archived(tmp_path / "b", [named])).arm == "grpo-frozen", "a named variant pools apart"
    assert run.evals == {(0, ENV, "t", 100): {True: [True], False: [False]},
                         (0, ENV, "r", 101): {True: [], False: [True]},
                         (2, ENV, "t", 100): {True: [False], False: []}}
    assert run.train == (TrainGroup(0, "train-s0", (True,), (False,), 10, (1,)),
                         TrainGroup(1, "train-s1", (), (False, True), 7, (0, 1)))
    assert run.eval_steps("t") == [0, 2] and run.eval_steps("r") == [0]
    assert run.evaluation("t", "last") == {(ENV, 100): {True: [False], False: []}}


# Two runs, three unseen tasks each, evaluated at steps 0 and 9: per task (guided outcomes, free outcomes).
RUN_1 = outcomes({
    (0, ENV, "t", 1): {True: [False, False], False: [False, True]},
    (0, ENV, "t", 2): {True: [True, False], False: [False, False]},
    (0, ENV, "t", 3): {True: [False, False], False: [True, True]},
    (9, ENV, "t", 1): {True: [True, True], False: [True, True]},
    (9, ENV, "t", 2): {True: [True, True], False: [False, True]},
    (9, ENV, "t", 3): {True: [True, False], False: [True, True]},
}, name="one")
RUN_2 = outcomes({
    (0, ENV, "t", 1): {True: [False, False], False: [False, False]},
    (9, ENV, "t", 1): {True: [True, True], False: [False, True]},
}, name="two")


def test_success_before_and_after_pool_every_episode_of_every_run():
    # before, free: run 1 has 1 + 0 + 2 of 6, run 2 0 of 2: 3 / 8; after, free: 2 + 1 + 2 + 1 of 8
    assert eval_success([RUN_1, RUN_2], "t", "first", guided=False).value == pytest.approx(3 / 8)
    assert eval_success([RUN_1, RUN_2], "t", "last", guided=False).value == pytest.approx(6 / 8)
    assert eval_success([RUN_1, RUN_2], "r", "first", guided=False) is None


def test_the_rise_pairs_each_task_with_itself():
    # free: task 1 (1 - 0.5), task 2 (0.5 - 0), task 3 (1 - 1), run 2's task (0.5 - 0): mean of 0.5, 0.5, 0, 0.5
    rise = eval_rise([RUN_1, RUN_2], "t", guided=False)
    assert rise.value == pytest.approx(0.375)
    assert rise.low <= rise.value <= rise.high
    # guided: (1 - 0), (1 - 0.5), (0.5 - 0), (1 - 0): 0.75; every unit is positive, so the whole interval is
    rise = eval_rise([RUN_1, RUN_2], "t", guided=True)
    assert rise.value == pytest.approx(0.75) and rise.low > 0
    assert verdict(rise) == "rose"
    one_evaluation = outcomes({(0, ENV, "t", 1): {True: [True], False: [False]}})
    assert eval_rise([one_evaluation], "t", guided=False) is None


def test_the_gap_is_guided_minus_free_on_each_task_at_the_last_evaluation():
    # run 1 at step 9: (1 - 1), (1 - 0.5), (0.5 - 1); run 2: (1 - 0.5): mean of 0, 0.5, -0.5, 0.5
    assert guided_gap([RUN_1, RUN_2], "t").value == pytest.approx(0.125)
    # at step 0: (0 - 0.5), (0.5 - 0), (0 - 1), (0 - 0)
    assert guided_gap([RUN_1, RUN_2], "t", "first").value == pytest.approx(-0.25)


def test_verdicts_read_the_interval():
    assert verdict(Estimate(0.2, 0.05, 0.3)) == "rose"
    assert verdict(Estimate(-0.2, -0.3, -0.01)) == "fell"
    assert verdict(Estimate(0.1, -0.02, 0.2)) == "no clear change"
    assert verdict(None) == "not measured (one evaluation)"


def test_the_arm_table_pools_the_runs_of_each_arm():
    grpo = outcomes({(0, ENV, "t", 1): {True: [], False: [False]}, (5, ENV, "t", 1): {True: [], False: [True]}},
                    arm="grpo")
    rows = arm_table([RUN_1, grpo, RUN_2])
    assert [(r.arm, r.runs, r.pool, r.kind, r.tasks) for r in rows] == [
        ("complementary", 2, "unseen", "guided", 4), ("complementary", 2, "unseen", "free", 4),
        ("grpo", 1, "unseen", "free", 1)]
    guided, free, alone = rows
    assert guided.rise.value == pytest.approx(0.75) and guided.gap.value == pytest.approx(0.125)
    assert free.gap is None and free.after.value == pytest.approx(6 / 8)
    # one task that went from 0 to 1: every resample agrees
    assert (alone.before.value, alone.after.value, alone.rise.value, alone.rise.low) == (0.0, 1.0, 1.0, 1.0)
    assert alone.verdict == "rose"


def test_a_run_states_in_words_whether_success_rose():
    lines = verdict_lines(RUN_1)
    assert lines[0].startswith("eval success, unseen tasks (3), guided: 0.17 [") and "at step 0 -> 0.83 [" in lines[0]
    assert lines[0].split(": ")[-1].startswith(("rose", "no clear change"))
    assert lines[1].startswith("  guided - free at step 9: +0.00 [")
    assert lines[2].startswith("eval success, unseen tasks (3), free: 0.50 [") and "-> 0.83 [" in lines[2]


def group(step, group_id, guided, free, actions, free_slots=None):
    slots = tuple(range(len(guided), len(guided) + len(free))) if free_slots is None else tuple(free_slots)
    return TrainGroup(step, group_id, tuple(guided), tuple(free), actions, slots)


def test_arms_compare_at_equal_environment_steps():
    # arm A: step 0 is the warm-up; steps 1 and 2 train. Arm B never warms up. B plays fewer actions in all (25):
    # the budget. A: steps begun before 25 actions were spent are 0 (0 spent), 1 (10), 2 (20) -> 1 and 2 count.
    a = outcomes({}, [group(0, "g0", [], [True, False], 10), group(1, "g0", [True, True], [False, False], 10),
                      group(2, "g0", [True], [True], 10)], warmup=1)
    b = outcomes({}, [group(0, "g0", [], [True, False], 5), group(1, "g0", [], [True, False, False, False], 10),
                      group(2, "g0", [], [False, False], 10)])
    assert set(within_budget(a, 25)) == {(1, "g0"), (2, "g0")}
    assert set(within_budget(b, 25)) == {(0, "g0"), (1, "g0"), (2, "g0")}
    ratio, budget = ratio_at_equal_env_steps([a], [b])
    # pairs (1, g0) and (2, g0): A 2 + 2 of 4 + 2, B 1 + 0 of 4 + 2: (4 / 6) / (1 / 6) = 4
    assert budget == 25 and ratio.value == pytest.approx(4.0)
    with pytest.raises(InvalidArgumentError, match="pair run by run"):
        ratio_at_equal_env_steps([a], [b, b])
    # Free slots only: A's free slots (2, 3 at step 1; 1 at step 2) against B's episodes in the same slots.
    b_better = outcomes({}, [group(0, "g0", [], [True, False], 5), group(1, "g0", [], [True, False, True, False], 10),
                             group(2, "g0", [], [True, True], 10)])
    free, _ = ratio_at_equal_env_steps([a], [b_better], slots="free")
    # step 1: A [F, F] vs B slots 2, 3 [T, F]; step 2: A [T] vs B slot 1 [T]: (1 / 3) / (2 / 3) = 0.5
    assert free.value == pytest.approx(0.5)


def test_success_curves_put_each_step_at_the_mean_environment_steps_played_by_its_end():
    a = outcomes({}, [group(0, "g0", [True], [False], 10), group(1, "g0", [True], [True], 6)])
    b = outcomes({}, [group(0, "g0", [False], [False], 20), group(1, "g0", [True], [False], 4)])
    curve = success_curve([a, b], lambda g: g.guided + g.free)
    assert [(p.step, p.env_steps) for p in curve] == [(0, 15.0), (1, 20.0)]
    assert [p.success.value for p in curve] == [pytest.approx(0.25), pytest.approx(0.75)]
    assert all(p.success.low <= p.success.value <= p.success.high for p in curve)
    free_only = success_curve([a, b], lambda g: g.free)
    assert [p.success.value for p in free_only] == [0.0, 0.5]


def test_the_gap_curve_is_pooled_guided_minus_pooled_free_success_per_step():
    # step 0: g0 guided 2/2, free 0/2; g1 guided 1/2, free 1/2 -> guided 3/4 - free 1/4 = 0.5. step 1: a group with
    # no guided half (the warm-up) has no gap to give; g1 guided 0/2, free 2/2 -> -1.
    run = outcomes({}, [group(0, "g0", [True, True], [False, False], 8),
                        group(0, "g1", [True, False], [True, False], 4),
                        group(1, "g0", [], [True, False], 6), group(1, "g1", [False, False], [True, True], 2)])
    curve = gap_curve([run])
    assert [(p.step, p.env_steps, p.success.value) for p in curve] == [(0, 12.0, 0.5), (1, 20.0, -1.0)]
    assert all(p.success.low <= p.success.value <= p.success.high for p in curve)
    assert gap_curve([outcomes({}, [group(0, "g0", [], [True], 3)])]) == []


def test_a_run_with_one_evaluation_says_so_for_each_pool():
    """A run stopped after its first evaluation (Ctrl-C during step 0): each pool's line names that one step."""
    run = outcomes({(0, ENV, "t", 100): {True: [True], False: [False]},
                    (0, ENV, "r", 101): {True: [False], False: [True]}})
    lines = verdict_lines(run)
    assert [line.split(": ")[0] for line in lines] == [
        "eval success, unseen tasks, guided", "eval success, unseen tasks, free",
        "eval success, recurring tasks, guided", "eval success, recurring tasks, free"]
    assert all(line.endswith("at step 0 (one evaluation)") for line in lines)


def test_arms_differ_per_task_and_pairing_narrows_the_interval_when_tasks_vary_together():
    # A and B share each task's difficulty: task 1 easy for both, task 2 hard for both; A is better by 0.5 on each.
    def arm(rates: dict[int, tuple[bool, ...]]) -> RunOutcomes:
        return outcomes({(9, ENV, "t", task): {True: [], False: list(results)} for task, results in rates.items()})

    a = [arm({1: (True, True), 2: (True, False)}), arm({1: (True, True), 2: (True, False)})]
    b = [arm({1: (True, False), 2: (False, False)}), arm({1: (True, False), 2: (False, False)})]
    paired = arm_difference(a, b, "t", "last", guided=False)
    unpaired = arm_difference(a, b, "t", "last", guided=False, paired=False)
    # per task 1 - 0.5 and 0.5 - 0: every pair differs by exactly 0.5, so the paired interval is a point
    assert paired == Estimate(0.5, 0.5, 0.5)
    # alone, each arm's mean moves with which tasks a resample drew: A 0.5..1, B 0..0.5
    assert unpaired.value == pytest.approx(0.5)
    assert unpaired.low < 0.5 < unpaired.high
    assert arm_difference(a, b, "t", "last", guided=True) is None  # no guided episodes
    with pytest.raises(InvalidArgumentError, match="pair run by run"):
        arm_difference(a, b[:1], "t", "last", guided=False)


def test_the_unpaired_ratio_resamples_each_arm_on_its_own():
    a = outcomes({}, [group(1, "g0", [], [True, True], 4), group(1, "g1", [], [True, False], 4)])
    b = outcomes({}, [group(1, "g0", [], [True, False], 4), group(1, "g1", [], [False, False], 4)])
    paired, budget = ratio_at_equal_env_steps([a], [b])
    unpaired, _ = ratio_at_equal_env_steps([a], [b], paired=False)
    # A 3 of 4, B 1 of 4: 3.0 either way; a resample of B's groups alone can draw g1 twice (a zero rate): skipped
    assert budget == 8 and paired.value == unpaired.value == pytest.approx(3.0)
    assert unpaired.high - unpaired.low >= paired.high - paired.low


def test_each_evaluation_names_the_versions_and_bank_positions_behind_it(tmp_path):
    from pipeline.audit.learning import evaluation_provenance

    def evaluated(step, slot, guided, version, offset, served):
        e = episode("run-p", step, "eval", slot, True, 3, served=("x",) if served else (), guided=guided)
        return e.model_copy(update={"policy_version": version, "bank_offset": offset,
                                    "trajectory_id": f"eval-{step}-{slot}"})

    events = [RunStarted(**common("run-p"), config={"scheduler": {"arm": "complementary"}}, code_version="x"),
              evaluated(0, 0, True, 0, 0, False), evaluated(0, 1, False, 0, None, False),
              evaluated(9, 0, True, 7, 310, True), evaluated(9, 1, True, 8, 352, True),
              evaluated(9, 2, True, 8, 352, False), evaluated(9, 3, False, 7, None, False)]
    found = evaluation_provenance(archived(tmp_path / "p", events))
    assert [e.describe() for e in found] == [
        "step 0, guided (1): actor version 0, an empty bank, 0 served a lesson",
        "step 0, free (1): actor version 0",
        "step 9, guided (3): actor versions 7-8, bank positions 310-352, 2 served a lesson",
        "step 9, free (1): actor version 7"]


def test_a_run_whose_warm_start_missed_its_gate_is_named(tmp_path):
    from pipeline.audit.learning import missed_gates, warm_start_gates
    from schemas.training import WarmStartGateCheck, WarmStartProgressed

    def done(role, passed):
        check = WarmStartGateCheck(name="min_states_revealed", value=0.95 if passed else 0.42, bound=0.9, samples=74,
                                   passed=passed)
        return WarmStartProgressed(**common("run-g"), role=role, phase="done", done=10, total=10, elapsed_s=1.0,
                                   gate=(check,))

    ungated = done("actor", True).model_copy(update={"gate": None, "role": "extractor"})
    run_dir = archived(tmp_path / "g", [ungated, done("actor", True), done("extractor", False)])
    assert {role: [c.passed for c in checks] for role, checks in warm_start_gates(run_dir).items()} == {
        "actor": [True], "extractor": [False]}
    assert missed_gates(run_dir) == ["extractor warm start gate MISSED: states_revealed 0.42 >= 0.90 (74) MISSED"]
    assert missed_gates(archived(tmp_path / "h", [done("actor", True), ungated])) == []


def test_a_ratio_of_arms_pairs_tasks_and_divides_their_pooled_success():
    def arm(rates: dict[int, tuple[bool, ...]]) -> RunOutcomes:
        return outcomes({(9, ENV, "t", task): {True: list(results), False: []} for task, results in rates.items()})

    # A: task 1 1.0, task 2 0.5 (1.5 in all); B: task 1 0.5, task 2 0.5 (1.0): 1.5 / 1.0
    a, b = [arm({1: (True, True), 2: (True, False)})], [arm({1: (True, False), 2: (False, True)})]
    ratio = arm_ratio(a, b, "t", "last", guided=True)
    assert ratio is not None and ratio.value == pytest.approx(1.5)
    assert ratio.low >= 1.0 - 1e-9 and ratio.high <= 2.0 + 1e-9  # resamples draw task 2 alone (1.0) or task 1 (2.0)
    assert arm_ratio(a, b, "t", "last", guided=False) is None  # no free episodes
    with pytest.raises(InvalidArgumentError, match="succeeded on no"):
        arm_ratio(a, [arm({1: (False, False), 2: (False,)})], "t", "last", guided=True)


def test_lesson_kinds_per_extractor_version_judge_each_lesson_against_its_episodes_signpost(tmp_path):
    from pipeline.audit.learning import extractor_versions, lesson_kinds, rule_share_line
    from schemas.experiences import ExperienceAdded

    env = "MiniHack-SignpostCorridor-v0"

    def revealing(slot: int, side: str, signpost: str):
        e = episode("run-k", 1, "train", slot, True, 3)
        return e.model_copy(update={"env_id": env, "task_family": "minihack-signpost-corridor",
                                    "revealed": (f"staircase down: 3 {side} of the start",
                                                 f"on the staircase's side: {signpost}")})

    def lesson(n: int, version: int, source: str, text: str) -> ExperienceAdded:
        return ExperienceAdded(**common("run-k"), op_id=f"gen-{n}:0", experience_id=f"exp-{n}",
                               task_family="minihack-signpost-corridor", text=text, key=KEY,
                               generation_id=f"gen-{n}", extractor_version=version, source_trajectory_ids=(source,))

    first, second = revealing(0, "west", "altar"), revealing(1, "east", "sink")
    silent = episode("run-k", 1, "train", 2, False, 9).model_copy(update={"env_id": env})
    # an env id another package registers, unknown to this process: its lessons count by the word-for-word test
    foreign = revealing(3, "west", "altar").model_copy(update={"env_id": "Plugin-Corridor-v0"})
    events = [
        RunStarted(**common("run-k"), config={"scheduler": {"arm": "complementary"}}, code_version="x"),
        first, second, silent, foreign,
        lesson(0, 0, first.trajectory_id, "Solved in 3 actions. the staircase down is on the altar's side."),
        lesson(1, 0, second.trajectory_id, "Solved in 3 actions. staircase down: 3 east of the start."),
        lesson(2, 0, silent.trajectory_id, "Failed after 9 actions. Do not repeat west."),  # revealed nothing
        lesson(3, 1, second.trajectory_id, "Solved. the staircase down is on the altar's side."),  # not its signpost
        lesson(4, 1, second.trajectory_id, "Solved. the staircase down is always east of the start."),
        lesson(5, 1, first.trajectory_id, "Solved in 3 actions."),
        lesson(6, 1, foreign.trajectory_id, "staircase down: 3 west of the start; on the staircase's side: altar"),
    ]
    found = lesson_kinds(archived(tmp_path / "k", events))
    assert [(v.version, v.counts) for v in found] == [
        (0, {"rule": 1, "instance": 1}), (1, {"wrong rule": 1, "over-general": 1, "none": 1})]
    assert found[0].share("rule") == 0.5 and found[1].share("rule") == 0.0 and found[1].lessons == 3
    # beside them, what each version's lessons state that is true of their episode: the rule and the corridor's fact;
    # then the over-general side and the foreign episode's facts word for word (a wrong rule and a bare outcome are
    # not)
    assert [(v.version, v.lessons, v.stating) for v in extractor_versions(tmp_path / "k")] == [(0, 2, 2), (1, 4, 2)]
    assert rule_share_line(tmp_path / "k") == ("lessons stating the rule, of revealing episodes: extractor version 0 "
                                               "0.50 (1 of 2) -> version 1 0.00 (0 of 3)")
