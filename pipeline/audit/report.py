"""`crl report`: an HTML page with PNG curves for one run, or several runs overlaid (one line per run and arm).

    crl report runs/demo                                   # writes runs/demo/report/report.html and its PNGs
    crl report runs/comp runs/grpo --out runs/comparison   # several runs: --out is required

Everything comes from the run's archive through `pipeline.audit.views.Audit` (the `trajectories` and `train_steps`
views, the per-kind views, and the replayed experience views for the bank), so a report can be made for any run,
finished or not, with no broker and no SQL bank. The arm is `RunStarted.config["scheduler"]["arm"]` ("unknown"
without one).

The page opens with a table per arm (the runs of an arm pooled as seeds): evaluation success at the first and the
last evaluation, per eval pool and slot kind, with 95% bootstrap intervals, the rise between them and whether it
is clear, and guided minus free at the end (`pipeline.audit.learning`). Below it, the lesson-quality panel: per run
and extractor version, the lessons it wrote of episodes that revealed something, the share stating what was revealed
and, in a family with a rule across tasks (signpost corridors), the share of each kind (the rule, one task's fact, an
over-general rule, a wrong rule), then the guided train episodes its lessons were served to and their success.

Figures (PNG, drawn with matplotlib's Agg canvas, no display needed):
- `learning.png`: per arm, train success (guided, free) against environment steps with 95% bands, and evaluation
  success before and after training with 95% intervals;
- `success.png`: success rate per step of train episodes (guided, free) and of eval episodes (guided, free);
- `actions.png`: mean actions per solved train episode, and invalid actions / actions, per step;
- `bank.png`: active experiences after each step, and the applied ops per step (added, refined, merged, retired).
  Only ops the bank applied count (the experience views replay the op log with the bank's rules): a merge adds one
  experience and retires its sources, an `ExperienceRetired` retires one. An op's step is the `step` of the
  `ExtractionGenerated` with its generation id; an op without one (capacity evictions have no generation, older
  generations no step) takes the step of the op before it in the log, or 0 at the start of the log;
- `extractor.png`: reward mean and clip fraction per extractor train step, and generations per actor step by parse
  status (ok / no_op / parse_error; generations without a step are only in the table);
- `retrieval.png`: per step, the fraction of guided train episodes that were served an experience, and how many
  distinct experiences the train episodes were served.
A series without data (a grpo run has no ops and no extractor steps) leaves its axis empty with "no data".

Under the table of arms and under each figure, a `<details>` block gives the `crl audit sql RUN_DIR "..."` commands
(one per query and run) that print the numbers it shows, and says what is done with them: `FIGURE_SOURCES` and
`ARM_TABLE_SOURCE`. `load_run` and `pipeline.audit.learning.load_outcomes` read the archive with these very statements,
so the page and the figures cannot disagree. After it has loaded, the page marks each figure `data-loaded="true"` or
`"false"` and the table of arms with its row count (`data-rows`), which a headless browser reads back from the DOM.
"""

from __future__ import annotations

import html
import itertools
import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from pipeline.audit.learning import (
    EVAL_OUTCOMES_SQL,
    GUIDED_BY_VERSION_SQL,
    LESSONS_SQL,
    ROW_COLUMNS,
    RUN_CONFIG_SQL,
    TRAIN_OUTCOMES_SQL,
    ArmRow,
    EvalProvenance,
    ExtractorVersion,
    LessonKinds,
    RunOutcomes,
    TrainGroup,
    arm_table,
    evaluation_provenance,
    extractor_versions,
    gap_curve,
    lesson_kinds,
    load_outcomes,
    row_cells,
    success_curve,
    warm_start_gates,
)
from pipeline.audit.stats import Estimate, wilson
from pipeline.audit.views import Audit
from pipeline.bank.state import undecodable
from pipeline.errors import ConfigError, InvalidArgumentError
from schemas.training import WarmStartGateCheck

Series = dict[int, float]
"""step -> value, only the steps that have a value."""

PARSE_STATUSES = ("ok", "no_op", "parse_error")
OP_KINDS = ("added", "refined", "merged", "retired")
UNKNOWN = "unknown"


@dataclass(frozen=True)
class RunSummary:
    """The table row of one run."""

    run_dir: Path
    run_id: str
    arm: str
    code_version: str
    status: str
    """RunFinished.status of the last RunFinished, or "unfinished"."""
    steps: int
    """Distinct steps that have train episodes."""
    eval_success_guided: float | None
    """Success rate of the guided eval episodes of the last step that has eval episodes (None: no eval)."""
    eval_success_free: float | None
    train_success: float | None
    """Success rate over every train episode of the run."""
    bank_size: int
    """Active experiences at the end of the replayed op log."""
    extractions: dict[str, int]
    """ExtractionGenerated events by parse status (every status, 0 when none)."""
    actor_train_steps: int
    extractor_train_steps: int
    families: tuple[FamilyRow, ...] = ()
    """Success per task family (a mixture's families; one row for a single-family run)."""
    undecodable: tuple[tuple[str, str], ...] = ()
    """(id, text) of the active experiences whose text holds undecodable characters (`pipeline.bank.state.
    undecodable`)."""
    active: int = 0
    """Active experiences at the end of the replayed op log, as the experience views have them."""

    @property
    def parse_error_share(self) -> float | None:
        """The share of the extractor's generations that did not parse (None: it wrote none)."""
        total = sum(self.extractions.values())
        return self.extractions.get("parse_error", 0) / total if total else None


@dataclass(frozen=True)
class FamilyRow:
    """One task family of one run: eval success at the run's last eval step and train success over the run, each for
    guided and free episodes, and the episodes its engine failed."""

    task_family: str
    eval_guided: float | None
    eval_free: float | None
    train_guided: float | None
    train_free: float | None
    engine_failures: int


@dataclass(frozen=True)
class RunCurves:
    """The series the figures draw, each step -> value."""

    success: dict[str, Series]
    """Keys "train guided", "train free", "eval guided", "eval free"."""
    success_counts: dict[str, dict[int, tuple[int, int]]]
    """The same keys: step -> (successes, episodes) behind each rate."""
    actions_per_solved: Series
    invalid_rate: Series
    bank_size: Series
    """Active experiences after each step, from the first step with an op to the last step of the run."""
    ops: dict[str, Series]
    """Applied ops per step by kind (OP_KINDS), over the same steps as `bank_size`."""
    extractor_reward: Series
    """By extractor train step."""
    extractor_clip_fraction: Series
    parse_status: dict[str, Series]
    """Generations per actor step by parse status (PARSE_STATUSES)."""
    served_fraction: Series
    distinct_served: Series


@dataclass(frozen=True)
class RunData:
    """One run as the report sees it (`load_run`)."""

    summary: RunSummary
    curves: RunCurves


@dataclass(frozen=True)
class Report:
    """What `write_report` wrote, and the numbers of its tables."""

    html: Path
    figures: tuple[Path, ...]
    runs: tuple[RunSummary, ...]
    curves: tuple[RunCurves, ...] = field(repr=False, default=())
    arms: tuple[ArmRow, ...] = ()
    """Evaluation success per arm, eval pool and slot kind, pooled over the runs of the arm."""
    quality: tuple[LessonQuality, ...] = ()
    """Per run, what each extractor version wrote and how the episodes its lessons guided ended."""


# -- the queries behind the figures -----------------------------------------------------------------------------------
# Each figure's numbers are the rows of these statements, read by `load_run` and printed on the page under the figure
# as the `crl audit sql` command that gives them; so they contain no `?` placeholders and nothing a shell would expand
# inside double quotes.

SUCCESS_SQL = ("SELECT split, guided, step, avg(success::INTEGER) AS success_rate, count(*) AS episodes, "
               "sum(success::INTEGER) AS successes FROM trajectories GROUP BY ALL ORDER BY ALL")
"""success.png: success rate per split, slot kind and step, with the episodes and successes behind it."""
ACTIONS_SQL = (
    "SELECT step, avg(num_actions) FILTER (WHERE success) AS actions_per_solved, "
    "sum(invalid_actions) / nullif(sum(num_actions), 0) AS invalid_rate FROM trajectories WHERE split = 'train' "
    "GROUP BY step ORDER BY step"
)
"""actions.png: mean actions of the solved train episodes and invalid actions / actions, per step."""
BANK_SQL = (
    # One row per applied change: an add or merge makes an experience (+1), a refine changes none, a retirement
    # removes one (-1; a merge's sources are retired by the merge op itself, so only the other retiring ops count as
    # "retired"). Steps run from the first op's to the last train step.
    "WITH applied AS ("
    "SELECT ops.step, CASE history.op_kind WHEN 'ExperienceMerged' THEN 'merged' ELSE 'added' END AS kind, "
    "1 AS size_change FROM experience_history AS history JOIN experience_ops AS ops USING (op_offset) "
    "WHERE history.version = 1 "
    "UNION ALL SELECT ops.step, 'refined', 0 FROM experience_history AS history "
    "JOIN experience_ops AS ops USING (op_offset) WHERE history.op_kind = 'ExperienceRefined' "
    "UNION ALL SELECT ops.step, NULL, -1 FROM experiences "
    "JOIN experience_ops AS ops ON ops.op_offset = experiences.retired_offset "
    "UNION ALL SELECT ops.step, 'retired', 0 FROM (SELECT DISTINCT retired_offset FROM experiences "
    "WHERE retired_offset IS NOT NULL AND retired_reason IS DISTINCT FROM 'merged') AS retirement "
    "JOIN experience_ops AS ops ON ops.op_offset = retirement.retired_offset"
    "), steps AS (SELECT unnest(range(min(step), greatest(max(step), "
    "coalesce((SELECT max(step) FROM trajectories WHERE split = 'train'), 0)) + 1)) AS step FROM applied) "
    "SELECT steps.step, sum(coalesce(sum(applied.size_change), 0)) OVER (ORDER BY steps.step) AS bank_size, "
    + ", ".join(f"count(*) FILTER (WHERE applied.kind = '{kind}') AS {kind}" for kind in OP_KINDS)
    + " FROM steps LEFT JOIN applied ON applied.step = steps.step GROUP BY steps.step ORDER BY steps.step"
)
"""bank.png: active experiences after each step and the applied ops per step by kind (the replayed experience
views; `experience_ops` gives each op's step)."""
EXTRACTOR_SQL = ("SELECT step, avg(reward_mean) AS reward_mean, avg(clip_fraction) AS clip_fraction FROM train_steps "
                 "WHERE role = 'extractor' GROUP BY step ORDER BY step")
"""extractor.png, left and middle: reward mean and clip fraction per extractor train step."""
PARSE_STATUS_SQL = ("SELECT step, parse_status, count(*) AS generations FROM extraction_generated "
                    "WHERE step IS NOT NULL GROUP BY ALL ORDER BY ALL")
"""extractor.png, right: generations per actor step by parse status."""
RETRIEVAL_SQL = (
    "SELECT step, avg((json_array_length(served) > 0)::INTEGER) AS served_fraction, "
    "length(list_distinct(flatten(list(served::VARCHAR[])))) AS distinct_served FROM trajectories "
    "WHERE split = 'train' AND guided GROUP BY step ORDER BY step"
)
"""retrieval.png: per step, the fraction of guided train episodes served an experience and the distinct experiences
they were served."""


@dataclass(frozen=True)
class Source:
    """Where the numbers of a figure or a table come from: the statements `crl report` runs (each runs as printed
    through `crl audit sql`) and what is done with their rows."""

    queries: tuple[str, ...]
    computed: str


_PLOTTED = "Plotted as the query returns them, one line per run"
FIGURE_SOURCES: dict[str, Source] = {
    "learning": Source(
        (RUN_CONFIG_SQL, TRAIN_OUTCOMES_SQL, EVAL_OUTCOMES_SQL),
        "Runs pooled per arm (scheduler.variant, else scheduler.arm, of the run's config). Left: "
        "pipeline.audit.learning.success_curve groups the train episodes by step and group id, puts each step at the "
        "environment steps played up to its end (mean over runs) and bootstraps its success over runs, then groups "
        "(1000 resamples). Middle: pipeline.audit.learning.gap_curve, guided minus free success per step, each "
        "group's two halves one unit of the same bootstrap. Right: the before and after columns of the table of arms "
        "(pipeline.audit.learning.arm_table)."),
    "success": Source((SUCCESS_SQL,), f"{_PLOTTED}, split and slot kind (guided true or false); the band around "
                      "each point is the Wilson 95% interval of its successes among its episodes "
                      "(pipeline.audit.stats.wilson)."),
    "actions": Source((ACTIONS_SQL,), f"{_PLOTTED} and column."),
    "bank": Source((BANK_SQL,), f"{_PLOTTED} and column: bank_size on the left, the four op kinds on the right."),
    "extractor": Source((EXTRACTOR_SQL, PARSE_STATUS_SQL),
                        f"{_PLOTTED}: reward_mean and clip_fraction from the first query, generations by parse "
                        "status from the second (a status missing at a step is 0)."),
    "retrieval": Source((RETRIEVAL_SQL,), f"{_PLOTTED} and column."),
}
"""Per figure of the page, where its numbers come from; `load_run` and `load_outcomes` read them with these very
statements."""
ARM_TABLE_SOURCE = Source(
    (RUN_CONFIG_SQL, EVAL_OUTCOMES_SQL),
    "pipeline.audit.learning.arm_table pools the runs of each arm (scheduler.variant, else scheduler.arm) and, per "
    "eval pool (the group id's last part: t unseen, r recurring) and slot kind, bootstraps success at the first and "
    "the last evaluation, their difference paired per task and guided minus free at the last, over runs and then "
    "tasks (2000 resamples, 95% percentile intervals).")


# -- reading a run ----------------------------------------------------------------------------------------------------


def _rows(audit: Audit, sql: str, parameters: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
    return audit.query(sql, parameters)[1]


def _series(rows: list[tuple[Any, ...]]) -> Series:
    """(step, value) rows to a series, leaving out NULL values."""
    return {int(step): float(value) for step, value in rows if value is not None}


def _run_identity(audit: Audit, run_dir: Path) -> tuple[str, str, str, str]:
    """(run id, arm, code version, status)."""
    started = _rows(audit, "SELECT run_id, config ->> '$.scheduler.arm', code_version FROM run_started "
                           "ORDER BY occurred_at LIMIT 1")
    if started:
        run_id, arm, code_version = started[0]
    else:
        any_run = _rows(audit, "SELECT run_id FROM events GROUP BY run_id ORDER BY count(*) DESC, run_id LIMIT 1")
        run_id, arm, code_version = (any_run[0][0] if any_run else run_dir.name), None, None
    finished = _rows(audit, "SELECT status FROM run_finished ORDER BY occurred_at DESC LIMIT 1")
    return run_id, arm or UNKNOWN, code_version or UNKNOWN, finished[0][0] if finished else "unfinished"


def _bank_curves(audit: Audit) -> tuple[Series, dict[str, Series], int]:
    """(bank size after each step, applied ops per step by kind, final bank size), from `BANK_SQL`."""
    rows = _rows(audit, BANK_SQL)
    sizes = {int(step): float(size) for step, size, *_ in rows}
    ops = {kind: {int(row[0]): float(row[2 + index]) for row in rows} for index, kind in enumerate(OP_KINDS)}
    return sizes, ops, int(rows[-1][1]) if rows else 0


def load_run(run_dir: Path) -> RunData:
    """Read everything the report shows about the run in `run_dir` from its archive."""
    if not run_dir.is_dir():
        raise ConfigError(f"no run directory at {run_dir}")
    with Audit(run_dir) as audit:
        run_id, arm, code_version, status = _run_identity(audit, run_dir)
        success: dict[str, Series] = {f"{split} {name}": {} for split in ("train", "eval")
                                      for name in ("guided", "free")}
        success_counts: dict[str, dict[int, tuple[int, int]]] = {key: {} for key in success}
        for split, guided, step, rate, episodes, successes in _rows(audit, SUCCESS_SQL):
            if rate is not None:
                key = f"{split} {'guided' if guided else 'free'}"
                success[key][int(step)] = float(rate)
                success_counts[key][int(step)] = (int(successes), int(episodes))
        actions = _rows(audit, ACTIONS_SQL)
        actions_per_solved = _series([(step, solved) for step, solved, _ in actions])
        invalid_rate = _series([(step, invalid) for step, _, invalid in actions])
        retrieval = _rows(audit, RETRIEVAL_SQL)
        served_fraction = _series([(step, fraction) for step, fraction, _ in retrieval])
        distinct_served = _series([(step, distinct) for step, _, distinct in retrieval])
        extractor = _rows(audit, EXTRACTOR_SQL)
        parse_rows = _rows(audit, PARSE_STATUS_SQL)
        parse_steps = sorted({step for step, _, _ in parse_rows})
        parse_status = {name: dict.fromkeys(parse_steps, 0.0) for name in PARSE_STATUSES}
        for step, generation_status, count in parse_rows:
            parse_status[generation_status][step] = float(count)
        bank_size, ops, final_bank = _bank_curves(audit)

        eval_step = _rows(audit, "SELECT max(step) FROM trajectories WHERE split = 'eval'")[0][0]
        final_eval = {name: success[f"eval {name}"].get(eval_step) for name in ("guided", "free")}
        steps, train_success = _rows(audit, "SELECT count(DISTINCT step), avg(success::INTEGER) FROM trajectories "
                                            "WHERE split = 'train'")[0]
        extractions = dict.fromkeys(PARSE_STATUSES, 0)
        extractions |= dict(_rows(audit, "SELECT parse_status, count(*) FROM extraction_generated GROUP BY ALL"))
        trained = dict(_rows(audit, "SELECT role, count(*) FROM train_steps GROUP BY role"))
        family_rates: dict[tuple[str, str, bool], float] = {}
        for family, split, guided, rate in _rows(
                audit, "SELECT task_family, split, guided, sum(successes) / sum(episodes) FROM family_success "
                       "WHERE split = 'train' OR step = ? GROUP BY ALL", [eval_step if eval_step is not None else -1]):
            family_rates[(family, split, guided)] = float(rate)
        failures = dict(_rows(audit, "SELECT task_family, sum(engine_failures) FROM family_success GROUP BY ALL"))
        active = _rows(audit, "SELECT experience_id, text FROM experiences WHERE status = 'active' "
                              "ORDER BY experience_id")
        families = tuple(
            FamilyRow(family, family_rates.get((family, "eval", True)), family_rates.get((family, "eval", False)),
                      family_rates.get((family, "train", True)), family_rates.get((family, "train", False)),
                      int(failures.get(family) or 0))
            for family in sorted(failures))
    summary = RunSummary(
        run_dir=run_dir, run_id=run_id, arm=arm, code_version=code_version, status=status, steps=steps,
        eval_success_guided=final_eval["guided"], eval_success_free=final_eval["free"],
        train_success=float(train_success) if train_success is not None else None, bank_size=final_bank,
        extractions=extractions, actor_train_steps=trained.get("actor", 0),
        extractor_train_steps=trained.get("extractor", 0), families=families,
        undecodable=tuple((str(i), str(text)) for i, text in active if undecodable(str(text))), active=len(active),
    )
    curves = RunCurves(
        success=success, success_counts=success_counts, actions_per_solved=actions_per_solved,
        invalid_rate=invalid_rate, bank_size=bank_size,
        ops=ops, extractor_reward=_series([(step, reward) for step, reward, _ in extractor]),
        extractor_clip_fraction=_series([(step, clip) for step, _, clip in extractor]),
        parse_status=parse_status, served_fraction=served_fraction, distinct_served=distinct_served,
    )
    return RunData(summary, curves)


# -- figures ----------------------------------------------------------------------------------------------------------

_LINE_STYLES = ("-", "--", ":", "-.")
Lines = Callable[[RunData], list[tuple[str, Series]]]
"""A run's lines in one panel: (name, series), the name appended to the run's label ("" for none)."""
Bands = Callable[[RunData, str], dict[int, Estimate]]
"""The interval around each point of a run's line of that name (none: no band)."""


def run_labels(run_ids: Sequence[str]) -> list[str]:
    """Legend labels for runs: each id without the beginning and end every id shares (`paper-3task-seed1-20261127`
    and `paper-3task-seed2-20261127` are `seed1` and `seed2`), the whole id where that leaves nothing."""
    if len(run_ids) < 2:
        return list(run_ids)
    prefix = _shared_start(run_ids)
    suffix = _shared_start([run_id[::-1] for run_id in run_ids])
    # Cut at the separators only: seed1 and seed2, not 1 and 2.
    prefix = max((run_ids[0].rfind(mark, 0, prefix) + 1 for mark in _SEPARATORS), default=0)
    tail = run_ids[0][len(run_ids[0]) - suffix:] if suffix else ""
    suffix = len(tail) - min((i for i, character in enumerate(tail) if character in _SEPARATORS), default=len(tail))
    labels = []
    for run_id in run_ids:
        cut = run_id[prefix:len(run_id) - suffix if suffix else None].strip("-_ ")
        labels.append(cut or run_id)
    return labels if len(set(labels)) == len(labels) else list(run_ids)


_SEPARATORS = "-_./ "


def _shared_start(texts: Sequence[str]) -> int:
    """How many characters every text of `texts` begins with alike."""
    length = 0
    for characters in zip(*texts, strict=False):
        if len(set(characters)) > 1:
            break
        length += 1
    return length


def _draw(axes: Axes, title: str, ylabel: str, runs: Sequence[RunData], lines_of: Lines, *,
          xlabel: str = "step", unit_range: bool = False, bands: Bands | None = None) -> None:
    """One panel. One run: a colour per line. Several: a colour per run and a line style per line. With `bands`, a
    shaded interval around each line."""
    drawn: set[int] = set()
    labels = run_labels([run.summary.run_id for run in runs])
    for index, run in enumerate(runs):
        for number, (style, (name, series)) in enumerate(zip(itertools.cycle(_LINE_STYLES), lines_of(run))):
            if not series:
                continue
            steps = sorted(series)
            drawn.update(steps)
            if len(runs) == 1:
                colour, style, label = f"C{number % 10}", "-", name or f"{run.summary.run_id} ({run.summary.arm})"
            else:
                colour = f"C{index % 10}"
                label = f"{labels[index]} ({run.summary.arm})" + (f" {name}" if name else "")
            axes.plot(steps, [series[step] for step in steps], linestyle=style, marker="o", markersize=3,
                      color=colour, label=label)
            if bands is not None and (interval := bands(run, name)):
                shaded = [step for step in steps if step in interval]
                axes.fill_between(shaded, [interval[step].low for step in shaded],
                                  [interval[step].high for step in shaded], color=colour, alpha=0.15, linewidth=0)
    axes.set_title(title, fontsize=10)
    axes.set_xlabel(xlabel)
    axes.set_ylabel(ylabel)
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    if unit_range:
        axes.set_ylim(-0.05, 1.05)
    if len(drawn) == 1:  # one step: an integer axis around it, not matplotlib's ±5% of nothing
        axes.set_xlim(min(drawn) - 1, min(drawn) + 1)
    if drawn:
        axes.legend(fontsize=7, handlelength=4)  # long enough to tell the line styles apart
    else:
        axes.text(0.5, 0.5, "no data", transform=axes.transAxes, ha="center", va="center", color="grey")


def _figure(panels: int) -> tuple[Figure, list[Axes]]:
    figure = Figure(figsize=(5.5 * panels, 4), layout="constrained")
    FigureCanvasAgg(figure)
    return figure, list(figure.subplots(1, panels))


def _save(figure: Figure, path: Path) -> Path:
    figure.savefig(path, format="png", dpi=100)
    return path


def _success_lines(split: str) -> Lines:
    return lambda run: [(name, run.curves.success[f"{split} {name}"]) for name in ("guided", "free")]


def _success_bands(split: str) -> Bands:
    def bands(run: RunData, name: str) -> dict[int, Estimate]:
        counts = run.curves.success_counts.get(f"{split} {name}", {})
        return {step: wilson(successes, episodes) for step, (successes, episodes) in counts.items() if episodes}

    return bands


def draw_figures(runs: Sequence[RunData], out_dir: Path) -> dict[str, Path]:
    """Write the five PNGs into `out_dir`; returns name -> path, in page order."""
    paths: dict[str, Path] = {}

    figure, (train, evaluation) = _figure(2)
    for axes, split in ((train, "train"), (evaluation, "eval")):
        _draw(axes, f"{split} success (95% Wilson bands)", "success rate", runs, _success_lines(split),
              unit_range=True, bands=_success_bands(split))
    paths["success"] = _save(figure, out_dir / "success.png")

    figure, (actions, invalid) = _figure(2)
    _draw(actions, "actions per solved task (train)", "actions", runs,
          lambda run: [("", run.curves.actions_per_solved)])
    _draw(invalid, "invalid-action rate (train)", "invalid / actions", runs,
          lambda run: [("", run.curves.invalid_rate)], unit_range=True)
    paths["actions"] = _save(figure, out_dir / "actions.png")

    figure, (size, mix) = _figure(2)
    _draw(size, "bank size (active experiences)", "experiences", runs, lambda run: [("", run.curves.bank_size)])
    _draw(mix, "experience ops applied per step", "ops", runs,
          lambda run: [(kind, run.curves.ops[kind]) for kind in OP_KINDS])
    paths["bank"] = _save(figure, out_dir / "bank.png")

    figure, (reward, clip, parse) = _figure(3)
    _draw(reward, "extractor reward mean", "reward", runs, lambda run: [("", run.curves.extractor_reward)],
          xlabel="extractor step")
    _draw(clip, "extractor clip fraction", "clip fraction", runs,
          lambda run: [("", run.curves.extractor_clip_fraction)], xlabel="extractor step")
    _draw(parse, "extractions by parse status", "generations", runs,
          lambda run: [(status, run.curves.parse_status[status]) for status in PARSE_STATUSES])
    paths["extractor"] = _save(figure, out_dir / "extractor.png")

    figure, (fraction, distinct) = _figure(2)
    _draw(fraction, "guided train episodes served an experience", "fraction", runs,
          lambda run: [("", run.curves.served_fraction)], unit_range=True)
    _draw(distinct, "distinct experiences served (train)", "experiences", runs,
          lambda run: [("", run.curves.distinct_served)])
    paths["retrieval"] = _save(figure, out_dir / "retrieval.png")
    return paths


_ARM_LINES: tuple[tuple[str, Callable[[TrainGroup], tuple[bool, ...]]], ...] = (
    ("guided", lambda g: g.guided), ("free", lambda g: g.free))


def _arm_colour(arm: int, kind: int = 0) -> str:
    """The colour of an arm's line of one kind (0 guided, 1 free): each arm two of matplotlib's ten, its own colour
    the guided one's."""
    return f"C{(2 * arm + kind) % 10}"


def draw_learning(outcomes: Sequence[RunOutcomes], rows: Sequence[ArmRow], out_dir: Path) -> Path:
    """`learning.png`: per arm (pooled over its runs), train success against environment steps with 95% bands,
    guided and free; and evaluation success before and after training with 95% intervals."""
    figure, (curves, gaps, evals) = _figure(3)
    arms: dict[str, list[RunOutcomes]] = {}
    for run in outcomes:
        arms.setdefault(run.arm, []).append(run)
    drawn = False
    for index, (arm, runs) in enumerate(arms.items()):
        for number, (style, (kind, which)) in enumerate(zip(_LINE_STYLES, _ARM_LINES, strict=False)):
            points = success_curve(runs, which)
            if not points:
                continue
            drawn = True
            x = [p.env_steps for p in points]
            colour = _arm_colour(index, number)
            curves.plot(x, [p.success.value for p in points], linestyle=style, marker="o", markersize=3,
                        color=colour, label=f"{arm} {kind} ({len(runs)} run{'s' * (len(runs) > 1)})")
            curves.fill_between(x, [p.success.low for p in points], [p.success.high for p in points],
                                color=colour, alpha=0.15)
    gapped = False
    for index, (arm, runs) in enumerate(arms.items()):
        points = gap_curve(runs)
        if not points:
            continue
        gapped = True
        x = [p.env_steps for p in points]
        gaps.plot(x, [p.success.value for p in points], marker="o", markersize=3, color=_arm_colour(index),
                  label=f"{arm} ({len(runs)} run{'s' * (len(runs) > 1)})")
        gaps.fill_between(x, [p.success.low for p in points], [p.success.high for p in points],
                          color=_arm_colour(index), alpha=0.15, linewidth=0)
    gaps.axhline(0.0, color="grey", linewidth=0.8)
    gaps.set_title("guided minus free train success (95% bands)", fontsize=10)
    gaps.set_xlabel("environment steps (actions played)")
    gaps.set_ylabel("success rate difference")
    gaps.set_ylim(-1.05, 1.05)
    if gapped:
        gaps.legend(fontsize=7)
    else:
        gaps.text(0.5, 0.5, "no guided and free groups", transform=gaps.transAxes, ha="center", va="center",
                  color="grey")
    curves.set_title("train success against environment steps (95% bands)", fontsize=10)
    curves.set_xlabel("environment steps (actions played)")
    curves.set_ylabel("success rate")
    curves.set_ylim(-0.05, 1.05)
    if drawn:
        curves.legend(fontsize=7, handlelength=4)
    else:
        curves.text(0.5, 0.5, "no data", transform=curves.transAxes, ha="center", va="center", color="grey")
    ticks: list[float] = []
    labels: list[str] = []
    for index, row in enumerate(rows):
        if row.before is None:
            continue
        colour = _arm_colour(list(arms).index(row.arm))
        marks: list[tuple[float, Estimate]] = [(float(index), row.before)]
        if row.after is not None:
            marks.append((index + 0.5, row.after))
        evals.plot([p for p, _ in marks], [e.value for _, e in marks], color=colour, linewidth=1)
        for (position, estimate), marker, when in zip(marks, ("o", "s"), ("before", "after"), strict=False):
            evals.errorbar([position], [estimate.value], yerr=[[estimate.value - estimate.low],
                                                       [estimate.high - estimate.value]],
                           fmt=marker, capsize=4, color=colour, label=when if index == 0 else None)
        ticks.append(index + 0.25)
        labels.append(f"{row.arm}\n{row.pool} {row.kind}")
    evals.set_title("evaluation success before (o) and after (s) training, 95% intervals", fontsize=10)
    evals.set_ylabel("success rate")
    evals.set_ylim(-0.05, 1.05)
    if labels:
        evals.set_xticks(ticks, labels, fontsize=7)
        evals.set_xlim(-0.5, len(rows))
        evals.legend(fontsize=7)
    else:
        evals.text(0.5, 0.5, "no evaluation", transform=evals.transAxes, ha="center", va="center", color="grey")
    return _save(figure, out_dir / "learning.png")


# -- the page ---------------------------------------------------------------------------------------------------------

_FIGURE_TITLES = {
    "learning": "Learning per arm: success against environment steps, guided minus free, evaluation before and after",
    "success": "Success: train and eval, guided and free",
    "actions": "Actions per solved task and invalid actions",
    "bank": "Experience bank: size and op mix",
    "extractor": "Extractor: reward, clip fraction, parse status",
    "retrieval": "Retrieval usage",
}
_COLUMNS = ("run id", "arm", "code version", "status", "steps", "eval success guided", "eval success free",
            "train success", "bank size", "extractions ok / no_op / parse_error", "actor train steps",
            "extractor train steps", "run dir")
_FAMILY_COLUMNS = ("run id", "task family", "eval success guided", "eval success free", "train success guided",
                   "train success free", "engine failures")
_STYLE = ("body{font-family:sans-serif;margin:2em;overflow-wrap:break-word}"
          "table{border-collapse:collapse;max-width:100%}"
          "td,th{border:1px solid #ccc;padding:4px 8px;text-align:left}td.long{overflow-wrap:anywhere}"
          "img{max-width:100%}"
          "details.source{margin:0.5em 0 1.5em}details.source pre{white-space:pre-wrap;background:#f4f4f4;"
          "padding:0.5em}li.missed{color:#b00;font-weight:bold}")
# After the page has loaded, each figure says whether it loaded (`data-loaded`), the table of arms how many rows it
# shows (`data-rows`) and the body how far right the widest table reaches and how wide the page scrolls
# (`data-widest`, `data-page-width`): what a reader's browser shows, readable from the DOM by a headless one.
_LOAD_CHECK = (
    "<script>window.addEventListener('load',function(){"
    "for(const image of document.images){image.dataset.loaded=String(image.complete&&image.naturalWidth>0);}"
    "const arms=document.getElementById('arm-table');"
    "if(arms){arms.dataset.rows=String(arms.tBodies[0].rows.length);}"
    "let widest=0;for(const table of document.querySelectorAll('table')){"
    "widest=Math.max(widest,Math.ceil(table.getBoundingClientRect().right));}"
    "document.body.dataset.widest=String(widest);"
    "document.body.dataset.pageWidth=String(document.documentElement.scrollWidth);"
    "document.body.dataset.checked='true';});</script>"
)


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def summary_row(summary: RunSummary) -> list[str]:
    """The table cells of one run."""
    return [summary.run_id, summary.arm, summary.code_version, summary.status, str(summary.steps),
            _rate(summary.eval_success_guided), _rate(summary.eval_success_free), _rate(summary.train_success),
            str(summary.bank_size), " / ".join(str(summary.extractions[status]) for status in PARSE_STATUSES),
            str(summary.actor_train_steps), str(summary.extractor_train_steps), str(summary.run_dir)]


def summary_line(summary: RunSummary) -> str:
    """One line of text per run (the CLI prints it)."""
    return (f"{summary.run_id} ({summary.arm}): {summary.status}, {summary.steps} steps, eval success guided "
            f"{_rate(summary.eval_success_guided)} free {_rate(summary.eval_success_free)}, train success "
            f"{_rate(summary.train_success)}, bank {summary.bank_size}, extractions ok/no_op/parse_error "
            f"{' / '.join(str(summary.extractions[status]) for status in PARSE_STATUSES)}, train steps actor "
            f"{summary.actor_train_steps} extractor {summary.extractor_train_steps}")


LONG_WORD = 24
"""A cell with a word longer than this (a run id, a path, a commit hash) may break it anywhere, so that a table fits
the window; every other cell breaks between words only."""


def _cell(text: str) -> str:
    long = any(len(word) > LONG_WORD for word in text.split())
    return f"<td class=\"long\">{html.escape(text)}</td>" if long else f"<td>{html.escape(text)}</td>"


def _table(columns: Sequence[str], rows: Sequence[Sequence[str]], table_id: str | None = None) -> str:
    header = "".join(f"<th>{html.escape(column)}</th>" for column in columns)
    body = "".join("<tr>" + "".join(_cell(cell) for cell in row) + "</tr>" for row in rows)
    opening = f"<table id=\"{html.escape(table_id)}\">" if table_id else "<table>"
    return f"{opening}\n<thead><tr>{header}</tr></thead>\n<tbody>{body}</tbody>\n</table>\n"


def _shell_word(text: str) -> str:
    """`text` as one shell word: in double quotes where nothing in it expands there, else as `shlex.quote` gives."""
    if text and not any(character in text for character in "\"$`\\!"):
        return f"\"{text}\""
    return shlex.quote(text)


def audit_command(run_dir: Path, sql: str) -> str:
    """The command line that runs `sql` over the archive of `run_dir`."""
    return f"crl audit sql {shlex.quote(str(run_dir))} {_shell_word(sql)}"


def _source_block(name: str, source: Source, run_dirs: Sequence[Path]) -> str:
    """A `<details>` block with the commands that print the numbers of a figure or a table, one per query and run."""
    commands = "\n".join(audit_command(run_dir, sql) for sql in source.queries for run_dir in run_dirs)
    queries = f"{len(source.queries)} quer{'y' if len(source.queries) == 1 else 'ies'}"
    return (f"<details class=\"source\" id=\"source-{html.escape(name)}\"><summary>Where the numbers come from: "
            f"{queries} (<code>crl audit sql</code>)</summary>\n<p>{html.escape(source.computed)}</p>\n"
            f"<pre>{html.escape(commands)}</pre>\n</details>\n")


LESSON_QUALITY_SOURCE = Source(
    (LESSONS_SQL, GUIDED_BY_VERSION_SQL),
    "Per run and extractor version: of the lessons it added or refined from episodes that revealed something (the "
    "first query), the share that state what their episode revealed (pipeline.audit.learning.extractor_versions: "
    "word for word; in a family with a rule across tasks, as a lesson of a kind true of the episode) and, in such a "
    "family, the share of each kind of lesson judged against the rule the episode revealed (lesson_kinds); from the "
    "second query, the guided train episodes served one of "
    "its lessons and their success.")
LESSON_KINDS_SHOWN = ("rule", "instance", "over-general", "wrong rule")
_QUALITY_COLUMNS = ("run", "extractor version", "lessons of revealing episodes", "state what was revealed",
                    *(f"{kind} lessons" for kind in LESSON_KINDS_SHOWN), "guided episodes served its lessons",
                    "their success")


@dataclass(frozen=True)
class LessonQuality:
    """One run's extractor versions: what each wrote and how the episodes its lessons guided ended."""

    run_id: str
    versions: tuple[ExtractorVersion, ...]
    kinds: tuple[LessonKinds, ...]


def lesson_quality(run_dir: Path, run_id: str) -> LessonQuality:
    return LessonQuality(run_id, tuple(extractor_versions(run_dir)), tuple(lesson_kinds(run_dir)))


def _share(part: int, whole: int) -> str:
    return f"{part / whole:.2f} ({part})" if whole else "-"


def _quality_section(runs: Sequence[LessonQuality], run_dirs: Sequence[Path]) -> str:
    """The lesson-quality panel: one row per run and extractor version (none where no extractor wrote a lesson)."""
    rows = []
    for run in runs:
        kinds = {k.version: k for k in run.kinds}
        for version in run.versions:
            by_kind = kinds.get(version.version)
            rows.append([run.run_id, str(version.version), str(version.lessons),
                         _share(version.stating, version.lessons),
                         *(_share(by_kind.counts.get(kind, 0), by_kind.lessons) if by_kind else "-"
                           for kind in LESSON_KINDS_SHOWN),
                         str(version.guided), _rate(version.guided_success)])
    if not rows:
        return ""
    return ("<h2>Lessons per extractor version</h2>\n" + _table(_QUALITY_COLUMNS, rows, "lesson-quality")
            + _source_block("lesson-quality", LESSON_QUALITY_SOURCE, run_dirs))


@dataclass(frozen=True)
class Behind:
    """What stands behind one run's figures: its warm starts' gates and the versions and banks of its
    evaluations."""

    run_id: str
    gates: dict[str, tuple[WarmStartGateCheck, ...]]
    evaluations: tuple[EvalProvenance, ...]


def behind(run_dir: Path, run_id: str) -> Behind:
    return Behind(run_id, warm_start_gates(run_dir), tuple(evaluation_provenance(run_dir)))


def _behind_section(runs: Sequence[Behind]) -> str:
    """Per run: each warm start's gate (a missed one in red), then the actor versions and bank positions behind each
    evaluation."""
    from pipeline.rl.warm_gate import gate_line, gate_passed

    items = []
    for run in runs:
        lines = [(gate_line(role, checks), not gate_passed(checks)) for role, checks in run.gates.items()]
        lines += [(f"evaluated at {evaluation.describe()}", False) for evaluation in run.evaluations]
        if not lines:
            continue
        entries = "".join(('<li class="missed">' if missed else "<li>") + f"{html.escape(text)}</li>"
                          for text, missed in lines)
        items.append(f"<li>{html.escape(run.run_id)}<ul>{entries}</ul></li>")
    if not items:
        return ""
    return ("<h2>Behind the figures: warm-start gates, the versions and banks of each evaluation</h2>\n"
            f'<ul id="behind">{"".join(items)}</ul>\n')


PARSE_ERROR_FLAG = 0.10
"""A run whose extractor's generations failed to parse more often than this is flagged at the top of the report."""


def flags(runs: Sequence[RunSummary]) -> list[str]:
    """What a reader should know before trusting a run's figures: a high parse-error rate of its extractor, and
    experiences whose text holds undecodable characters (shown as they are everywhere else)."""
    lines = []
    for run in runs:
        share = run.parse_error_share
        if share is not None and share > PARSE_ERROR_FLAG:
            total = sum(run.extractions.values())
            lines.append(f"{run.run_id}: {share:.0%} of the extractor's generations did not parse "
                         f"({run.extractions['parse_error']} of {total}; flagged above {PARSE_ERROR_FLAG:.0%}): the "
                         "bank grows only from the rest")
        if run.undecodable:
            first_id, first_text = run.undecodable[0]
            lines.append(f"{run.run_id}: {len(run.undecodable)} of {run.active} active experiences hold undecodable "
                         f"text (U+FFFD or UTF-8 read as Latin-1), shown as written; e.g. {first_id}: "
                         f"{first_text[:80]!r}")
    return lines


def _flags_section(runs: Sequence[RunSummary]) -> str:
    found = flags(runs)
    if not found:
        return ""
    items = "".join(f'<li class="missed">{html.escape(line)}</li>' for line in found)
    return f'<h2>Flags</h2>\n<ul id="flags">{items}</ul>\n'


def render_html(runs: Sequence[RunSummary], figures: dict[str, Path], arms: Sequence[ArmRow] = (),
                backgrounds: Sequence[Behind] = (), quality: Sequence[LessonQuality] = ()) -> str:
    """The page: title, one table row per arm (evaluation success pooled over its runs, with 95% intervals), one
    per run, then the figures (referenced by file name, next to the page). Under the table of arms and under each
    figure, the `crl audit sql` commands that print the numbers it shows (`ARM_TABLE_SOURCE`, `FIGURE_SOURCES`)."""
    title = "crl report: " + ", ".join(f"{run.run_id} ({run.arm})" for run in runs)
    run_dirs = [run.run_dir for run in runs]
    arm_section = ("<h2>Evaluation per arm (95% intervals: bootstrap over runs, then tasks)</h2>\n"
                   + _table(ROW_COLUMNS, [row_cells(row) for row in arms], "arm-table")
                   + _source_block("arm-table", ARM_TABLE_SOURCE, run_dirs)) if arms else ""
    images = "".join(
        f"<h2 id=\"figure-{html.escape(name)}\">{html.escape(_FIGURE_TITLES[name])}</h2>\n"
        f"<img src=\"{html.escape(path.name)}\" alt=\"{html.escape(_FIGURE_TITLES[name])}\">\n"
        + _source_block(name, FIGURE_SOURCES[name], run_dirs)
        for name, path in figures.items()
    )
    family_rows = [[run.run_id, row.task_family, _rate(row.eval_guided), _rate(row.eval_free), _rate(row.train_guided),
                    _rate(row.train_free), str(row.engine_failures)] for run in runs for row in run.families]
    family_section = ("<h2>Success per task family (eval: the last eval step; train: every step)</h2>\n"
                      + _table(_FAMILY_COLUMNS, family_rows)) if family_rows else ""
    return (f"<!doctype html>\n<html><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title>"
            f"<style>{_STYLE}</style></head>\n<body>\n<h1>{html.escape(title)}</h1>\n{_flags_section(runs)}"
            f"{arm_section}"
            f"{_behind_section(backgrounds)}{_quality_section(quality, run_dirs)}"
            f"<h2>Runs</h2>\n{_table(_COLUMNS, [summary_row(run) for run in runs])}{family_section}{images}"
            f"{_LOAD_CHECK}\n</body></html>\n")


def write_report(run_dirs: Sequence[Path], out_dir: Path | None = None) -> Report:
    """Read every run in `run_dirs` and write `report.html` and the PNGs into `out_dir`.

    `out_dir` defaults to `RUN_DIR/report` for one run and is required for several.
    """
    if not run_dirs:
        raise InvalidArgumentError("no run directories given")
    if out_dir is None:
        if len(run_dirs) > 1:
            raise InvalidArgumentError("several runs need an output directory (--out)")
        out_dir = run_dirs[0] / "report"
    runs = [load_run(run_dir) for run_dir in run_dirs]
    outcomes = [load_outcomes(run_dir) for run_dir in run_dirs]
    arms = arm_table(outcomes)
    out_dir.mkdir(parents=True, exist_ok=True)
    figures = {"learning": draw_learning(outcomes, arms, out_dir), **draw_figures(runs, out_dir)}
    page = out_dir / "report.html"
    backgrounds = [behind(run.summary.run_dir, run.summary.run_id) for run in runs]
    quality = [lesson_quality(run.summary.run_dir, run.summary.run_id) for run in runs]
    page.write_text(render_html([run.summary for run in runs], figures, arms, backgrounds, quality),
                    encoding="utf-8")
    return Report(html=page, figures=tuple(figures.values()), runs=tuple(run.summary for run in runs),
                  curves=tuple(run.curves for run in runs), arms=tuple(arms), quality=tuple(quality))
