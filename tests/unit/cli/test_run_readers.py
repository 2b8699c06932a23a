"""Commands that read a run: strict about their path, exact about what they compared, and printing for pipes.

Every such command, on an empty directory, on a directory that is not a run and on a path that does not exist,
exits 2 with one line and writes nothing, neither there nor in the working directory. `crl bank show` lists for
pipes and scripts (`--format`, `--sort`, `--limit`), and ids are taken as the tools print them.
"""

from __future__ import annotations

import csv
import io
import json
import os
from pathlib import Path

import pytest
from experience_ops import add
from typer.testing import CliRunner

from pipeline.audit.archive import archive_root
from pipeline.bank.replay import replay
from pipeline.bank.store import BankPosition, BankStore
from pipeline.cli import app
from pipeline.cli.listing import Format, print_rows
from schemas.arrays import EmbeddingVector

READERS = [
    ["bank", "show", "{dir}"],
    ["bank", "show", "{dir}", "some-id"],
    ["replay", "bank", "{dir}"],
    ["replay", "bank", "{dir}", "--from-kafka"],  # the op log from Kafka: the bank's database must still be there
    ["replay", "train", "{dir}"],
    ["audit", "sql", "{dir}", "SELECT count(*) FROM events"],
    ["audit", "events", "{dir}"],
    ["audit", "experience", "{dir}", "some-id"],
    ["audit", "fingerprint", "{dir}"],
    ["audit", "fingerprint", "{dir}", "{dir}"],
    ["report", "{dir}"],
    ["track", "{dir}", "--backend", "tensorboard"],
]
"""Every command that reads a run directory (`report` and `track` then write into it, but only into a run)."""


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    return {str(path.relative_to(root)): (path.stat().st_size, path.stat().st_mtime_ns) for path in root.rglob("*")}


def invoke(*args: str):
    env = {name: None for name in os.environ if name.startswith("CRL_")}
    return CliRunner().invoke(app, list(args), env=env)


@pytest.mark.parametrize("place", ["empty", "not a run", "missing"])
@pytest.mark.parametrize("command", READERS, ids=lambda command: " ".join(w for w in command if "{" not in w))
def test_a_reader_refuses_a_path_that_is_not_a_run_in_one_line_and_writes_nothing(tmp_path, monkeypatch, place,
                                                                                  command):
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)  # nothing may appear in the working directory either (a runs/default, a database)
    target = tmp_path / "target"
    if place != "missing":
        target.mkdir()
    if place == "not a run":
        (target / "notes.txt").write_text("a folder of something else\n")
        (target / "logs").mkdir()
    before = _tree(tmp_path)
    result = invoke(*(word.format(dir=target) for word in command))
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1, result.output
    assert lines[0].startswith("error: ") and str(target) in lines[0], lines[0]
    assert _tree(tmp_path) == before


KEY = EmbeddingVector.from_array("all-MiniLM-L6-v2", [0.25, -0.5, 0.125, 1.0])
RUN = "run-with-a-long-id-2026"
IDS = [f"{RUN}-traj-{n:04d}-e0" for n in range(3)]
SERVED = {IDS[0]: [True, False, False, False], IDS[1]: [True, True], IDS[2]: []}
"""Served 4 times (1 success), twice (2) and never: by `served` 0, 1, 2; by `success` 1, 0, 2."""


@pytest.fixture
def run_dir(tmp_path, sqlite_in) -> Path:
    """A run with an (empty) archive and a bank of three experiences, the last written most recently."""
    run = tmp_path / "run"
    archive_root(run).mkdir(parents=True)
    ops = [add(f"op-{n}", experience_id, f"lesson {n}: " + "x" * 120, "signpost", KEY, run_id=RUN,
               generation_id=f"gen-{n}", source_trajectory_ids=(f"traj-{n:04d}",))
           for n, experience_id in enumerate(IDS)]
    state = replay(enumerate(ops), run_id=RUN).state
    served = [{"trajectory_id": f"played-{experience_id}-{k}", "experience_id": experience_id, "version": 1,
               "generation_id": f"gen-{n}", "bank_offset": 3, "step": k, "success": success, "reward": float(success)}
              for n, experience_id in enumerate(IDS) for k, success in enumerate(SERVED[experience_id])]
    BankStore(sqlite_in(run)).save(state, IDS, BankPosition("crl.experience-ops", 0, 3, "log-a", state.state_hash(),
                                                            3, 0, 0), served=served)
    return run


def test_bank_show_sorts_limits_and_prints_csv_and_json_with_whole_values(run_dir):
    by_served = invoke("bank", "show", str(run_dir), "--sort", "served", "--format", "csv")
    assert by_served.exit_code == 0, by_served.output
    rows = list(csv.DictReader(io.StringIO(by_served.stdout)))
    assert [row["experience"] for row in rows] == IDS
    assert [row["served"] for row in rows] == ["4", "2", "0"]
    assert [row["success"] for row in rows] == ["0.25", "1.0", ""]
    assert rows[0]["text"] == "lesson 0: " + "x" * 120  # whole, where the table cuts it
    by_success = invoke("bank", "show", str(run_dir), "--sort", "success", "--limit", "2", "--format", "json")
    assert [json.loads(line)["experience"] for line in by_success.stdout.splitlines()] == [IDS[1], IDS[0]]
    recent = invoke("bank", "show", str(run_dir), "--sort", "recent", "--format", "json", "--limit", "1")
    assert [json.loads(line)["experience"] for line in recent.stdout.splitlines()] == [IDS[2]]


def test_a_piped_table_is_never_cut(run_dir):
    table = invoke("bank", "show", str(run_dir), "--limit", "2")
    assert table.exit_code == 0, table.output
    lines = table.stdout.splitlines()
    assert all(any(experience_id in line for line in lines) for experience_id in IDS[:2]), table.stdout
    assert "2 of 3 experiences; bank at offset 3" in table.stdout
    assert "lesson 0: " + "x" * 79 + "…" in table.stdout  # free text is cut on purpose, at 90 characters


def test_ids_are_taken_whole_by_a_unique_beginning_or_cut_with_an_ellipsis(run_dir):
    for given in (IDS[1], IDS[1][:-2], IDS[1][:-2] + "…", IDS[1][:-2] + "..."):
        shown = invoke("bank", "show", str(run_dir), given)
        assert shown.exit_code == 0, (given, shown.output)
        assert IDS[1] in shown.stdout.splitlines()[0]
    ambiguous = invoke("bank", "show", str(run_dir), f"{RUN}-traj-000")
    assert ambiguous.exit_code == 1
    assert ambiguous.output.strip() == (f"error: 3 experiences begin with {RUN}-traj-000: {', '.join(IDS)}; give "
                                        "more of the id")
    typo = invoke("bank", "show", str(run_dir), IDS[2].replace("traj", "trja"))
    assert typo.exit_code == 1 and f"did you mean {IDS[2]}" in typo.output


def test_replay_train_exits_1_when_it_compared_nothing(run_dir):
    result = invoke("replay", "train", str(run_dir))
    assert result.exit_code == 1
    assert "compared nothing" in result.output


def test_print_rows_writes_each_format(capsys):
    rows = [("a" * 300, 1, None), ("b", 2.5, "x,y")]
    print_rows(["id", "n", "note"], rows, Format.csv)
    assert capsys.readouterr().out == f"id,n,note\n{'a' * 300},1,\nb,2.5,\"x,y\"\n"
    print_rows(["id", "n", "note"], rows, Format.json)
    assert [json.loads(line) for line in capsys.readouterr().out.splitlines()] == [
        {"id": "a" * 300, "n": 1, "note": None}, {"id": "b", "n": 2.5, "note": "x,y"}]
    print_rows(["id", "n", "note"], rows, Format.table, footer="2 rows")
    out = capsys.readouterr().out
    assert "a" * 300 in out and out.rstrip().endswith("2 rows")


def test_show_tables_lists_every_view_and_sql_errors_stay_short(run_dir):
    tables = invoke("audit", "sql", str(run_dir), "SHOW TABLES", "--format", "csv")
    assert tables.exit_code == 0, tables.output
    names = {row["name"] for row in csv.DictReader(io.StringIO(tables.stdout))}
    assert {"events", "trajectories", "train_steps", "experiences", "experience_history", "experience_usage",
            "experience_lineage", "experience_ops", "trajectory_completed"} <= names
    missing = invoke("audit", "sql", str(run_dir), "SELECT * FROM trajectory")
    assert missing.exit_code == 1
    assert len(missing.output.strip().splitlines()) == 1, missing.output
    assert "SHOW TABLES lists the views" in missing.output
    keyword = invoke("audit", "sql", str(run_dir), "SELECT offset, kind FROM events")
    assert keyword.exit_code == 1
    assert len(keyword.output.strip().splitlines()) == 1, keyword.output
    assert 'quote the column, "offset"' in keyword.output
    quoted = invoke("audit", "sql", str(run_dir), 'SELECT "offset", kind FROM events LIMIT 1 OFFSET 0')
    assert quoted.exit_code == 0, quoted.output


def test_audit_sql_help_lists_every_view_with_its_columns():
    from pipeline.audit.views import view_columns

    shown = invoke("audit", "sql", "--help")
    assert shown.exit_code == 0, shown.output
    lines = {line.strip().split(":")[0]: line for line in shown.output.splitlines() if ": " in line}
    for name, columns in view_columns().items():
        assert name in lines, name
        assert all(column in lines[name] for column, _ in columns), (name, lines[name])
