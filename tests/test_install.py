"""The project's own files install what its tests and benchmarks import: a fresh machine that runs the
README's test command (``pip install -e ".[dev]"``) has every third-party module imported by tests/ and
bench/, with nothing left to a package installed by hand."""

from __future__ import annotations

import ast
import re
import sys
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

ROOT = Path(__file__).resolve().parents[1]
LOCAL = {"moecast", "bench", "conftest", "collect", "predictors", "train", "runtime", "configs"}


def _name(req: str) -> str:
    return re.split(r"[\s<>=!\[;~]", req, maxsplit=1)[0].lower().replace("_", "-")


def extra_closure(extra: str | None) -> set[str]:
    """Distribution names that ``pip install moecast[extra]`` asks for by name (extras followed; None:
    the plain install)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names, todo = {_name(r) for r in project["dependencies"]}, [extra] if extra else []
    seen: set[str] = set()
    while todo:
        e = todo.pop()
        seen.add(e)
        for req in project["optional-dependencies"][e]:
            m = re.fullmatch(r"moecast\[(.+)\]", req.strip())
            if m:
                todo += [x for x in m.group(1).split(",") if x not in seen]
            else:
                names.add(_name(req))
    return names


def imported_modules(folder: Path) -> set[str]:
    """Top-level module names that any .py file under ``folder`` imports, at any depth of its code."""
    out: set[str] = set()
    for f in folder.glob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                out |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                out.add(node.module.split(".")[0])
    return out - set(sys.stdlib_module_names) - LOCAL - SCRIPTS


#: the bench scripts and test modules import each other by file name (bench/ on sys.path)
SCRIPTS = {p.stem for d in ("bench", "tests") for p in (ROOT / d).glob("*.py")}


def test_the_closure_follows_self_referencing_extras():
    dev = extra_closure("dev")
    assert {"pytest", "accelerate", "moe-policylang", "torch", "transformers"} <= dev
    assert "accelerate" in extra_closure("bench") and "pytest" not in extra_closure("bench")


def not_installed_by(extra: str | None, folders: tuple[str, ...]) -> dict[str, list[str]]:
    """Third-party modules imported under ``folders`` whose distribution ``moecast[extra]`` does not name
    (a module only a transitive dependency brings is named too: a dependency's own change can drop it)."""
    dists, wanted = packages_distributions(), extra_closure(extra)
    missing = {}
    for folder in folders:
        for mod in imported_modules(ROOT / folder):
            owners = {_name(d) for d in dists.get(mod, [])}
            if not owners & wanted:
                missing[mod] = sorted(owners) or ["(not installed)"]
    return missing


def test_dev_installs_every_module_the_tests_and_benches_import():
    missing = not_installed_by("dev", ("tests", "bench"))
    assert not missing, f"imported by tests/ or bench/ but not named by .[dev]: {missing}"


def test_the_plain_install_names_every_module_the_package_imports():
    missing = not_installed_by(None, ("moecast", "collect", "predictors", "train", "runtime"))
    assert not missing, f"imported by the package but not named by its dependencies: {missing}"
