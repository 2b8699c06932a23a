"""What the e2e tests that drive a live `crl run` share (`from run_helpers import ...`; pytest puts this folder on
the path)."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest


def wait_for_log(run_dir: Path, instance: str, text: str, process: subprocess.Popen[str], timeout: float) -> None:
    """Wait until worker `instance` of the run logs `text`; fail if `crl run` exits first or `timeout` passes."""
    deadline = time.monotonic() + timeout
    log = run_dir / "logs" / f"{instance}.log"
    while time.monotonic() < deadline:
        if log.exists() and text in log.read_text():
            return
        if process.poll() is not None:
            pytest.fail(f"crl run exited {process.returncode} early:\n{process.stdout.read()[-3000:]}")  # type: ignore[union-attr]
        time.sleep(0.5)
    process.kill()
    pytest.fail(f"{instance} never logged {text!r} in {timeout}s")
