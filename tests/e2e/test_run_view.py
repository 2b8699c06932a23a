"""`crl run`'s live view in a real terminal: the run is started under a pseudo-terminal, its output fed to a VT100
emulator (pyte), and the screen read as a person would see it. A short, uncached warm start shows its phase and
`k/n` within seconds; then a train step shows how many of its episodes have finished and the header an ETA; the run
completes, and the warm starts' progress is in its archive.

Run: pytest tests/e2e/test_run_view.py
"""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pyte
import pytest

from pipeline.audit.views import Audit
from pipeline.tracking.readback import tensorboard_entries

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
COLUMNS, LINES = 200, 60
WARM_START = re.compile(r"^warm start +.*\b(actor|extractor) (data|train) \d+/\d+", re.M)
TRAIN_STEP = re.compile(r"^train +step \d+: \d+/\d+ done", re.M)
MEASURED_ETA = re.compile(r"^run +.* ETA \d+(h|m|s)", re.M)
STEP_ETA = re.compile(r"^run +.* ETA \S+ \(\d+ steps x \d+(h|m|s)", re.M)


def _screens(command: list[str], env: dict[str, str], timeout_s: float) -> tuple[int, list[tuple[float, str]]]:
    """Run `command` on a pseudo-terminal of COLUMNS x LINES; returns its exit code and every screen it showed, each
    with the seconds since the start."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", LINES, COLUMNS, 0, 0))
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdin=slave, stdout=slave, stderr=slave,
                               start_new_session=True)
    os.close(slave)
    screen = pyte.Screen(COLUMNS, LINES)
    stream = pyte.ByteStream(screen)
    started = time.monotonic()
    shown: list[tuple[float, str]] = []
    try:
        while time.monotonic() - started < timeout_s:
            ready, _, _ = select.select([master], [], [], 0.5)
            if ready:
                try:
                    data = os.read(master, 65536)
                except OSError:  # EIO: every process on the terminal has closed it
                    break
                if not data:
                    break
                stream.feed(data)
                text = "\n".join(line.rstrip() for line in screen.display)
                if not shown or shown[-1][1] != text:
                    shown.append((time.monotonic() - started, text))
            elif process.poll() is not None:
                break
        else:
            process.terminate()
        return process.wait(timeout=120), shown
    finally:
        os.close(master)
        if process.poll() is None:
            process.kill()
            process.wait()


def test_the_live_view_shows_the_warm_starts_then_the_steps_and_an_eta(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("CRL_")}
    env.update({
        "HF_HUB_OFFLINE": "1", "TERM": "xterm-256color", "COLUMNS": str(COLUMNS), "LINES": str(LINES),
        # the code under test, also in the worker processes `crl run` starts
        "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
        # short warm starts, computed (a fresh cache), so their progress is shown for a few seconds
        "CRL_ACTOR_TRAINER__WARM_START__STEPS": "40", "CRL_ACTOR_TRAINER__WARM_START__EPISODES": "32",
        "CRL_ACTOR_TRAINER__WARM_START__CACHE_DIR": str(tmp_path / "warm-start"),
        "CRL_EXTRACTOR_TRAINER__WARM_START__STEPS": "40", "CRL_EXTRACTOR_TRAINER__WARM_START__EPISODES": "16",
        "CRL_EXTRACTOR_TRAINER__WARM_START__CACHE_DIR": str(tmp_path / "warm-start"),
        # five steps of two groups of 8 (step 0 fills the bank), 4 unseen rooms evaluated at steps 0 and 4: with
        # three, a fast machine finished the last two steps between two screens and the pace line never showed
        "CRL_ACTOR_TRAINER__GROUPS_PER_STEP": "2", "CRL_ENVS__EVAL_TASKS_PER_ENV": "2",
    })
    command = [sys.executable, "-m", "pipeline.cli", "run", "configs/tiny-minihack-room.yaml", "--steps", "5",
               "--run-dir", str(tmp_path / "run")]
    code, shown = _screens(command, env, timeout_s=780)
    last = shown[-1][1] if shown else ""
    assert code == 0, f"crl run exited {code}; last screen:\n{last}"

    def first(pattern: re.Pattern[str]) -> tuple[float, str]:
        found = next(((t, s) for t, s in shown if pattern.search(s)), None)
        assert found is not None, f"never shown: {pattern.pattern}; last screen:\n{last}"
        return found

    warm_at, warm_screen = first(WARM_START)
    step_at, _ = first(TRAIN_STEP)
    first(MEASURED_ETA)
    _, eta_screen = first(STEP_ETA)
    assert warm_at < 90, f"the warm start showed only after {warm_at:.0f}s:\n{warm_screen}"
    assert "run " in warm_screen and "ETA" in warm_screen, "the header is there from the start"
    assert warm_at < step_at, "the warm starts come before the first step's episodes"
    assert TRAIN_STEP.search(eta_screen), "the pace is measured from finished steps"
    assert any(" ETA done " in s for _, s in shown[-5:]) or "completed" in last, last
    with Audit(tmp_path / "run") as audit:
        done = audit.query("SELECT role, total, cached FROM warm_start_progressed WHERE phase = 'done' ORDER BY role")
        assert done[1] == [("actor", 40, False), ("extractor", 40, False)], "both computed (a fresh cache), on the log"
        assert audit.query("SELECT count(*) FROM dead_letter")[1] == [(0,)], "every reader of the topic took the kind"
        assert audit.query("SELECT count(*) FROM train_steps WHERE role = 'actor'")[1] == [(4,)]  # steps 1 to 4
    # the tracker charted both warm starts' losses from the same events, ending at their last step
    tracked = tensorboard_entries(tmp_path / "run" / "tensorboard")
    for role in ("actor", "extractor"):
        prefix = f"scalar\twarm_start/{role}/loss\t"
        steps = sorted(int(key.removeprefix(prefix)) for key in tracked if key.startswith(prefix))
        assert len(steps) >= 2 and steps[-1] == 40, (role, steps)
