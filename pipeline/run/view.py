"""What `crl run` shows: on a terminal a live table (a header with the elapsed time and the ETA, the run's figures,
then one row per worker process), otherwise one summary line every 10 s with the same figures. `numbers` makes the
figures for both.

Every figure comes from the log (`RunProgress`): the warm starts' progress (`WarmStartProgressed`), the episodes of a
step assigned and finished, success, the bank. The ETA is measured, never guessed: during the warm starts from their
own step rate, then from the mean time between the newest train steps' last episodes times the steps left; until
there is something to measure it is `-`."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from pathlib import Path

from rich.console import Group
from rich.table import Table
from rich.text import Text

from pipeline.run.processes import WorkerProcess, last_metrics
from pipeline.run.progress import RunProgress
from schemas.base import Split

ETA = "ETA"
"""The figure the live view shows in its header rather than as a row."""


def _pair(progress: RunProgress, split: Split) -> str:
    """The newest step with finished episodes of `split`: how many of its episodes have finished, and the success
    of its guided and free ones."""
    step, guided, free = progress.latest(progress.train if split == "train" else progress.evaluation)
    if step is None:
        return "-"
    played, assigned = progress.episodes(step, split)
    return f"step {step}: {played}/{assigned} done, guided {_rate(guided)}, free {_rate(free)}"


def duration(seconds: float) -> str:
    """`42s`, `3m05s`, `1h02m`."""
    whole = round(seconds)
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    return f"{whole // 3600}h{whole % 3600 // 60:02d}m"


def _warm_start(progress: RunProgress, warming: Sequence[str] = ()) -> str:
    """Each trainer's warm start: `actor train 120/250 loss 1.234 | extractor data 40/64`; a trainer expected to
    warm-start that has published nothing yet is `starting` (its process imports torch and builds the model)."""
    parts = [f"{role} starting" for role in warming if role not in progress.warm]
    for role, event in sorted(progress.warm.items()):
        text = f"{role} {event.phase} {event.done}/{event.total}"
        if event.loss is not None:
            text += f" loss {event.loss:.3f}"
        if event.phase == "done":
            text += " (cached)" if event.cached else f" in {duration(event.elapsed_s)}"
        parts.append(text)
    return " | ".join(parts)


def _gates(progress: RunProgress) -> str | None:
    """The warm starts' gates, once checked: `actor passed | extractor MISSED: states_revealed 0.40 >= 0.90 (58)
    MISSED`; None while no warm start with a gate is done."""
    from pipeline.rl.warm_gate import describe, gate_passed

    parts = []
    for role, event in sorted(progress.warm.items()):
        if event.phase == "done" and event.gate is not None:
            parts.append(f"{role} passed" if gate_passed(event.gate) else
                         f"{role} MISSED: " + ", ".join(describe(check) for check in event.gate if not check.passed))
    return " | ".join(parts) or None


def _eta(progress: RunProgress, steps: int) -> str:
    """Time left: of the warm starts while one runs, else of the train steps not yet finished; `-` until measured."""
    if progress.finished is not None:
        return "done"
    if any(event.phase != "done" for event in progress.warm.values()):
        left = progress.warm_start_seconds_left()
        return "-" if left is None else f"{duration(left)} (warm start)"
    per_step = progress.step_seconds()
    remaining = max(0, steps - len(progress.step_finished))
    if per_step is None or remaining == 0:
        return "-"
    return f"{duration(per_step * remaining)} ({remaining} steps x {duration(per_step)})"


def numbers(progress: RunProgress, lock: threading.Lock, steps: int,
            warming: Sequence[str] = ()) -> dict[str, str]:
    """The run's figures, one line each, as the live view and the summary line show them (a mixture adds each
    family's guided/free success at the newest train and eval steps)."""
    p = progress
    with lock:
        figures = {ETA: _eta(p, steps)}
        if p.warm or (warming and p.step_issued < 0):
            figures["warm start"] = _warm_start(p, warming if p.step_issued < 0 else ())
        if (gates := _gates(p)) is not None:
            figures["warm-start gate"] = gates
        figures |= {
            "step": f"{p.step_issued + 1}/{steps}",
            "train": _pair(p, "train"),
            "eval": _pair(p, "eval"),
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
    """One line of figures: `[  125s] ETA 4m10s (10 steps x 25s) | step 3/12 | train step 2: 16/16 done, ...`."""
    elapsed = time.monotonic() - started
    return f"[{elapsed:5.0f}s] " + " | ".join(f"{k} {v}" for k, v in figures.items())


def live_view(figures: dict[str, str], *, run_id: str, arm: str, run_dir: Path, started: float,
              workers: list[WorkerProcess]) -> Group:
    elapsed = time.monotonic() - started
    run = Table.grid(padding=(0, 2))
    run.add_column(style="bold")
    run.add_column()
    run.add_row("run", f"{run_id}  arm {arm}  elapsed {duration(elapsed)}  ETA {figures.get(ETA, '-')}  ({run_dir})")
    for key, value in figures.items():
        if key != ETA:
            run.add_row(key, Text(value, style="bold red") if "MISSED" in value else Text(value))
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
