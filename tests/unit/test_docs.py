"""The documentation, checked like code: the README stays a page a newcomer reads to the end, every relative link in
the README, CHANGELOG.md and docs/ resolves, every `crl` command and flag they show exists, and docs/configuration.md
is exactly what `crl config reference` prints.

Run: pytest tests/unit/test_docs.py
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import typer

from pipeline.cli import app
from pipeline.cli.config import settings_reference

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = [README, ROOT / "CHANGELOG.md", ROOT / "configs" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 150
CLI_TITLE = "crl: every command and option"

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)|!\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.M | re.S)
INLINE_CODE = re.compile(r"`([^`\n]+)`")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*$", re.M)


def _page_id(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`|\*\*|\*|_(?=\w)|(?<=\w)_", "", heading).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text())
    return {_slug(match) for match in HEADING.findall(text)}


def _links(path: Path) -> list[str]:
    text = FENCE.sub("", path.read_text())
    text = INLINE_CODE.sub("", text)
    return [a or b for a, b in LINK.findall(text)]


def test_the_readme_is_a_page_a_newcomer_reads_to_the_end():
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, \
        f"README.md has {len(lines)} lines (at most {README_MAX_LINES}): move reference material to docs/"
    too_wide = [n for n, line in enumerate(lines, 1) if len(line) > 120]
    assert too_wide == [], f"README.md lines over 120 columns: {too_wide}"


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_every_relative_link_resolves(page):
    assert page.exists(), f"{_page_id(page)} is missing"
    broken = []
    for target in _links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http(s), mailto: public sites only, checked below
            if not target.startswith(("https://", "http://", "mailto:")):
                broken.append(f"{target} (not a web link)")
            continue
        file_part, _, anchor = target.partition("#")
        resolved = (page.parent / file_part).resolve() if file_part else page
        if ROOT not in (resolved, *resolved.parents):
            broken.append(f"{target} (outside the repository)")
        elif not resolved.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
            broken.append(f"{target} (no heading #{anchor} in {resolved.name})")
    assert broken == [], f"{_page_id(page)}: broken links: {broken}"


def _command_tree() -> Any:
    return typer.main.get_command(app)


def _options(command: Any) -> dict[str, bool]:
    """Every option name of `command` and whether it takes a value."""
    names = {name: not (param.is_flag or param.count) for param in command.params  # type: ignore[attr-defined]
             if param.param_type_name == "option" for name in (*param.opts, *param.secondary_opts)}
    return {**names, "--help": False}


def _crl_invocations(text: str) -> list[str]:
    """Every `crl ...` command line shown: in code blocks (one per line, after any VAR=value prefix) and in inline
    code spans that start with `crl `."""
    found = []
    for block in FENCE.findall(text):
        for line in block.splitlines()[1:-1]:
            match = re.search(r"(?:^|[\s;&|(])crl\s+(.*)$", line)
            if match and not line.lstrip().startswith("#"):
                found.append(match.group(1))
    for span in INLINE_CODE.findall(FENCE.sub("", text)):
        match = re.match(r"^(?:[A-Z_][A-Z0-9_]*=\S*\s+)*crl\s+(.*)$", span)
        if match:
            found.append(match.group(1))
    return found


def _check_invocation(root: Any, line: str) -> str | None:
    """None if `crl <line>` names an existing command with existing options, else what is wrong. A line is cut at a
    comment, a pipe (in tables `a \\| b` shows alternatives) or a shell operator; `[--flag X]` counts as `--flag X`."""
    shown = re.split(r"\s+#|\\?\||&&|;|&|\)", line)[0]
    command, path = root, ["crl"]
    options = _options(root)
    tokens = [t.strip("[]") for t in shown.split()]
    tokens = [t for t in tokens if t]
    skip_value = False
    for token in tokens:
        if skip_value:
            skip_value = False
            continue
        if token in ("...", "…") or (hasattr(command, "commands") and re.fullmatch(r"[A-Z][A-Z0-9_]*|\{\w+\}", token)):
            return None  # the rest of the line is a placeholder
        if token.startswith("-"):
            name = token.split("=", 1)[0]
            if name not in options:
                return f"crl {shown.strip()}: {' '.join(path)} has no option {name}"
            skip_value = options[name] and "=" not in token
            continue
        if hasattr(command, "commands"):
            if token not in command.commands:
                return f"crl {shown.strip()}: {' '.join(path)} has no command {token!r}"
            command = command.commands[token]
            path.append(token)
            options |= _options(command)
    return None


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_every_crl_command_and_flag_shown_exists(page):
    root = _command_tree()
    problems = [problem for line in _crl_invocations(page.read_text())
                if (problem := _check_invocation(root, line)) is not None]
    assert problems == [], f"{_page_id(page)}: " + "; ".join(problems)


def test_the_invocation_check_can_fail():
    root = _command_tree()
    assert _check_invocation(root, "run configs/x.yaml --steps 3 --no-report") is None
    assert _check_invocation(root, "replay bank \\| train RUN_DIR") is None
    assert _check_invocation(root, "--config configs/x.yaml config show") is None
    assert _check_invocation(root, "stack up [--run-dir D] [--broker tansu\\|kafka]") is None
    assert "no option --stepz" in (_check_invocation(root, "run configs/x.yaml --stepz 3") or "")
    assert "no command 'bankz'" in (_check_invocation(root, "replay bankz runs/x") or "")
    assert _crl_invocations("```bash\nCRL_X=1 crl run a.yaml --steps 2  # comment\n```\n`crl doctor --embedded`") \
        == ["run a.yaml --steps 2  # comment", "doctor --embedded"]


def test_the_cli_page_is_what_typer_generates():
    """docs/cli.md is Typer's own Markdown of every command (`make docs` writes it)."""
    from typer.cli import MARKUP_MODE_KEY, get_docs_for_click

    command = typer.main.get_command(app)
    context = typer.Context(command, info_name="crl")
    context.ensure_object(dict)
    context.obj[MARKUP_MODE_KEY] = app.rich_markup_mode
    generated = get_docs_for_click(obj=command, ctx=context, name="crl", title=CLI_TITLE).strip() + "\n"
    assert (ROOT / "docs" / "cli.md").read_text() == generated, "docs/cli.md differs from the commands: `make docs`"


def test_the_configuration_page_is_the_settings_reference():
    page = ROOT / "docs" / "configuration.md"
    assert page.read_text() == settings_reference(), \
        "docs/configuration.md differs from the settings: `make docs`"
