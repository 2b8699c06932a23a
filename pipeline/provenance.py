"""What a run records about itself in `RunStarted`: the resolved settings (secrets masked) and the code version."""

from __future__ import annotations

import subprocess
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from sqlalchemy import make_url

from pipeline.settings import Settings

REPO_ROOT = Path(__file__).resolve().parent.parent


def code_version() -> str:
    """`git describe`-like: the commit (plus '-dirty' with uncommitted changes), else the installed package version."""
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True,
                                timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO_ROOT,
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
        return commit + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        try:
            return f"complementary-rl {version('complementary-rl')}"
        except PackageNotFoundError:
            return "unknown"


def resolved_config(settings: Settings) -> dict[str, Any]:
    """Every setting as plain JSON, with passwords masked (SecretStr fields and the database URL's password)."""
    config = settings.model_dump(mode="json")
    if config["db"].get("url"):
        config["db"]["url"] = make_url(config["db"]["url"]).render_as_string(hide_password=True)
    return config
