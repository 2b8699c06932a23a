"""`report.html` as a reader sees it: headless Chromium opens the page of a two-arm report from its file, runs the
page's own load check (each figure's `data-loaded`, the table of arms' `data-rows`) and takes a screenshot.

Chromium is Debian's `chromium` (`.ci/run` installs it); without it these tests skip, and fail on CI (`CI=true`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections import Counter
from html.parser import HTMLParser
from pathlib import Path

import pytest
from PIL import Image
from test_report import archived, complementary_run, episode, grpo_run

from pipeline.audit.report import Report, write_report

WINDOW = (1280, 1600)
"""The screenshot's size in CSS pixels (Chromium's headless device scale is 1)."""


@pytest.fixture(scope="module")
def chromium() -> str:
    """The Chromium binary: skipped where there is none (a failure on CI)."""
    found = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if found is None:
        reason = "no Chromium here (`chromium`, `chromium-browser` or `google-chrome`) to open report.html in"
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        pytest.skip(reason)
    return found


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> Report:
    """The report of a complementary run and a grpo run, each with an evaluation (guided and free)."""
    root = tmp_path_factory.mktemp("browser")
    grpo = [*grpo_run(), episode("grpo-1", 0, "eval", 0, True, 3, guided=True),
            episode("grpo-1", 0, "eval", 1, False, 9)]
    runs = [archived(root / "comp", complementary_run()), archived(root / "grpo", grpo)]
    return write_report(runs, root / "report")


def browse(chromium: str, page: Path, *arguments: str) -> str:
    """Run headless Chromium on `page` (its own profile next to it) until the page's load handlers ran; stdout."""
    result = subprocess.run(
        [chromium, "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
         f"--user-data-dir={page.parent / '.chromium-profile'}", "--virtual-time-budget=5000", *arguments,
         page.as_uri()],
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


class PageState(HTMLParser):
    """What the DOM after the load check says: each image's `data-loaded`, and the table of arms."""

    def __init__(self, dom: str) -> None:
        super().__init__()
        self.checked = False
        self.widest = self.page_width = 0
        """How far right the widest table reaches, and how wide the page scrolls (CSS pixels)."""
        self.images: dict[str, str | None] = {}
        """src -> data-loaded ("true", "false"; None: the check did not run)."""
        self.arm_rows: str | None = None
        """The table of arms' `data-rows`."""
        self.arm_cells: list[list[str]] = []
        """Its body rows, as cell texts."""
        self._in_arm_table = self._in_body = self._in_cell = False
        self.feed(dom)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        attributes = dict(attrs)
        if tag == "body":
            self.checked = attributes.get("data-checked") == "true"
            self.widest = int(attributes.get("data-widest") or 0)
            self.page_width = int(attributes.get("data-page-width") or 0)
        elif tag == "img":
            self.images[attributes.get("src") or ""] = attributes.get("data-loaded")
        elif tag == "table" and attributes.get("id") == "arm-table":
            self._in_arm_table, self.arm_rows = True, attributes.get("data-rows")
        elif self._in_arm_table and tag == "tbody":
            self._in_body = True
        elif self._in_body and tag == "tr":
            self.arm_cells.append([])
        elif self._in_body and tag == "td":
            self._in_cell = True
            self.arm_cells[-1].append("")

    def handle_endtag(self, tag: str) -> None:
        if tag == "table":
            self._in_arm_table = self._in_body = False
        elif tag == "td":
            self._in_cell = False

    def handle_data(self, data: str) -> None:
        if self._in_cell:
            self.arm_cells[-1][-1] += data


def problems(state: PageState, report: Report) -> list[str]:
    """What the page does not show as it should: every figure loaded (with a width), and in the table of arms one
    row per arm, eval pool and slot kind of the report, for every arm of its runs."""
    found = []
    if not state.checked:
        found.append("the page's load check did not run")
    for figure in report.figures:
        if state.images.get(figure.name) != "true":
            found.append(f"{figure.name} did not load (data-loaded={state.images.get(figure.name)})")
    rows = [(cells[0], cells[2], cells[3]) for cells in state.arm_cells]
    if state.arm_rows != str(len(report.arms)) or rows != [(row.arm, row.pool, row.kind) for row in report.arms]:
        found.append(f"the table of arms shows {state.arm_rows} rows {rows}, not one per arm, pool and slot kind")
    if {arm for arm, _, _ in rows} != {run.arm for run in report.runs} or max(Counter(rows).values()) != 1:
        found.append(f"the table of arms has not exactly one row per arm, pool and slot kind: {rows}")
    return found


def test_a_browser_shows_every_figure_and_one_row_per_arm_and_slot_kind(chromium, report):
    assert {run.arm for run in report.runs} == {"complementary", "grpo"}
    state = PageState(browse(chromium, report.html, "--dump-dom"))
    assert problems(state, report) == []
    assert sorted(state.images) == sorted(figure.name for figure in report.figures)
    assert [(cells[0], cells[3]) for cells in state.arm_cells] == [
        ("complementary", "guided"), ("complementary", "free"), ("grpo", "guided"), ("grpo", "free")]

    screenshot = report.html.parent / "screenshot.png"
    browse(chromium, report.html, f"--screenshot={screenshot}", f"--window-size={WINDOW[0]},{WINDOW[1]}")
    with Image.open(screenshot) as image:
        assert image.format == "PNG" and image.size == WINDOW
        pixels = image.convert("RGB")
        colours = pixels.getcolors(maxcolors=WINDOW[0] * WINDOW[1]) or []
    # A blank page is one colour; this one has text, table borders and the first figures' lines.
    assert len(colours) > 50
    white = max((count for count, colour in colours if colour == (255, 255, 255)), default=0)
    assert white < 0.98 * WINDOW[0] * WINDOW[1]


def test_every_table_fits_a_1280_pixel_window(chromium, tmp_path_factory):
    """Long run ids and run directories without a break opportunity (what a sweep names its runs) wrap inside their
    cells: no table, and so no page, is wider than the window."""
    root = tmp_path_factory.mktemp("wide")
    long_id = "paper_3task_complementary_seed_0017_lr_1e_5_groups_8_staleness_1_20261127_101112"
    directory = root / ("a_run_directory_with_a_name_as_long_as_a_sweep_gives_it_" * 3).strip("_")
    run = archived(directory, complementary_run(long_id))
    wide = write_report([run], root / "report")
    state = PageState(browse(chromium, wide.html, "--dump-dom", f"--window-size={WINDOW[0]},{WINDOW[1]}"))
    assert state.checked
    assert 0 < state.widest <= WINDOW[0], state.widest
    assert state.page_width <= WINDOW[0], state.page_width


def test_the_browser_check_fails_when_a_figure_is_missing(chromium, report, tmp_path):
    copy = tmp_path / "report"
    shutil.copytree(report.html.parent, copy, ignore=shutil.ignore_patterns(".chromium-profile", "screenshot.png"))
    (copy / "bank.png").unlink()
    state = PageState(browse(chromium, copy / "report.html", "--dump-dom"))
    assert state.images["bank.png"] == "false"
    assert problems(state, report) == ["bank.png did not load (data-loaded=false)"]
