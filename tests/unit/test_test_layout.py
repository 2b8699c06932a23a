"""The test tree itself: pytest imports test files by basename (rootdir-relative `prepend` mode, no packages).

Two test files with one basename in different folders collect fine alone and break the whole run together
("import file mismatch"), which is how a clean-clone CI once failed after 154 s. This check finds it in a second.

Run: pytest tests/unit/test_test_layout.py
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_every_test_module_has_a_basename_of_its_own():
    by_name: dict[str, list[str]] = defaultdict(list)
    for path in TESTS.rglob("*.py"):
        if "__pycache__" not in path.parts and path.name != "conftest.py":
            by_name[path.name].append(str(path.relative_to(TESTS)))
    clashes = {name: sorted(paths) for name, paths in by_name.items() if len(paths) > 1}
    assert clashes == {}, f"rename one of each: {clashes}"
