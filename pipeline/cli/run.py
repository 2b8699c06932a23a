"""`crl run CONFIG`: the whole loop (`pipeline.run.supervisor`)."""

from __future__ import annotations

import os
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer

from pipeline.cli.common import (
    BrokerOption,
    BrokersOption,
    SecurityOption,
    State,
    configure_logging,
    console,
    fail,
)
from pipeline.settings import Settings, load_settings


class ArmChoice(StrEnum):
    complementary = "complementary"
    grpo = "grpo"
    static_extractor = "static_extractor"
    exp_only = "exp_only"
    frozen = "frozen"


def run(
    config: Annotated[Path | None, typer.Argument(
        help="Run config (YAML), e.g. configs/tiny-minihack-room.yaml (none with --resume).")] = None,
    resume: Annotated[Path | None, typer.Option(
        "--resume", help="Continue the run in this run directory (stopped, failed or crashed), with its settings.",
        metavar="RUN_DIR")] = None,
    run_dir: Annotated[Path | None, typer.Option(
        "--run-dir", help="An empty or new directory for the run (default: CRL_RUN_DIR, else "
        "runs/CONFIG-NAME-YYYYMMDD-HHMMSS).")] = None,
    steps: Annotated[int | None, typer.Option(help="Override scheduler.steps (e.g. 3 for a smoke run).")] = None,
    arm: Annotated[ArmChoice | None, typer.Option(help="Override scheduler.arm (paper baselines).")] = None,
    report: Annotated[bool, typer.Option(help="Write the report (RUN_DIR/report) at the end.")] = True,
    broker_kind: BrokerOption = None,
    brokers: BrokersOption = None,
    security: SecurityOption = None,
) -> None:
    """Run Complementary RL end to end: broker, topics, every worker, live progress, drain, stop, report."""

    from pipeline.run.plan import check_run_dir, default_run_dir
    from pipeline.run.supervisor import RUN_CONFIG

    if resume is not None:
        if config is not None or steps is not None or arm is not None or broker_kind is not None or brokers \
                or run_dir or security is not None:
            raise fail("--resume continues a run with its own settings (RUN_DIR/config.yaml): give no CONFIG, "
                       "--steps, --arm, --broker, --brokers, --security or --run-dir with it", 2)
        if not (resume / RUN_CONFIG).is_file():
            raise fail(f"{resume} holds no {RUN_CONFIG}: not a run directory that `crl run` made", 2)
        _supervise(load_settings(resume / RUN_CONFIG, run_dir=resume), report, resume=True)
        return
    if config is None:
        raise fail("give a run config (e.g. configs/tiny-minihack-room.yaml), or --resume RUN_DIR", 2)
    scheduler: dict[str, Any] = {"steps": steps} if steps is not None else {}
    if arm is not None:
        scheduler["arm"] = arm.value
    overrides: dict[str, Any] = {"scheduler": scheduler}
    if broker_kind is not None:
        overrides["broker"] = {"kind": broker_kind.value}
    if brokers is not None:
        overrides["broker"] = overrides.get("broker", {}) | {"brokers": brokers}
    if security is not None:
        overrides["broker"] = overrides.get("broker", {}) | {"security": security.value}
    # This is the settings edge: the options override the config and the CRL_* variables; the workers read the
    # result from RUN_DIR/config.yaml (`RunSupervisor`).
    overrides["run_dir"] = run_dir or (Path(os.environ["CRL_RUN_DIR"]) if "CRL_RUN_DIR" in os.environ
                                       else default_run_dir(config))
    settings = load_settings(config, **overrides)
    check_run_dir(settings.run_dir)
    settings.run_dir.mkdir(parents=True, exist_ok=True)
    _supervise(settings, report, resume=False)


def _supervise(settings: Settings, report: bool, resume: bool) -> None:
    from pipeline.run.supervisor import RunSupervisor

    configure_logging(State.log_level, settings.run_dir / "logs" / "crl-run.log")
    console.print(f"run {settings.resolved_run_id}: arm {settings.scheduler.arm}, {settings.scheduler.steps} steps, "
                  f"{', '.join(t.env_id for t in settings.envs.tasks)}; run dir {settings.run_dir}")
    supervisor = RunSupervisor(settings, console, resume=resume)
    progress = supervisor.run()
    finished = progress.finished
    status = finished.status if finished is not None else "interrupted"
    console.print(f"run {settings.resolved_run_id} {status}: {supervisor.summary_line()}", highlight=False,
                  soft_wrap=True)
    from pipeline.audit.learning import (
        evaluation_provenance,
        load_outcomes,
        missed_gates,
        rule_share_line,
        verdict_lines,
    )

    for line in verdict_lines(load_outcomes(settings.run_dir)):  # 95% intervals over the evaluated tasks
        console.print(line, markup=False, highlight=False, soft_wrap=True)
    if (rule_share := rule_share_line(settings.run_dir)) is not None:
        console.print(rule_share, markup=False, highlight=False, soft_wrap=True)
    for evaluation in evaluation_provenance(settings.run_dir):
        console.print(f"evaluated at {evaluation.describe()}", markup=False, highlight=False, soft_wrap=True)
    for line in missed_gates(settings.run_dir):
        console.print(f"{line}: this run's learning figures stand on a warm start that missed its gate",
                      style="bold red", markup=False, highlight=False, soft_wrap=True)
    if report:
        from pipeline.audit.report import summary_line, write_report

        written = write_report([settings.run_dir])
        for summary in written.runs:
            console.print(summary_line(summary), markup=False, highlight=False, soft_wrap=True)
        console.print(f"report: {written.html}")
    some = next((e.experience_id for e in progress.bank.experiences.values() if len(e.history) > 1), None) or \
        next(iter(progress.bank.experiences), "EXPERIENCE_ID")
    console.print("next:", highlight=False)
    bank_lines = [f"crl replay bank {settings.run_dir}", f"crl bank show {settings.run_dir}",
                  f"crl audit experience {settings.run_dir} {some}"] if settings.scheduler.arm != "grpo" else []
    for line in (*bank_lines, f"crl replay train {settings.run_dir}",
                 f"crl audit sql {settings.run_dir} \"SELECT step, guided, avg(success::INT) FROM trajectories "
                 "WHERE split = 'train' GROUP BY ALL ORDER BY ALL\"",
                 f"crl report {settings.run_dir} runs/OTHER --out runs/compare",
                 *([f"tensorboard --logdir {settings.run_dir / 'tensorboard'}"]
                   if settings.tracker.enabled and "tensorboard" in settings.tracker.backends else [])):
        console.print(f"  {line}", markup=False, highlight=False, soft_wrap=True)
    if status != "completed":
        console.print(supervisor.resume_hint(), highlight=False, soft_wrap=True)
        raise typer.Exit(130 if status == "interrupted" or supervisor.interrupts else 1)
