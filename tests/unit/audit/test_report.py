"""`crl report` over two synthetic runs of different arms, archived by the real Archiver (no broker).

The complementary run has every kind of data: train and eval episodes, served experiences, extractor generations
of every parse status (one without a step), an op log with a rejected op, a merge and a capacity eviction, and both
trainers' steps. The grpo run has free train episodes and actor steps only, so most of its panels are empty.
"""

from __future__ import annotations

import csv
import hashlib
import html
import io
import json
import re
import shlex
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pipeline.audit.archive import archive_root
from pipeline.audit.report import (
    ARM_TABLE_SOURCE,
    BANK_SQL,
    FIGURE_SOURCES,
    LESSON_QUALITY_SOURCE,
    OP_KINDS,
    PARSE_ERROR_FLAG,
    SUCCESS_SQL,
    FamilyRow,
    RunSummary,
    flags,
    load_run,
    render_html,
    run_labels,
    write_report,
)
from pipeline.audit.views import Audit
from pipeline.bank.state import undecodable
from pipeline.cli import app
from pipeline.runtime.harness import run_worker
from schemas.arrays import EmbeddingVector
from schemas.base import Event, Producer
from schemas.experiences import (
    ExperienceAdded,
    ExperienceMerged,
    ExperienceRefined,
    ExperienceRetired,
    VersionedExperience,
)
from schemas.extractions import ExtractionGenerated
from schemas.runs import RunFinished, RunStarted
from schemas.training import TrainStepCompleted
from schemas.trajectories import ExperienceRef, Timings, TrajectoryCompleted, Turn
from workers.archiver import Archiver

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
FIGURES = ["success.png", "actions.png", "bank.png", "extractor.png", "retrieval.png"]
T0 = datetime(2025, 1, 2, 3, 4, 5, tzinfo=UTC)
FAMILY = "minihack-room"
KEY = EmbeddingVector.from_array("all-MiniLM-L6-v2", [0.25, -0.5, 0.125, 1.0])
WHO = Producer(worker="test", instance="test-0")
_clock = iter(range(1_000_000))


def common(run_id: str) -> dict:
    return {"run_id": run_id, "producer": WHO, "occurred_at": T0 + timedelta(seconds=next(_clock))}


def episode(run_id: str, step: int, split: str, slot: int, success: bool, actions: int, invalid: int = 0,
            served: tuple[str, ...] = (), guided: bool | None = None) -> TrajectoryCompleted:
    guided = bool(served) if guided is None else guided
    return TrajectoryCompleted(
        **common(run_id), trajectory_id=f"{run_id}-{split}-s{step}-k{slot}", assignment_event_id=f"a-{step}-{slot}",
        step=step, split=split, env_id="MiniHack-Room-Random-5x5-v0", task_family=FAMILY, seed=step, slot=slot,
        group_id=f"{split}-s{step}" if split == "train" else f"eval-s{step:06d}-MiniHack-Room-Random-5x5-v0-t000",
        guided=guided, goal="Reach the stairs.",
        turns=(Turn(observation="A room.", prompt_token_ids=(1, 2), response_token_ids=(3,), sampling_logprobs=(-0.5,),
                    response_text="south", action="south", valid=True, reward=float(success)),),
        reward=float(success), success=success, num_actions=actions, invalid_actions=invalid, truncated=not success,
        retrieved=tuple(ExperienceRef(experience_id=e, version=1, generation_id="gen-1") for e in served),
        bank_offset=0 if served else None, policy_version=step, timings=Timings(generation_s=0, env_s=0,
                                                                                retrieval_s=0),
    )


def generation(run_id: str, generation_id: str, step: int | None, status: str, ops: int = 0,
               purpose: str = "distill") -> ExtractionGenerated:
    return ExtractionGenerated(
        **common(run_id), generation_id=generation_id, extractor_version=0, purpose=purpose, task_family=FAMILY,
        step=step, prompt_token_ids=(1, 2), response_token_ids=(3,), sampling_logprobs=(-0.5,), response_text="x",
        parse_status=status, parse_error="not JSON" if status == "parse_error" else None,
        op_ids=tuple(f"{generation_id}:{i}" for i in range(ops)),
    )


def train_step(run_id: str, role: str, step: int, metrics: dict[str, float]) -> TrainStepCompleted:
    return TrainStepCompleted(
        **common(run_id), role=role, step=step, policy_version=step + 1, batch_event_ids=("e1",),
        weight_hash_before=hashlib.sha256(f"{role}{step}".encode()).hexdigest(),
        weight_hash_after=hashlib.sha256(f"{role}{step + 1}".encode()).hexdigest(), loss=0.0, tokens=1,
        loss_variant="grpo" if role == "actor" else "cispo", aggregation="token-mean", metrics=metrics,
    )


def added(run_id: str, op_id: str, experience_id: str, generation_id: str) -> ExperienceAdded:
    return ExperienceAdded(**common(run_id), op_id=op_id, experience_id=experience_id, task_family=FAMILY,
                           text=f"Advice {experience_id}.", key=KEY, generation_id=generation_id,
                           extractor_version=0, source_trajectory_ids=("t",))


def refined(run_id: str, op_id: str, generation_id: str) -> ExperienceRefined:
    return ExperienceRefined(**common(run_id), op_id=op_id, experience_id="exp-a", expected_version=1,
                             text="Advice exp-a, refined.", generation_id=generation_id, extractor_version=0)


def complementary_run(run_id: str = "comp-1") -> list[Event]:
    return [
        RunStarted(**common(run_id), config={"scheduler": {"arm": "complementary", "steps": 2}},
                   code_version="abc123"),
        # step 0: guided 1/2, free 1/2; solved with 4 and 2 actions; 2 invalid of 20
        episode(run_id, 0, "train", 0, True, 4, served=("exp-a",)),
        episode(run_id, 0, "train", 1, False, 6, invalid=2, guided=True),
        episode(run_id, 0, "train", 2, True, 2),
        episode(run_id, 0, "train", 3, False, 8),
        # step 1: guided 2/2, free 1/2; solved with 3, 5 and 7 actions; 5 invalid of 20
        episode(run_id, 1, "train", 0, True, 3, served=("exp-a",)),
        episode(run_id, 1, "train", 1, True, 5, invalid=1, served=("exp-b", "exp-a")),
        episode(run_id, 1, "train", 2, False, 5, invalid=4),
        episode(run_id, 1, "train", 3, True, 7),
        episode(run_id, 1, "eval", 0, True, 3, served=("exp-b",)),
        episode(run_id, 1, "eval", 1, False, 9),
        generation(run_id, "gen-0", None, "no_op"),  # written before generations had a step
        generation(run_id, "gen-1", 0, "ok", ops=2),
        generation(run_id, "gen-2", 1, "ok", ops=1),
        generation(run_id, "gen-3", 1, "parse_error"),
        generation(run_id, "gen-4", 1, "no_op"),
        generation(run_id, "gen-5", 1, "ok", ops=1),
        generation(run_id, "gen-6", 1, "ok", ops=1),
        generation(run_id, "gen-m", 2, "ok", ops=1, purpose="merge"),
        added(run_id, "gen-1:0", "exp-a", "gen-1"),          # offset 0, step 0
        added(run_id, "gen-1:1", "exp-b", "gen-1"),          # offset 1, step 0
        refined(run_id, "gen-2:0", "gen-2"),                 # offset 2, step 1: exp-a v2
        refined(run_id, "gen-5:0", "gen-5"),                 # offset 3, step 1: stale (expects v1), rejected
        added(run_id, "gen-6:0", "exp-c", "gen-6"),          # offset 4, step 1
        ExperienceMerged(**common(run_id), op_id="gen-m:0", experience_id="exp-m", task_family=FAMILY,  # offset 5
                         text="Merged advice.", key=KEY, generation_id="gen-m", extractor_version=0,
                         sources=(VersionedExperience(experience_id="exp-a", expected_version=2),
                                  VersionedExperience(experience_id="exp-b", expected_version=1))),
        ExperienceRetired(**common(run_id), op_id="evict:exp-c", experience_id="exp-c", expected_version=1,
                          reason="capacity"),            # offset 6: no generation, takes step 2 from the merge
        train_step(run_id, "actor", 0, {"train/clip_fraction": 0.0, "rollout/reward_mean": 0.5}),
        train_step(run_id, "actor", 1, {"train/clip_fraction": 0.5, "rollout/reward_mean": 0.75}),
        train_step(run_id, "extractor", 0, {"train/clip_fraction": 0.5, "extractor/reward_mean": 0.25}),
        train_step(run_id, "extractor", 1, {"train/clip_fraction": 0.125, "extractor/reward_mean": 0.75}),
        RunFinished(**common(run_id), status="completed", steps_completed=2),
    ]


def grpo_run(run_id: str = "grpo-1") -> list[Event]:
    return [
        RunStarted(**common(run_id), config={"scheduler": {"arm": "grpo", "steps": 2}}, code_version="abc123"),
        episode(run_id, 0, "train", 0, True, 3),
        episode(run_id, 0, "train", 1, False, 5, invalid=1),
        train_step(run_id, "actor", 0, {"train/clip_fraction": 0.25, "rollout/reward_mean": 0.5}),
    ]


def archived(run_dir, events):
    run_worker(Archiver(archive_root(run_dir), flush_rows=4, flush_interval_s=3600), events)
    return run_dir


@pytest.fixture
def runs(tmp_path):
    return archived(tmp_path / "comp", complementary_run()), archived(tmp_path / "grpo", grpo_run())


def test_complementary_run_curves(runs):
    curves = load_run(runs[0]).curves
    assert curves.success == {"train guided": {0: 0.5, 1: 1.0}, "train free": {0: 0.5, 1: 0.5},
                              "eval guided": {1: 1.0}, "eval free": {1: 0.0}}
    assert curves.actions_per_solved == {0: 3.0, 1: 5.0}
    assert curves.invalid_rate == {0: 0.1, 1: 0.25}
    assert curves.served_fraction == {0: 0.5, 1: 1.0}
    assert curves.distinct_served == {0: 1.0, 1: 2.0}
    # Applied ops only (the stale refine is rejected); the eviction inherits step 2 from the merge before it.
    assert curves.bank_size == {0: 2.0, 1: 3.0, 2: 1.0}
    assert curves.ops == {"added": {0: 2.0, 1: 1.0, 2: 0.0}, "refined": {0: 0.0, 1: 1.0, 2: 0.0},
                          "merged": {0: 0.0, 1: 0.0, 2: 1.0}, "retired": {0: 0.0, 1: 0.0, 2: 1.0}}
    assert curves.extractor_reward == {0: 0.25, 1: 0.75}
    assert curves.extractor_clip_fraction == {0: 0.5, 1: 0.125}
    assert curves.parse_status == {"ok": {0: 1.0, 1: 3.0, 2: 1.0}, "no_op": {0: 0.0, 1: 1.0, 2: 0.0},
                                   "parse_error": {0: 0.0, 1: 1.0, 2: 0.0}}


def test_every_op_of_the_log_has_a_step_applied_or_not(runs):
    with Audit(runs[0]) as audit:
        rows = audit.query("SELECT op_offset, op_id, op_kind, step FROM experience_ops")[1]
    # The stale refine (offset 3) is rejected but still in the log; the eviction has no generation and inherits the
    # merge's step.
    assert rows == [(0, "gen-1:0", "ExperienceAdded", 0), (1, "gen-1:1", "ExperienceAdded", 0),
                    (2, "gen-2:0", "ExperienceRefined", 1), (3, "gen-5:0", "ExperienceRefined", 1),
                    (4, "gen-6:0", "ExperienceAdded", 1), (5, "gen-m:0", "ExperienceMerged", 2),
                    (6, "evict:exp-c", "ExperienceRetired", 2)]


def test_grpo_run_has_empty_bank_and_extractor_curves(runs):
    curves = load_run(runs[1]).curves
    assert curves.success == {"train guided": {}, "train free": {0: 0.5}, "eval guided": {}, "eval free": {}}
    assert curves.actions_per_solved == {0: 3.0}
    assert curves.invalid_rate == {0: 0.125}
    assert curves.bank_size == {} and curves.ops == {kind: {} for kind in OP_KINDS}
    assert curves.extractor_reward == {} and curves.extractor_clip_fraction == {}
    assert curves.parse_status == {"ok": {}, "no_op": {}, "parse_error": {}}
    assert curves.served_fraction == {} and curves.distinct_served == {}


def test_report_of_two_runs_writes_the_page_and_every_figure(runs, tmp_path):
    out = tmp_path / "comparison"
    report = write_report(list(runs), out)
    assert report.html == out / "report.html"
    assert [path.name for path in report.figures] == ["learning.png", *FIGURES]
    for path in report.figures:
        assert path.parent == out
        assert path.read_bytes().startswith(PNG_MAGIC)
    page = report.html.read_text()
    assert re.findall(r'<img src="([^"]+)"', page) == ["learning.png", *FIGURES]
    # the arm table: header + the complementary arm's guided and free rows (the grpo run has no evaluation); then
    # the run table: header + one row per run; then the family table: header + one family per run; the lesson-quality
    # panel: header + extractor version 0 of the complementary run (its lessons' sources are no episode of the run,
    # so none counts as a lesson of a revealing episode; four guided train episodes were served its lessons)
    assert page.count("<tr>") == 3 + 3 + 3 + 2
    assert ("<tr><td>comp-1</td><td>0</td><td>0</td><td>-</td><td>-</td><td>-</td><td>-</td><td>-</td><td>4</td>"
            "<td>100.0%</td></tr>") in page
    assert 'id="source-lesson-quality"' in page
    assert "<h2>Success per task family" in page
    assert [(row.arm, row.kind, row.tasks, row.before.value, row.verdict) for row in report.arms] == [
        ("complementary", "guided", 1, 1.0, "not measured (one evaluation)"),
        ("complementary", "free", 1, 0.0, "not measured (one evaluation)")]
    for text in ("comp-1 (complementary)", "grpo-1 (grpo)", "<td>abc123</td>", "<td>62.5%</td>",
                 "<td>5 / 2 / 1</td>", "<td>unfinished</td>"):
        assert text in page
    assert report.runs == (
        RunSummary(run_dir=runs[0], run_id="comp-1", arm="complementary", code_version="abc123", status="completed",
                   steps=2, eval_success_guided=1.0, eval_success_free=0.0, train_success=0.625, bank_size=1,
                   extractions={"ok": 5, "no_op": 2, "parse_error": 1}, actor_train_steps=2,
                   extractor_train_steps=2,
                   families=(FamilyRow("minihack-room", 1.0, 0.0, 0.75, 0.5, engine_failures=0),), active=1),
        RunSummary(run_dir=runs[1], run_id="grpo-1", arm="grpo", code_version="abc123", status="unfinished",
                   steps=1, eval_success_guided=None, eval_success_free=None, train_success=0.5, bank_size=0,
                   extractions={"ok": 0, "no_op": 0, "parse_error": 0}, actor_train_steps=1,
                   extractor_train_steps=0,
                   families=(FamilyRow("minihack-room", None, None, None, 0.5, engine_failures=0),)),
    )


def audit_sql_json(command: str) -> list[dict]:
    """What a command line printed on the page prints with `--format json` (it must be `crl audit sql DIR SQL`)."""
    program, *arguments = shlex.split(command)
    assert (program, *arguments[:2]) == ("crl", "audit", "sql") and len(arguments) == 4, command
    result = CliRunner().invoke(app, [*arguments, "--format", "json"])
    assert result.exit_code == 0, result.output
    return [json.loads(line) for line in result.output.splitlines()]


def test_every_figure_and_the_arm_table_print_the_queries_they_were_made_from(runs, tmp_path):
    report = write_report(list(runs), tmp_path / "comparison")
    page = report.html.read_text()
    # Under each figure, its block; under the table of arms, its own.
    blocks = re.findall(r'<img src="(\w+)\.png"[^>]*>\n<details class="source" id="source-(\w+)">', page)
    assert blocks == [(name, name) for name in FIGURE_SOURCES]
    assert re.search(r'<table id="arm-table">.*?</table>\n<details class="source" id="source-arm-table">', page,
                     re.DOTALL)
    assert "pipeline.audit.learning.arm_table" in page
    commands = [html.unescape(line) for block in re.findall(r"<pre>(.*?)</pre>", page, re.DOTALL)
                for line in block.splitlines()]
    # One command per query and run; the SQL printed is the SQL the report read its numbers with.
    sources = [ARM_TABLE_SOURCE, LESSON_QUALITY_SOURCE, *FIGURE_SOURCES.values()]
    assert commands == [f'crl audit sql {run_dir} "{sql}"' for source in sources for sql in source.queries
                        for run_dir in runs]
    printed = {command: audit_sql_json(command) for command in commands}
    curves = report.curves[0]
    success = printed[f'crl audit sql {runs[0]} "{SUCCESS_SQL}"']
    assert {f"{row['split']} {'guided' if row['guided'] else 'free'}" for row in success} == set(curves.success)
    for row in success:
        series = curves.success[f"{row['split']} {'guided' if row['guided'] else 'free'}"]
        assert series[row["step"]] == row["success_rate"]
    bank = printed[f'crl audit sql {runs[0]} "{BANK_SQL}"']
    assert {row["step"]: row["bank_size"] for row in bank} == curves.bank_size == {0: 2.0, 1: 3.0, 2: 1.0}
    assert {kind: {row["step"]: row[kind] for row in bank} for kind in OP_KINDS} == curves.ops
    assert printed[f'crl audit sql {runs[1]} "{BANK_SQL}"'] == []


def test_report_of_an_empty_run_dir_draws_empty_axes(tmp_path):
    report = write_report([tmp_path])
    assert report.html == tmp_path / "report" / "report.html"
    assert all(path.read_bytes().startswith(PNG_MAGIC) for path in report.figures)
    (summary,) = report.runs
    assert (summary.run_id, summary.arm, summary.code_version, summary.status, summary.steps, summary.bank_size,
            summary.train_success) == (tmp_path.name, "unknown", "unknown", "unfinished", 0, 0, None)


def test_several_runs_need_an_output_directory(runs):
    with pytest.raises(ValueError, match="--out"):
        write_report(list(runs))


# -- crl report -------------------------------------------------------------------------------------------------------


def invoke(*args: str):
    return CliRunner().invoke(app, ["report", *args])


def test_cli_writes_the_report_of_several_runs(runs, tmp_path):
    out = tmp_path / "cli-out"
    result = invoke(str(runs[0]), str(runs[1]), "--out", str(out))
    assert result.exit_code == 0, result.output
    assert sorted(path.name for path in out.iterdir()) == sorted([*FIGURES, "learning.png", "report.html"])
    assert ("complementary, unseen tasks, guided (1 run, 1 tasks): eval success 1.00 [1.00, 1.00] -> 1.00 [1.00, "
            "1.00]: not measured (one evaluation); guided - free after +1.00 [+1.00, +1.00]") in result.output
    assert ("comp-1 (complementary): completed, 2 steps, eval success guided 100.0% free 0.0%, train success "
            "62.5%, bank 1, extractions ok/no_op/parse_error 5 / 2 / 1, train steps actor 2 extractor 2"
            ) in result.output
    assert "grpo-1 (grpo): unfinished, 1 steps, eval success guided - free -" in result.output
    assert f"wrote {out / 'report.html'}" in result.output


def test_cli_defaults_to_the_run_dirs_report_folder(runs):
    result = invoke(str(runs[1]))
    assert result.exit_code == 0, result.output
    assert (runs[1] / "report" / "report.html").is_file()
    assert all((runs[1] / "report" / name).read_bytes().startswith(PNG_MAGIC) for name in FIGURES)


def test_cli_rejects_several_runs_without_out_and_a_missing_run_dir(runs, tmp_path):
    several = invoke(str(runs[0]), str(runs[1]))
    assert several.exit_code == 2
    assert "--out" in several.output
    missing = invoke(str(tmp_path / "nope"))
    assert missing.exit_code == 2
    assert "no run directory" in missing.output


ROOT = Path(__file__).resolve().parents[3]
LESSONS_OF_A_VERSION = """
SELECT h.experience_id, h.version, h.text, count(u.trajectory_id) AS guided,
       count(u.trajectory_id) FILTER (WHERE u.success) AS successes
FROM experience_history AS h
LEFT JOIN experience_usage AS u ON u.experience_id = h.experience_id AND u.version = h.version
WHERE h.extractor_version = 0
GROUP BY h.op_offset, h.experience_id, h.version, h.text ORDER BY h.op_offset
"""
"""docs/running.md's query: which lessons extractor version 0 wrote, and how the episodes they guided ended."""


def test_audit_sql_answers_which_lessons_a_version_wrote_and_how_their_episodes_ended(runs):
    result = CliRunner().invoke(app, ["audit", "sql", str(runs[0]), LESSONS_OF_A_VERSION, "--format", "csv"])
    assert result.exit_code == 0, result.output
    rows = list(csv.reader(io.StringIO(result.output.strip())))
    # exp-a v1 guided three episodes (two train steps and one served beside exp-b), exp-b v1 one train and one eval
    # episode, all solved; the refine (exp-a v2), exp-c and the merge were served nothing. The stale refine is in no
    # version.
    assert rows == [["experience_id", "version", "text", "guided", "successes"],
                    ["exp-a", "1", "Advice exp-a.", "3", "3"], ["exp-b", "1", "Advice exp-b.", "2", "2"],
                    ["exp-a", "2", "Advice exp-a, refined.", "0", "0"], ["exp-c", "1", "Advice exp-c.", "0", "0"],
                    ["exp-m", "1", "Merged advice.", "0", "0"]]
    assert LESSONS_OF_A_VERSION.strip() in (ROOT / "docs" / "running.md").read_text()


def test_legends_name_runs_by_what_sets_them_apart():
    assert run_labels(["paper_3task_seed1_20261127", "paper_3task_seed2_20261127"]) == ["seed1", "seed2"]
    assert run_labels(["only-one-run"]) == ["only-one-run"]
    assert run_labels(["run-a", "run-a-b"]) == ["a", "a-b"]  # cut at a separator, never inside a word
    assert run_labels(["same", "same"]) == ["same", "same"]


def test_flags_name_a_high_parse_error_rate_and_undecodable_bank_text(runs):
    summary = load_run(runs[0]).summary
    assert summary.parse_error_share == pytest.approx(1 / 8)
    assert flags([summary]) == [f"comp-1: 12% of the extractor's generations did not parse (1 of 8; flagged above "
                                f"{PARSE_ERROR_FLAG:.0%}): the bank grows only from the rest"]
    garbled = replace(summary, extractions={"ok": 9, "no_op": 1, "parse_error": 0}, active=4,
                      undecodable=(("exp-x", "go west\ufffd then north"),))
    assert flags([garbled]) == ["comp-1: 1 of 4 active experiences hold undecodable text (U+FFFD or UTF-8 read as "
                                "Latin-1), shown as written; e.g. exp-x: 'go west\ufffd then north'"]
    page = render_html([summary], {})
    assert '<ul id="flags"><li class="missed">comp-1: 12% of' in page
    assert "<h2>Flags</h2>" not in render_html([replace(summary, extractions={"ok": 1, "no_op": 0,
                                                                               "parse_error": 0})], {})


@pytest.mark.parametrize(("text", "garbled"), [("go west\ufffd", True), ("caf\u00c3\u00a9", True),
                                               ("it\u00e2\u20ac\u2122s", True), ("caf\u00e9, na\u00efve", False),
                                               ("\u00c3 alone", False)])
def test_undecodable_text_is_told_from_text_with_accents(text, garbled):
    assert undecodable(text) is garbled
