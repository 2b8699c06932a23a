"""What `crl run` shows: on a terminal a live table (the run's figures, then one row per worker process), otherwise
one summary line every 10 s."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from rich.console import Group
from rich.table import Table

from pipeline.run.processes import WorkerProcess, last_metrics
from pipeline.run.progress import RunProgress


def _pair(step: int | None, guided: float | None, free: float | None) -> str:
    if step is None:
        return "-"

    def show(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    return f"step {step}: guided {show(guided)}, free {show(free)}"


def numbers(progress: RunProgress, lock: threading.Lock, steps: int) -> dict[str, str]:
    """The run's figures, one line each, as the live view and the summary line show them (a mixture adds each
    family's guided/free success at the newest train and eval steps)."""
    p = progress
    with lock:
        train_step, guided, free = p.latest(p.train)
        eval_step, eval_guided, eval_free = p.latest(p.evaluation)
        figures = {
            "step": f"{p.step_issued + 1}/{steps}",
            "train": _pair(train_step, guided, free),
            "eval": _pair(eval_step, eval_guided, eval_free),
            "bank": f"{p.bank_size} active",
            "ops": " ".join(f"{k} {v}" for k, v in sorted(p.ops.items())) or "-",
            "parse": " ".join(f"{k} {v}" for k, v in sorted(p.parse.items())) or "-",
            "versions": f"actor v{p.actor_version}, extractor v{p.extractor_version}",
            "actor loss": "-" if p.actor_loss is None else f"{p.actor_loss:.4f}",
            "extractor reward": "-" if p.extractor_reward is None else f"{p.extractor_reward:+.3f}",
        }
        # A mixture: each family's success at the newest train and eval steps, after the run's own lines.
        for name, table in (("train", p.train), ("eval", p.evaluation)):
            families = p.families(table)
            if len(families) > 1:
                figures[f"{name} by family"] = " | ".join(
                    f"{family} {_rate(g)}/{_rate(f)}" for family, (g, f) in families.items())
        return figures


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def summary_line(figures: dict[str, str], started: float) -> str:
    elapsed = time.monotonic() - started
    return f"[{elapsed:5.0f}s] " + " | ".join(f"{k} {v}" for k, v in figures.items())


def live_view(figures: dict[str, str], *, run_id: str, arm: str, run_dir: Path, started: float,
              workers: list[WorkerProcess]) -> Group:
    elapsed = time.monotonic() - started
    run = Table.grid(padding=(0, 2))
    run.add_column(style="bold")
    run.add_column()
    run.add_row("run", f"{run_id}  arm {arm}  {elapsed:.0f}s  ({run_dir})")
    for key, value in figures.items():
        run.add_row(key, value)
    table = Table("worker", "pid", "state", "restarts", "in", "out", "lag", title=None)
    for worker in workers:
        metrics = last_metrics(run_dir, worker.instance, 1)
        last = metrics[-1] if metrics else {}
        code = worker.process.poll() if worker.process is not None else None
        state = "running" if code is None else f"exited {code}"
        table.add_row(worker.instance, str(worker.process.pid if worker.process else "-"), state,
                      str(worker.restarts), str(last.get("events_in", "-")), str(last.get("events_out", "-")),
                      str(sum(last.get("lag", {}).values())) if last else "-")
    return Group(run, table)
