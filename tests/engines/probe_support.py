"""Shared by the probe scenarios (run in an engine's venv): capture what an engine's own logger
writes, and find a log statement's format in the engine's installed source, for the few lines
whose code cannot run on CPU (a whole scheduler or model runner)."""

from __future__ import annotations

import ast
import importlib.util
import inspect
import logging
import sys
from pathlib import Path
from types import ModuleType
from typing import Any


class Lines(logging.Handler):
    """Keeps each record as the engine's formatter writes it."""

    def __init__(self, formatter: logging.Formatter) -> None:
        super().__init__(logging.INFO)
        self.setFormatter(formatter)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))

    def take(self) -> list[str]:
        taken, self.lines = self.lines, []
        return taken


def capture(logger_name: str, formatter: logging.Formatter) -> Lines:
    lines = Lines(formatter)
    logger = logging.getLogger(logger_name)
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)
    return lines


def source_of(module: ModuleType | str) -> str:
    """A module's installed source; a dotted name is read without importing the module
    (some cannot be imported on CPU)."""
    if isinstance(module, ModuleType):
        return inspect.getsource(module)
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin, module
    return Path(spec.origin).read_text(encoding="utf-8")


def function_of(module: ModuleType | str, name: str, names: dict[str, Any]) -> Any:
    """A module-level function of `module`, compiled from its installed source alone, with
    `names` as its globals."""
    tree = ast.parse(source_of(module))
    found = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name]
    assert found, f"no function {name} in {module}: the engine changed"
    scope = dict(names)
    exec(compile(ast.Module(found, type_ignores=[]), str(module), "exec"), scope)
    return scope[name]


def log_call(module: ModuleType | str, needle: str) -> ast.Call:
    """The logger call in `module`'s source whose format (a string or an f-string) contains
    `needle`: read from the installed engine, so a changed format changes the test's input."""
    tree = ast.parse(source_of(module))
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("info", "warning", "info_once", "warning_once")
            and node.args
            and needle in ast.unparse(node.args[0])
        ):
            return node
    raise SystemExit(f"no log call with {needle!r} in {module}: the engine changed")


def format_of(module: ModuleType | str, needle: str) -> str:
    """A %-style format string of a log call in `module` (adjacent literals joined)."""
    first = log_call(module, needle).args[0]
    value = ast.literal_eval(first)
    assert isinstance(value, str)
    return value


def render_fstring(module: ModuleType | str, needle: str, names: dict[str, Any]) -> str:
    """Evaluate the f-string of a log call in `module` with `names` as its variables."""
    expression = ast.Expression(log_call(module, needle).args[0])
    return str(eval(compile(expression, str(module), "eval"), dict(names)))


def done(result: dict[str, Any]) -> None:
    import json

    sys.stdout.flush()
    print(json.dumps(result))
