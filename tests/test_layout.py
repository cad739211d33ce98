"""The runtime's rooms import one way: core uses nothing else of the runtime; tiers only core; live and
replay use core and tiers, never each other."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

RUNTIME = Path(__file__).resolve().parents[1] / "runtime"
MAY_USE = {
    "core": {"core"},
    "tiers": {"core", "tiers"},
    "live": {"core", "tiers", "live"},
    "replay": {"core", "tiers", "replay"},
    "profile": {"core", "tiers", "live", "replay", "profile"},
}


def rooms_imported(path: Path) -> set[str]:
    """The runtime rooms ``path`` imports (at module level or inside a function)."""
    rooms = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[:2] == ["moecast", "runtime"] and len(parts) > 2:
                rooms.add(parts[2])
    return rooms


def test_the_rooms_are_exactly_these():
    found = {p.name for p in RUNTIME.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert found == set(MAY_USE)
    assert {p.name for p in RUNTIME.glob("*.py")} == {"__init__.py"}  # no module left outside a room


@pytest.mark.parametrize("room", sorted(MAY_USE))
def test_imports_run_one_way(room):
    for path in sorted((RUNTIME / room).glob("*.py")):
        wrong = rooms_imported(path) - MAY_USE[room]
        assert not wrong, f"{path.relative_to(RUNTIME)} imports runtime.{sorted(wrong)}"


def test_the_checker_sees_a_wrong_import(tmp_path):
    bad = tmp_path / "m.py"
    bad.write_text("def f():\n    from moecast.runtime.live import runtime\n")
    assert rooms_imported(bad) == {"live"}
    bad.write_text("from moecast.runtime import replay\n")
    assert rooms_imported(bad) == {"replay"}
