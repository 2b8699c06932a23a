"""Did it learn? Evaluation success before and after training, guided against free, per arm pooled over runs, with
95% intervals; and success against environment steps with interval bands.

    runs = [load_outcomes(d) for d in run_dirs]                     # one per run directory
    for row in arm_table(runs): print(row.arm, row.pool, row.kind, row.before, row.after, row.rise, row.verdict)
    for line in verdict_lines(load_outcomes(run_dir)): print(line)  # what `crl run` prints at its end

What is measured, from the archive's `TrajectoryCompleted` events:
- an evaluation is every eval episode of one step: the fixed pool of unseen tasks (`t`, `envs.eval_seed`), and where
  configured the recurring train-pool tasks (`r`), each played guided and free (`envs.eval_repeats` times each);
- **before** is a run's first evaluation (step 0: the starting policy, an empty bank), **after** its last;
- **rise** is after minus before, paired per task (the same task evaluated twice); **gap** is guided minus free at
  the last evaluation, paired per task.

Intervals: a two-level bootstrap (runs, then tasks within each run; `pipeline.audit.stats`), percentile, 95%. Pooling
several runs of one arm treats them as seeds. A rise whose interval lies above 0 "rose", below 0 "fell", otherwise
there is "no clear change". The curves bin train episodes by step; a step's x is the mean over runs of the
environment steps (actions) played up to its end, its band the interval of its success over runs and groups.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pipeline.audit.stats import Estimate, bootstrap, bootstrap_independent, success_rate
from pipeline.audit.views import Audit
from pipeline.errors import ConfigError, InvalidArgumentError
from schemas.training import WarmStartGateCheck

if TYPE_CHECKING:
    from pipeline.envs.base import TaskRule

Pool = Literal["t", "r"]
POOL_NAMES: dict[str, str] = {"t": "unseen", "r": "recurring"}
EvalKey = tuple[int, str, str, int]
"""(eval step, env id, pool, task seed)."""


@dataclass(frozen=True)
class TrainGroup:
    """One GRPO group of one train step."""

    step: int
    group: str
    guided: tuple[bool, ...]
    """Outcomes of the guided episodes."""
    free: tuple[bool, ...]
    actions: int
    """Environment steps (actions) the group's episodes took."""
    free_slots: tuple[int, ...] = ()
    """The slot of each free outcome (`free`), so free slots of two arms pair slot by slot."""


@dataclass(frozen=True)
class RunOutcomes:
    """What one run's archive says about success, per task and per group."""

    run_dir: Path
    run_id: str
    arm: str
    """The run's `scheduler.variant`, else its arm: what `arm_table` pools runs by."""
    warmup: int
    evals: dict[EvalKey, dict[bool, list[bool]]] = field(repr=False)
    """(eval step, env id, pool, task seed) -> guided? -> outcomes."""
    train: tuple[TrainGroup, ...] = field(repr=False)

    def eval_steps(self, pool: str) -> list[int]:
        return sorted({step for step, _, p, _ in self.evals if p == pool})

    def evaluation(self, pool: str, which: Literal["first", "last"]) -> dict[tuple[str, int], dict[bool, list[bool]]]:
        """(env id, task seed) -> guided? -> outcomes, at the run's first or last evaluation of `pool`."""
        steps = self.eval_steps(pool)
        if not steps:
            return {}
        step = steps[0] if which == "first" else steps[-1]
        return {(env, seed): outcomes for (s, env, p, seed), outcomes in self.evals.items()
                if s == step and p == pool}


RUN_CONFIG_SQL = "SELECT run_id, config FROM run_started ORDER BY occurred_at LIMIT 1"
"""The run's id and configuration (its arm: `scheduler.variant`, else `scheduler.arm`)."""
EVAL_OUTCOMES_SQL = ("SELECT step, env_id, group_id, seed, guided, success FROM trajectories WHERE split = 'eval' "
                     "ORDER BY step, group_id, slot")
"""Every eval episode's outcome; the pool is the group id's last part (`t<i>` unseen, `r<i>` recurring)."""
TRAIN_OUTCOMES_SQL = ("SELECT step, group_id, guided, success, num_actions, slot FROM trajectories "
                      "WHERE split = 'train' ORDER BY step, group_id, slot")
"""Every train episode's outcome and actions, grouped by (step, group id) into `TrainGroup`s."""


def load_outcomes(run_dir: Path) -> RunOutcomes:
    """Read a run's eval outcomes per task and its train groups from its archive (`RUN_CONFIG_SQL`,
    `EVAL_OUTCOMES_SQL` and `TRAIN_OUTCOMES_SQL`, which `crl report` prints under the figures they feed)."""
    with Audit(run_dir) as audit:
        started = audit.query(RUN_CONFIG_SQL)[1]
        evals: dict[EvalKey, dict[bool, list[bool]]] = {}
        rows = audit.query(EVAL_OUTCOMES_SQL)[1]
        for step, env_id, group_id, seed, guided, success in rows:
            pool = group_id.rsplit("-", 1)[1][0]  # eval-s<step>-<env>-t<i> | -r<i>
            key = (int(step), str(env_id), pool, int(seed))
            evals.setdefault(key, {True: [], False: []})[bool(guided)].append(bool(success))
        groups: dict[tuple[int, str], tuple[list[bool], list[bool], list[int], list[int]]] = {}
        for step, group_id, guided, success, actions, slot in audit.query(TRAIN_OUTCOMES_SQL)[1]:
            entry = groups.setdefault((int(step), str(group_id)), ([], [], [], []))
            entry[0 if guided else 1].append(bool(success))
            entry[2].append(int(actions))
            if not guided:
                entry[3].append(int(slot))
    run_id, config = started[0] if started else (run_dir.name, "{}")
    settings = json.loads(config) if isinstance(config, str) else (config or {})
    train = tuple(TrainGroup(step, group, tuple(g), tuple(f), sum(a), tuple(slots))
                  for (step, group), (g, f, a, slots) in sorted(groups.items()))
    scheduler = settings.get("scheduler", {})
    return RunOutcomes(run_dir=run_dir, run_id=str(run_id),
                       arm=str(scheduler.get("variant") or scheduler.get("arm", "unknown")),
                       warmup=int(settings.get("actor_trainer", {}).get("warmup_steps", 0)), evals=evals, train=train)


# -- what stands behind the figures: the warm starts' gates, the versions and banks behind each evaluation -------------


GATES_SQL = ("SELECT role, gate FROM warm_start_progressed WHERE phase = 'done' AND gate IS NOT NULL "
             "ORDER BY occurred_at, event_id")
"""The gate of each warm start, from the trainers' last `WarmStartProgressed` (phase done)."""


def warm_start_gates(run_dir: Path) -> dict[str, tuple[WarmStartGateCheck, ...]]:
    """Role -> the checks of its warm start's gate (`pipeline.rl.warm_gate`), for the warm starts whose config set
    one; a resumed trainer that checked its gate again counts with its latest."""
    with Audit(run_dir) as audit:
        rows = audit.query(GATES_SQL)[1]
    gates = {}
    for role, gate in rows:
        checks = json.loads(gate) if isinstance(gate, str) else gate
        if checks is not None:  # the archive keeps a warm start without a gate as JSON null
            gates[str(role)] = tuple(WarmStartGateCheck.model_validate(check) for check in checks)
    return gates


def missed_gates(run_dir: Path) -> list[str]:
    """One line per warm start of the run whose gate failed (empty: every gate set passed)."""
    from pipeline.rl.warm_gate import gate_line, gate_passed

    return [gate_line(role, checks) for role, checks in warm_start_gates(run_dir).items() if not gate_passed(checks)]


EVAL_PROVENANCE_SQL = (
    "SELECT step, guided, count(*), min(policy_version), max(policy_version), min(bank_offset), max(bank_offset), "
    "sum((json_array_length(served) > 0)::INTEGER) FROM trajectories WHERE split = 'eval' "
    "GROUP BY step, guided ORDER BY step, guided DESC")
"""Per evaluation and slot kind: the actor versions that played it and the bank positions its episodes were served
from."""


@dataclass(frozen=True)
class EvalProvenance:
    """What played one evaluation's episodes of one slot kind."""

    step: int
    guided: bool
    episodes: int
    versions: tuple[int, int]
    """The lowest and highest actor version that played them."""
    bank_offsets: tuple[int, int] | None
    """The lowest and highest op-log position guided episodes were served from (None: none was served from a
    bank)."""
    served: int
    """Episodes served a lesson."""

    def describe(self) -> str:
        """"step 9, guided (208): actor versions 7-8, bank positions 310-352, 196 served a lesson"."""
        low, high = self.versions
        versions = f"actor version {low}" if low == high else f"actor versions {low}-{high}"
        line = f"step {self.step}, {'guided' if self.guided else 'free'} ({self.episodes}): {versions}"
        if not self.guided:
            return line
        if self.bank_offsets is None or self.bank_offsets[1] == 0:
            return f"{line}, an empty bank, {self.served} served a lesson"
        first, last = self.bank_offsets
        positions = f"bank position {first}" if first == last else f"bank positions {first}-{last}"
        return f"{line}, {positions}, {self.served} served a lesson"


def evaluation_provenance(run_dir: Path) -> list[EvalProvenance]:
    """Per evaluation and slot kind, the actor versions and bank positions behind it (`EVAL_PROVENANCE_SQL`)."""
    with Audit(run_dir) as audit:
        rows = audit.query(EVAL_PROVENANCE_SQL)[1]
    return [EvalProvenance(int(step), bool(guided), int(episodes), (int(low), int(high)),
                           None if first is None else (int(first), int(last)), int(served or 0))
            for step, guided, episodes, low, high, first, last, served in rows]


# -- statistics over runs ---------------------------------------------------------------------------------------------


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def paired_difference(units: list[tuple[float, float]]) -> float:
    """Mean of first minus second over paired units: (after, before) gives a rise, (guided, free) a gap."""
    return _mean([a - b for a, b in units])


def eval_success(runs: Sequence[RunOutcomes], pool: str, which: Literal["first", "last"], guided: bool,
                 resamples: int = 2000) -> Estimate | None:
    """Success of one slot kind at the first or last evaluation, pooled over runs and tasks."""
    by_run = {i: [o[guided] for o in run.evaluation(pool, which).values() if o[guided]] for i, run in enumerate(runs)}
    return bootstrap(by_run, success_rate, resamples=resamples) if any(by_run.values()) else None


def eval_rise(runs: Sequence[RunOutcomes], pool: str, guided: bool, resamples: int = 2000) -> Estimate | None:
    """Last evaluation minus the first, paired per task (None with fewer than two evaluations)."""
    by_run: dict[int, list[tuple[float, float]]] = {}
    for i, run in enumerate(runs):
        if len(run.eval_steps(pool)) < 2:
            continue
        before, after = run.evaluation(pool, "first"), run.evaluation(pool, "last")
        by_run[i] = [(_mean(after[t][guided]), _mean(before[t][guided])) for t in sorted(before.keys() & after.keys())
                     if before[t][guided] and after[t][guided]]
    return bootstrap(by_run, paired_difference, resamples=resamples) if any(by_run.values()) else None


def guided_gap(runs: Sequence[RunOutcomes], pool: str, which: Literal["first", "last"] = "last",
               resamples: int = 2000) -> Estimate | None:
    """Guided minus free success at an evaluation, paired per task."""
    by_run = {i: [(_mean(o[True]), _mean(o[False])) for o in run.evaluation(pool, which).values()
                  if o[True] and o[False]] for i, run in enumerate(runs)}
    return bootstrap(by_run, paired_difference, resamples=resamples) if any(by_run.values()) else None


def arm_difference(a: Sequence[RunOutcomes], b: Sequence[RunOutcomes], pool: str,
                   which: Literal["first", "last"], guided: bool, paired: bool = True,
                   resamples: int = 2000) -> Estimate | None:
    """Success of arm `a` minus arm `b` at an evaluation, one slot kind. Runs pair by position (the same seed: the
    same eval tasks, and with per-episode streams the same draws), tasks by (env id, task seed). paired: the interval
    of the per-task differences (seeds, then tasks); otherwise each arm is resampled on its own
    (`bootstrap_independent`), as if the arms shared nothing. The value is the same either way."""
    pairs = _task_pairs(a, b, pool, which, guided)
    if pairs is None:
        return None
    if paired:
        return bootstrap(pairs, paired_difference, resamples=resamples)
    return bootstrap_independent({i: [x for x, _ in units] for i, units in pairs.items()},
                                 {i: [y for _, y in units] for i, units in pairs.items()},
                                 lambda xs, ys: _mean(xs) - _mean(ys), resamples=resamples)


def arm_ratio(a: Sequence[RunOutcomes], b: Sequence[RunOutcomes], pool: str, which: Literal["first", "last"],
              guided: bool, resamples: int = 2000) -> Estimate | None:
    """Success of arm `a` over arm `b` at an evaluation, one slot kind, runs and tasks paired as in
    `arm_difference` (seeds, then tasks resampled; a resample whose `b` succeeded nowhere is skipped)."""
    pairs = _task_pairs(a, b, pool, which, guided)
    if pairs is None:
        return None
    if not any(y for units in pairs.values() for _, y in units):
        raise InvalidArgumentError(f"a ratio over an arm that succeeded on no {pool!r} task at its {which} evaluation")
    return bootstrap(pairs, lambda units: sum(x for x, _ in units) / sum(y for _, y in units), resamples=resamples)


def _task_pairs(a: Sequence[RunOutcomes], b: Sequence[RunOutcomes], pool: str, which: Literal["first", "last"],
                guided: bool) -> dict[int, list[tuple[float, float]]] | None:
    """Per run pair (by position), (success of `a`, success of `b`) on each task both played; None if none."""
    if len(a) != len(b) or not a:
        raise InvalidArgumentError(f"arms pair run by run: {len(a)} runs against {len(b)}")
    pairs: dict[int, list[tuple[float, float]]] = {}
    for i, (run_a, run_b) in enumerate(zip(a, b, strict=True)):
        tasks_a, tasks_b = run_a.evaluation(pool, which), run_b.evaluation(pool, which)
        pairs[i] = [(_mean(tasks_a[t][guided]), _mean(tasks_b[t][guided]))
                    for t in sorted(tasks_a.keys() & tasks_b.keys()) if tasks_a[t][guided] and tasks_b[t][guided]]
    return pairs if any(pairs.values()) else None


def verdict(rise: Estimate | None) -> str:
    """"rose" when the interval lies above 0, "fell" below it, else "no clear change"."""
    if rise is None:
        return "not measured (one evaluation)"
    if rise.low > 0:
        return "rose"
    if rise.high < 0:
        return "fell"
    return "no clear change"


@dataclass(frozen=True)
class ArmRow:
    """Evaluation success of one arm, one pool and one slot kind, pooled over the arm's runs."""

    arm: str
    runs: int
    pool: str
    kind: str
    """"guided" or "free"."""
    tasks: int
    before: Estimate | None
    after: Estimate | None
    rise: Estimate | None
    gap: Estimate | None
    """Guided minus free at the last evaluation (on the guided row only)."""

    @property
    def verdict(self) -> str:
        return verdict(self.rise)


def arm_table(runs: Sequence[RunOutcomes], resamples: int = 2000) -> list[ArmRow]:
    """One row per arm, eval pool and slot kind, the arm's runs pooled (arms in order of first appearance)."""
    arms: dict[str, list[RunOutcomes]] = {}
    for run in runs:
        arms.setdefault(run.arm, []).append(run)
    rows = []
    for arm, members in arms.items():
        for pool in ("t", "r"):
            for guided in (True, False):
                before = eval_success(members, pool, "first", guided, resamples)
                if before is None:
                    continue
                tasks = sum(len([o for o in run.evaluation(pool, "first").values() if o[guided]]) for run in members)
                rows.append(ArmRow(arm, len(members), POOL_NAMES[pool], "guided" if guided else "free", tasks, before,
                                   eval_success(members, pool, "last", guided, resamples),
                                   eval_rise(members, pool, guided, resamples),
                                   guided_gap(members, pool, "last", resamples) if guided else None))
    return rows


def _interval(estimate: Estimate | None, signed: bool = False) -> str:
    if estimate is None:
        return "-"
    sign = "+" if signed else ""
    return f"{estimate.value:{sign}.2f} [{estimate.low:{sign}.2f}, {estimate.high:{sign}.2f}]"


def row_cells(row: ArmRow) -> list[str]:
    """The table cells of an arm row: arm, runs, pool, kind, tasks, before, after, rise, verdict, gap."""
    return [row.arm, str(row.runs), row.pool, row.kind, str(row.tasks), _interval(row.before),
            _interval(row.after), _interval(row.rise, signed=True), row.verdict, _interval(row.gap, signed=True)]


def row_line(row: ArmRow) -> str:
    """An arm row as one line of text (the CLI prints it)."""
    runs = f"{row.runs} run{'s' * (row.runs != 1)}"
    line = (f"{row.arm}, {row.pool} tasks, {row.kind} ({runs}, {row.tasks} tasks): eval success "
            f"{_interval(row.before)} -> {_interval(row.after)}: {row.verdict}")
    if row.rise is not None:
        line += f" ({_interval(row.rise, signed=True)})"
    if row.gap is not None:
        line += f"; guided - free after {_interval(row.gap, signed=True)}"
    return line


ROW_COLUMNS = ("arm", "runs", "eval pool", "slots", "tasks", "success before [95%]", "success after [95%]",
               "after - before [95%]", "success", "guided - free after [95%]")


def verdict_lines(run: RunOutcomes, resamples: int = 2000) -> list[str]:
    """What a run says about its own learning, in words: per eval pool and slot kind, success at the first and last
    evaluation with 95% intervals over the pool's tasks, whether it rose, and guided against free at the end."""
    lines = []
    for row in arm_table([run], resamples):
        steps = run.eval_steps("t" if row.pool == "unseen" else "r")
        if row.after is None or row.rise is None:
            lines.append(f"eval success, {row.pool} tasks, {row.kind}: {_interval(row.before)} at step "
                         f"{steps[0]} (one evaluation)")
            continue
        lines.append(f"eval success, {row.pool} tasks ({row.tasks}), {row.kind}: {_interval(row.before)} at step "
                     f"{steps[0]} -> {_interval(row.after)} at step {steps[-1]}: {row.verdict} "
                     f"({_interval(row.rise, signed=True)})")
        if row.gap is not None:
            lines.append(f"  guided - free at step {steps[-1]}: {_interval(row.gap, signed=True)}")
    return lines


# -- curves against environment steps ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class CurvePoint:
    step: int
    env_steps: float
    """Mean over the runs of the environment steps played up to the end of this step."""
    success: Estimate


def success_curve(runs: Sequence[RunOutcomes], which: Callable[[TrainGroup], tuple[bool, ...]],
                  resamples: int = 1000) -> list[CurvePoint]:
    """Train success per step against environment steps, pooled over runs (units: groups), with 95% bands."""
    steps = sorted({g.step for run in runs for g in run.train})
    spent = [0.0] * len(runs)
    points = []
    for step in steps:
        by_run = {}
        for i, run in enumerate(runs):
            groups = [g for g in run.train if g.step == step]
            spent[i] += sum(g.actions for g in groups)
            units = [list(which(g)) for g in groups if which(g)]
            if units:
                by_run[i] = units
        if by_run:
            points.append(CurvePoint(step, _mean(spent), bootstrap(by_run, success_rate, resamples=resamples)))
    return points


def gap_curve(runs: Sequence[RunOutcomes], resamples: int = 1000) -> list[CurvePoint]:
    """Guided minus free train success per step against environment steps, pooled over runs, with 95% bands. A unit
    is one group's guided and free outcomes together (the two halves of a GRPO group play the same task), so the
    pairing survives the resampling."""
    steps = sorted({g.step for run in runs for g in run.train})
    spent = [0.0] * len(runs)
    points = []

    def gap(units: list[tuple[tuple[bool, ...], tuple[bool, ...]]]) -> float:
        return success_rate([guided for guided, _ in units]) - success_rate([free for _, free in units])

    for step in steps:
        by_run = {}
        for i, run in enumerate(runs):
            groups = [g for g in run.train if g.step == step]
            spent[i] += sum(g.actions for g in groups)
            units = [(g.guided, g.free) for g in groups if g.guided and g.free]
            if units:
                by_run[i] = units
        if by_run:
            points.append(CurvePoint(step, _mean(spent), bootstrap(by_run, gap, resamples=resamples)))
    return points


# -- arms against each other at equal environment steps ---------------------------------------------------------------


def within_budget(run: RunOutcomes, budget: int) -> dict[tuple[int, str], TrainGroup]:
    """The run's train groups after its warm-up, in the steps that began before it had played `budget`
    environment steps: (step, group id) -> group."""
    spent, chosen = 0, {}
    for step in sorted({g.step for g in run.train}):
        groups = [g for g in run.train if g.step == step]
        if step >= run.warmup and spent < budget:
            chosen.update({(g.step, g.group): g for g in groups})
        spent += sum(g.actions for g in groups)
    return chosen


def success_ratio(units: list[tuple[int, int, int, int]]) -> float:
    """(successes A, episodes A, successes B, episodes B) units -> success rate of A over success rate of B."""
    rate_a = sum(u[0] for u in units) / sum(u[1] for u in units)
    rate_b = sum(u[2] for u in units) / sum(u[3] for u in units)
    return rate_a / rate_b


def ratio_at_equal_env_steps(a: Sequence[RunOutcomes], b: Sequence[RunOutcomes],
                             resamples: int = 2000, paired: bool = True,
                             slots: Literal["all", "free"] = "all") -> tuple[Estimate, int]:
    """Train success of arm `a` over arm `b` and the environment-step budget it was measured at: the smallest total
    any run of either arm played. Runs pair by position (the same seed: the same task draws per step), groups by
    (step, group id); each unit is one pair of groups. `slots` "all": every episode of each group (guided and free:
    what the arm achieves); "free": `a`'s free slots against `b`'s episodes in the same slots (what the actor has
    learnt, without the help of a lesson; with common random numbers the same slot draws the same stream in both).
    paired False: the same units, each arm resampled on its own (`bootstrap_independent`)."""
    if len(a) != len(b) or not a:
        raise InvalidArgumentError(f"arms pair run by run: {len(a)} runs against {len(b)}")
    budget = min(sum(g.actions for g in run.train) for run in (*a, *b))
    by_run: dict[int, list[tuple[int, int, int, int]]] = {}
    for i, (run_a, run_b) in enumerate(zip(a, b, strict=True)):
        groups_a, groups_b = within_budget(run_a, budget), within_budget(run_b, budget)
        units = []
        for key in sorted(groups_a.keys() & groups_b.keys()):
            outcomes_a, outcomes_b = _compared(groups_a[key], groups_b[key], slots)
            if outcomes_a and outcomes_b:
                units.append((sum(outcomes_a), len(outcomes_a), sum(outcomes_b), len(outcomes_b)))
        by_run[i] = units
    if paired:
        return bootstrap(by_run, success_ratio, resamples=resamples), budget
    sides = ({i: [(u[0], u[1], 0, 1) for u in units] for i, units in by_run.items()},
             {i: [(u[2], u[3], 0, 1) for u in units] for i, units in by_run.items()})

    def ratio(units_a: list[tuple[int, int, int, int]], units_b: list[tuple[int, int, int, int]]) -> float:
        return (sum(u[0] for u in units_a) / sum(u[1] for u in units_a)) / \
            (sum(u[0] for u in units_b) / sum(u[1] for u in units_b))

    return bootstrap_independent(*sides, ratio, resamples=resamples), budget


def _compared(group_a: TrainGroup, group_b: TrainGroup,
              slots: Literal["all", "free"]) -> tuple[tuple[bool, ...], tuple[bool, ...]]:
    """The outcomes of two paired groups that `ratio_at_equal_env_steps` compares."""
    if slots == "all":
        return group_a.guided + group_a.free, group_b.guided + group_b.free
    free_b = dict(zip(group_b.free_slots, group_b.free, strict=True))
    pairs = [(outcome, free_b[slot]) for slot, outcome in zip(group_a.free_slots, group_a.free, strict=True)
             if slot in free_b]
    return tuple(x for x, _ in pairs), tuple(y for _, y in pairs)


# -- the extractor's versions: what each wrote and what its lessons did ----------------------------------------------


LESSONS_SQL = (
    "SELECT history.extractor_version, history.text, source.revealed, source.env_id FROM experience_history AS history "
    "JOIN trajectory_completed AS source "
    "ON source.trajectory_id = history.source_trajectory_ids ->> 0 "
    "WHERE history.op_kind IN ('ExperienceAdded', 'ExperienceRefined') AND history.extractor_version IS NOT NULL")
"""Every lesson the extractor added or refined (as applied), with the version that wrote it and what the episode it
was distilled from revealed."""
GUIDED_BY_VERSION_SQL = (
    "SELECT generated.extractor_version, episodes.success FROM experience_usage AS usage "
    "JOIN trajectories AS episodes USING (trajectory_id) "
    "JOIN extraction_generated AS generated ON generated.generation_id = usage.generation_id "
    "WHERE episodes.split = 'train' AND episodes.guided")
"""Every guided train episode with the version of the extractor that wrote the lesson it was served."""
EXTRACTOR_STEPS_SQL = ("SELECT step, rewards, loss, metrics FROM train_step_completed WHERE role = 'extractor' "
                       "ORDER BY step, occurred_at")
"""Every CISPO step with the rewards of its batch."""


@dataclass(frozen=True)
class ExtractorVersion:
    """What one extractor version did in one run (or pooled over runs)."""

    version: int
    lessons: int
    """Lessons it wrote of episodes that revealed something (where the goal lies)."""
    stating: int
    """Of those, the lessons that state what their episode revealed, word for word."""
    guided: int
    """Guided train episodes served one of its lessons."""
    successes: int

    @property
    def right_share(self) -> float | None:
        return self.stating / self.lessons if self.lessons else None

    @property
    def guided_success(self) -> float | None:
        return self.successes / self.guided if self.guided else None


TRUE_KINDS = ("rule", "instance", "over-general")
"""In a family with a rule across tasks, the kinds of lesson that are true of the episode they were written from (an
over-general side holds there, if not elsewhere)."""


def _task_rule(env_id: str) -> TaskRule | None:
    """The rule across tasks of `env_id`'s family, if it has one; None too for an env id this process does not know
    (an archive of a worker type another package registers)."""
    from pipeline.envs.registry import env_spec

    try:
        factory = env_spec(env_id).task_rule
    except ConfigError:
        return None
    return factory() if factory is not None else None


def extractor_versions(run_dir: Path) -> list[ExtractorVersion]:
    """Per extractor version: the share of its lessons that state what their episode revealed (`LESSONS_SQL`: word
    for word; in a family with a rule across tasks, as a lesson of a kind true of the episode, `TRUE_KINDS`) and the
    success of the guided train episodes its lessons were served to (`GUIDED_BY_VERSION_SQL`)."""
    lessons: dict[int, list[bool]] = {}
    guided: dict[int, list[bool]] = {}
    with Audit(run_dir) as audit:
        for version, text, revealed, env_id in audit.query(LESSONS_SQL)[1]:
            facts = json.loads(revealed) if isinstance(revealed, str) else list(revealed or [])
            if facts:
                rule = _task_rule(str(env_id))
                stated = rule.kind_of(str(text), rule.rule_in(tuple(facts))) in TRUE_KINDS if rule is not None \
                    else "; ".join(facts) in text
                lessons.setdefault(int(version), []).append(stated)
        for version, success in audit.query(GUIDED_BY_VERSION_SQL)[1]:
            guided.setdefault(int(version), []).append(bool(success))
    return [ExtractorVersion(v, len(lessons.get(v, [])), sum(lessons.get(v, [])), len(guided.get(v, [])),
                             sum(guided.get(v, []))) for v in sorted(lessons.keys() | guided.keys())]


@dataclass(frozen=True)
class LessonKinds:
    """What one extractor version's lessons state, in a family with a rule across tasks (`EnvSpec.task_rule`)."""

    version: int
    counts: dict[str, int]
    """Lessons of revealing episodes per kind ('rule', 'wrong rule', 'instance', 'over-general', or 'none' for a
    lesson stating none of these)."""

    @property
    def lessons(self) -> int:
        return sum(self.counts.values())

    def share(self, kind: str) -> float | None:
        return self.counts.get(kind, 0) / self.lessons if self.lessons else None


def lesson_kinds(run_dir: Path) -> list[LessonKinds]:
    """Per extractor version, the kinds of its lessons (adds and refines) of episodes that revealed something in
    families with a rule across tasks, judged against the rule the episode revealed (`TaskRule.rule_in`): what the
    extractor's outcome reward is to move toward the rule. Empty for families without one."""
    counts: dict[int, dict[str, int]] = {}
    with Audit(run_dir) as audit:
        for version, text, revealed, env_id in audit.query(LESSONS_SQL)[1]:
            rule = _task_rule(str(env_id))
            facts = tuple(json.loads(revealed) if isinstance(revealed, str) else list(revealed or []))
            if rule is None or not facts:
                continue
            kind = rule.kind_of(str(text), rule.rule_in(facts)) or "none"
            by_kind = counts.setdefault(int(version), {})
            by_kind[kind] = by_kind.get(kind, 0) + 1
    return [LessonKinds(version, counts[version]) for version in sorted(counts)]


def rule_share_line(run_dir: Path) -> str | None:
    """In a family with a rule across tasks: the share of lessons stating the rule, written by the extractor's first
    version and by its last (`lesson_kinds`); None elsewhere or when no version wrote a lesson of a revealing
    episode."""
    versions = [v for v in lesson_kinds(run_dir) if v.lessons]
    if not versions:
        return None
    first, last = versions[0], versions[-1]

    def share(version: LessonKinds) -> str:
        return f"version {version.version} {version.share('rule'):.2f} ({version.counts.get('rule', 0)} of " \
            f"{version.lessons})"

    if first is last:
        return f"lessons stating the rule, of revealing episodes: extractor {share(first)}, the only version"
    return f"lessons stating the rule, of revealing episodes: extractor {share(first)} -> {share(last)}"


@dataclass(frozen=True)
class ExtractorStep:
    """One CISPO step: the rewards of its batch (the mean outcome of each generation's guided episodes)."""

    step: int
    rewards: tuple[float, ...]
    loss: float
    clip_fraction: float | None

    @property
    def reward_variance(self) -> float:
        mean = _mean(self.rewards)
        return _mean([(r - mean) ** 2 for r in self.rewards])


def extractor_steps(run_dir: Path) -> list[ExtractorStep]:
    """The run's CISPO steps in order, with the rewards each batch was trained on."""
    with Audit(run_dir) as audit:
        rows = audit.query(EXTRACTOR_STEPS_SQL)[1]
    steps = []
    for step, rewards, loss, metrics in rows:
        values = json.loads(rewards) if isinstance(rewards, str) else list(rewards or [])
        scalars = json.loads(metrics) if isinstance(metrics, str) else dict(metrics or {})
        steps.append(ExtractorStep(int(step), tuple(float(r) for r in values), float(loss),
                                   scalars.get("train/clip_fraction")))
    return steps
