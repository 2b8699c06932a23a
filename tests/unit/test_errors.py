"""One error taxonomy: every exception `infra/`, `pipeline/` and `workers/` raise on purpose descends from
`PipelineError` (pydantic validators excepted: pydantic wants `ValueError` there and turns it into a field-by-field
`ValidationError`, which the CLI reports as exit 2; and a module's `__getattr__`, whose AttributeError is the
protocol). `schemas/` keeps its own `EventDecodeError` family.

Static check: every `raise Name(...)` is resolved in its module's namespace and must be a `PipelineError` subclass.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

from pipeline.errors import (
    AuditQueryError,
    CheckpointError,
    ConfigError,
    EnvUnavailableError,
    HashMismatchError,
    InvalidArgumentError,
    InvalidStateError,
    ParseError,
    PipelineError,
    RunFailedError,
    SnapshotError,
    UnknownItemError,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
VALIDATORS = {"field_validator", "model_validator", "validator", "root_validator"}
ALLOWED = {"Exit"}  # typer.Exit: the CLI's exit code, not an error
# Stands in for a kafka-python method, so it raises what that method raises and its callers already handle.
LIBRARY_STAND_INS = {"infra.kafka_io_loop"}


def _raised_names(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, exception class name) of every `raise Name(...)` / `raise mod.Name(...)` outside pydantic validators."""
    found = []

    def visit(node: ast.AST, in_validator: bool) -> None:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            decorators = {d.func.id if isinstance(d, ast.Call) and isinstance(d.func, ast.Name) else
                          d.id if isinstance(d, ast.Name) else "" for d in node.decorator_list}
            # a module's __getattr__ (PEP 562) must raise AttributeError for a name it does not have
            in_validator = in_validator or bool(decorators & VALIDATORS) or node.name == "__getattr__"
        if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and not in_validator:
            func = node.exc.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
            if name:
                found.append((node.lineno, name))
        for child in ast.iter_child_nodes(node):
            visit(child, in_validator)

    visit(tree, False)
    return found


def _raised_class(module: object, target: object) -> object:
    """The class `raise target(...)` raises: `target` itself, or what a factory function returns (`fail(...)` returns
    `typer.Exit`, `_missing(...)` an `EnvUnavailableError`), read from its return annotation."""
    if isinstance(target, type) or not callable(target):
        return target
    annotation = getattr(target, "__annotations__", {}).get("return")
    if isinstance(annotation, str):
        namespace = vars(module)
        head, _, attribute = annotation.partition(".")
        annotation = getattr(namespace.get(head), attribute) if attribute else namespace.get(head)
    return annotation


def _modules() -> list[tuple[str, Path]]:
    modules = []
    for package in ("infra", "pipeline", "workers"):
        for path in sorted((REPO_ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(REPO_ROOT).with_suffix("").parts)
            if "migrations" in parts or parts[-1] == "__main__":
                continue
            modules.append((".".join(parts[:-1] if parts[-1] == "__init__" else parts), path))
    return modules


def test_every_raise_is_a_pipeline_error() -> None:
    offenders = []
    for module_name, path in _modules():
        raised = _raised_names(ast.parse(path.read_text()))
        if not raised:
            continue
        if module_name in LIBRARY_STAND_INS:
            continue
        module = importlib.import_module(module_name)
        for line, name in raised:
            if name in ALLOWED:
                continue
            cls = _raised_class(module, getattr(module, name, None))
            if not (isinstance(cls, type) and (issubclass(cls, PipelineError) or cls.__name__ in ALLOWED)):
                offenders.append(f"{path.relative_to(REPO_ROOT)}:{line} raises {name}")
    assert offenders == []


def test_the_checker_sees_raises_and_skips_validators() -> None:
    source = ("def f():\n    raise ValueError('x')\n"
              "@field_validator('a')\ndef g(cls, v):\n    raise ValueError('y')\n"
              "def h():\n    raise errors.ConfigError('z')\n"
              "def __getattr__(name):\n    raise AttributeError(name)\n")
    assert _raised_names(ast.parse(source)) == [(2, "ValueError"), (7, "ConfigError")]


@pytest.mark.parametrize(("error", "also"), [
    (ConfigError, ()), (EnvUnavailableError, (ConfigError,)), (HashMismatchError, (ValueError,)),
    (CheckpointError, (HashMismatchError,)), (SnapshotError, (HashMismatchError,)),
    (InvalidArgumentError, (ValueError,)), (AuditQueryError, (InvalidArgumentError,)),
    (ParseError, (InvalidArgumentError,)), (UnknownItemError, (KeyError,)), (InvalidStateError, (RuntimeError,)),
    (RunFailedError, ()),
])
def test_every_kind_is_a_pipeline_error_and_the_builtin_it_replaces(error: type, also: tuple[type, ...]) -> None:
    assert issubclass(error, PipelineError)
    assert all(issubclass(error, base) for base in also)


def test_unknown_items_read_as_sentences() -> None:
    assert str(UnknownItemError("experience 'e1' is not in the index")) == "experience 'e1' is not in the index"
