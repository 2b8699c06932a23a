"""Imports flow `schemas <- infra <- pipeline <- workers`, and `schemas` does no I/O (docs/architecture.md).

Static check: every .py file of the four packages is parsed with `ast`; every `import x`, `from x import y`
(relative ones resolved), `importlib.import_module("x")` and `__import__("x")` counts, wherever it stands: module
level, inside functions, under `if TYPE_CHECKING:`. Violations are reported as `file:line imports X`.

Run: pytest tests/unit/test_import_flow.py
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("schemas", "infra", "pipeline", "workers")

FORBIDDEN_IMPORTS: dict[str, frozenset[str]] = {
    "schemas": frozenset({"pipeline", "workers", "infra"}),
    "infra": frozenset({"pipeline", "workers"}),
    "pipeline": frozenset({"workers"}),
}

IO_MODULES = frozenset({
    "os", "io", "socket", "subprocess", "pathlib", "kafka", "sqlalchemy", "duckdb", "requests", "urllib",
    # Same intent, other spellings.
    "shutil", "tempfile", "sqlite3", "http", "httpx", "aiokafka", "confluent_kafka", "psycopg", "psycopg2",
})
FILE_CALLS = frozenset({"open", "read_text", "write_text", "read_bytes", "write_bytes"})


@dataclass(frozen=True)
class ImportSite:
    file: str
    line: int
    package: str
    """Top-level package name, e.g. `pipeline` for `from pipeline.runtime.runner import Runner`."""

    def __str__(self) -> str:
        return f"{self.file}:{self.line} imports {self.package}"


def _package_of(file: str) -> list[str]:
    """`schemas/codec.py` -> ["schemas"]; `infra/migrations/env.py` -> ["infra", "migrations"]."""
    return Path(file).with_suffix("").parts[:-1]


def imports_in(source: str, file: str) -> list[ImportSite]:
    """Every import in `source` (the text of `file`, a path relative to the repository root)."""
    sites: list[ImportSite] = []
    package = list(_package_of(file))
    for node in ast.walk(ast.parse(source, filename=file)):
        if isinstance(node, ast.Import):
            sites += [ImportSite(file, node.lineno, alias.name.split(".")[0]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                sites.append(ImportSite(file, node.lineno, (node.module or "").split(".")[0]))
                continue
            base = package[: len(package) - (node.level - 1)]
            parts = base + (node.module.split(".") if node.module else [])
            if parts:
                sites.append(ImportSite(file, node.lineno, parts[0]))
            else:  # `from .. import x` at the top of the tree: each name is a top-level package
                sites += [ImportSite(file, node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
            target = node.args[0].value
            if name in {"import_module", "__import__"} and isinstance(target, str) and not target.startswith("."):
                sites.append(ImportSite(file, node.lineno, target.split(".")[0]))
    return sites


def file_calls_in(source: str, file: str) -> list[str]:
    """`file:line calls open(` for every call of open / Path.read_text / ... in `source`."""
    found = []
    for node in ast.walk(ast.parse(source, filename=file)):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
            if name in FILE_CALLS:
                found.append((node.lineno, name))
    return [f"{file}:{line} calls {name}(" for line, name in sorted(found)]


def violations(sites: list[ImportSite], forbidden: frozenset[str]) -> list[str]:
    ordered = sorted(sites, key=lambda site: (site.file, site.line, site.package))
    return [str(site) for site in ordered if site.package in forbidden]


def sources_of(package: str) -> dict[str, str]:
    """{relative path: source} for every .py file under `package`."""
    return {
        path.relative_to(REPO_ROOT).as_posix(): path.read_text(encoding="utf-8")
        for path in sorted((REPO_ROOT / package).rglob("*.py"))
    }


def imports_of(package: str) -> list[ImportSite]:
    return [site for file, source in sources_of(package).items() for site in imports_in(source, file)]


# --- the checker itself ------------------------------------------------------------------------------------------


def test_checker_reports_a_forbidden_import_with_file_and_line() -> None:
    source = "import numpy\nfrom pipeline.runtime.runner import Runner\n"
    sites = imports_in(source, "schemas/fake.py")
    assert violations(sites, FORBIDDEN_IMPORTS["schemas"]) == ["schemas/fake.py:2 imports pipeline"]


def test_checker_sees_imports_in_functions_type_checking_relative_and_dynamic() -> None:
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    import workers.archiver\n"
        "def f():\n"
        "    from infra import db\n"
        "from ..pipeline import errors\n"
        "from .. import workers\n"
        "from . import base\n"
        "import importlib\n"
        "importlib.import_module('infra.kafka')\n"
        "__import__('pipeline')\n"
    )
    sites = imports_in(source, "schemas/fake.py")
    assert violations(sites, FORBIDDEN_IMPORTS["schemas"]) == [
        "schemas/fake.py:3 imports workers",
        "schemas/fake.py:5 imports infra",
        "schemas/fake.py:6 imports pipeline",
        "schemas/fake.py:7 imports workers",
        "schemas/fake.py:10 imports infra",
        "schemas/fake.py:11 imports pipeline",
    ]
    assert ImportSite("schemas/fake.py", 8, "schemas") in sites


def test_checker_reports_file_calls() -> None:
    source = "import json\ndef load(p):\n    with open(p) as f:\n        return json.load(f)\nx = P.read_text()\n"
    assert file_calls_in(source, "schemas/fake.py") == ["schemas/fake.py:3 calls open(",
                                                        "schemas/fake.py:5 calls read_text("]


def test_checker_reports_io_modules() -> None:
    source = "import os.path\nfrom urllib.request import urlopen\nimport json\n"
    assert violations(imports_in(source, "schemas/fake.py"), IO_MODULES) == [
        "schemas/fake.py:1 imports os",
        "schemas/fake.py:2 imports urllib",
    ]


# --- the repository ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("package", PACKAGES)
def test_every_package_has_parsed_files(package: str) -> None:
    files = sources_of(package)
    assert files, f"no .py files under {package}/"
    assert f"{package}/__init__.py" in files


@pytest.mark.parametrize("package", sorted(FORBIDDEN_IMPORTS))
def test_imports_flow_one_way(package: str) -> None:
    assert imports_of(package), f"found no imports in {package}/ at all"
    assert violations(imports_of(package), FORBIDDEN_IMPORTS[package]) == []


def test_schemas_imports_no_io_modules() -> None:
    assert violations(imports_of("schemas"), IO_MODULES) == []


def test_schemas_opens_no_files() -> None:
    found = [call for file, source in sources_of("schemas").items() for call in file_calls_in(source, file)]
    assert found == []


# --- inside pipeline/: layers, and no import circles anywhere ------------------------------------------------------

PIPELINE_LAYERS: tuple[frozenset[str], ...] = (
    frozenset({"errors"}),
    frozenset({"runtime"}),
    frozenset({"envs", "models"}),
    frozenset({"bank"}),
    frozenset({"actor", "extractor"}),
    frozenset({"rl"}),
    frozenset({"tracking"}),
    frozenset({"settings_errors"}),
    frozenset({"settings"}),
    frozenset({"audit", "provenance"}),
    frozenset({"run"}),
    frozenset({"cli"}),
)
"""Lowest first. A module of `pipeline/` may import its own package and the packages of lower layers, never a higher
layer or another package of its own layer: runtime <- domain (envs, models <- bank <- actor, extractor <- rl) <-
tracking <- settings_errors <- settings (the sections of every package, composed) <- audit, provenance <- run <- cli
(docs/architecture.md). `pipeline/X.py` at the top of the tree counts as package X."""


def module_name(file: str) -> str:
    """`pipeline/bank/state.py` -> `pipeline.bank.state`; `pipeline/bank/__init__.py` -> `pipeline.bank`."""
    parts = list(Path(file).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_imports(source: str, file: str, known: set[str]) -> set[str]:
    """The modules of `known` that `source` imports, by their full dotted names (`from a.b import c` counts `a.b.c`
    when that is a module, else `a.b`)."""
    found: set[str] = set()
    package = module_name(file).split(".")
    if not file.endswith("__init__.py"):
        package = package[:-1]
    for node in ast.walk(ast.parse(source, filename=file)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                prefix = package[: len(package) - (node.level - 1)]
                base = ".".join(prefix + ([node.module] if node.module else []))
            names = [f"{base}.{alias.name}" for alias in node.names] + [base]
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    return found


def pipeline_graph() -> dict[str, set[str]]:
    sources = {file: source for package in PACKAGES for file, source in sources_of(package).items()}
    known = {module_name(file) for file in sources}
    graph = {}
    for file, source in sources.items():
        module = module_name(file)
        graph[module] = {name for name in module_imports(source, file, known) if name != module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component with more than one module (Tarjan), each as a sorted list."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def layer_of(module: str) -> int | None:
    """The layer of a `pipeline.X...` module (its package X, or the root module X.py)."""
    parts = module.split(".")
    if parts[0] != "pipeline" or len(parts) < 2:
        return None
    for rank, members in enumerate(PIPELINE_LAYERS):
        if parts[1] in members:
            return rank
    raise AssertionError(f"{module}: pipeline/{parts[1]} is in no layer of PIPELINE_LAYERS")


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    found = []
    for module, targets in sorted(graph.items()):
        rank = layer_of(module)
        if rank is None:
            continue
        for target in sorted(targets):
            target_rank = layer_of(target)
            if target_rank is None or target.split(".")[1] == module.split(".")[1]:
                continue
            if target_rank >= rank:
                found.append(f"{module} imports {target} (layer {target_rank} >= {rank})")
    return found


def test_the_cycle_finder_finds_circles_of_any_length() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e2"}, "e2": {"e"}}
    assert cycles(graph) == [["a", "b", "c"], ["e", "e2"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_layer_check_names_an_upward_import() -> None:
    graph = {"pipeline.runtime.runner": {"pipeline.bank.state", "pipeline.errors"}, "pipeline.bank.state": set()}
    assert layer_violations(graph) == ["pipeline.runtime.runner imports pipeline.bank.state (layer 3 >= 1)"]


def test_no_import_circles_anywhere() -> None:
    assert cycles(pipeline_graph()) == []


def test_pipeline_packages_import_only_lower_layers() -> None:
    assert layer_violations(pipeline_graph()) == []


def test_nothing_imports_workers() -> None:
    graph = pipeline_graph()
    importers = sorted(module for module, targets in graph.items()
                       if not module.startswith("workers") and any(t.startswith("workers") for t in targets))
    assert importers == []


# --- Kafka is read in one place ------------------------------------------------------------------------------------

KAFKA_READERS = ("infra/", "pipeline/runtime/")
"""Where Kafka consumers are made and polled: the client wiring (`infra`) and the runtime (the runner's inputs,
`pipeline.runtime.log`'s followers and read-to-end). Everything else reads through them."""
CONSUMER_CALLS = frozenset({"make_consumer", "KafkaConsumer", "poll"})


def consumer_calls_in(source: str, file: str) -> list[str]:
    """`file:line calls poll(` for every consumer construction or poll in `source` (a child process's `poll()` is
    not Kafka's: calls on a name or attribute containing `process` are skipped)."""
    found = []
    for node in ast.walk(ast.parse(source, filename=file)):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
        if name not in CONSUMER_CALLS:
            continue
        if name == "poll" and isinstance(func, ast.Attribute) and "process" in ast.unparse(func.value).lower():
            continue
        found.append((node.lineno, name))
    return [f"{file}:{line} calls {name}(" for line, name in sorted(found)]


def test_the_consumer_check_finds_a_poll_and_skips_a_process() -> None:
    source = "def handle(self):\n    records = self.consumer.poll(timeout_ms=10)\n    code = worker.process.poll()\n"
    assert consumer_calls_in(source, "workers/x.py") == ["workers/x.py:2 calls poll("]
    assert consumer_calls_in("c = make_consumer(kafka)\n", "pipeline/bank/x.py") == [
        "pipeline/bank/x.py:1 calls make_consumer("]


def test_only_the_runtime_and_infra_make_or_poll_kafka_consumers() -> None:
    found = [call for package in ("pipeline", "workers") for file, source in sources_of(package).items()
             if not file.startswith(KAFKA_READERS) for call in consumer_calls_in(source, file)]
    assert found == []
