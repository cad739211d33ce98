"""The step's kernels' numba cache follows every file they compile in (runtime/core/jitcache.py)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from moecast.runtime.core import jitcache


def _module(tmp_path: Path, value: int, extra: str = ""):
    """A module whose cached kernel returns ``value`` (its cache under tmp_path/__pycache__), and any
    ``extra`` code after it."""
    src = tmp_path / "jc_kernels.py"
    src.write_text(f"from numba import njit\n\n\n@njit(cache=True)\ndef f():\n    return {value}\n{extra}")
    spec = importlib.util.spec_from_file_location("jc_kernels", src)
    mod = importlib.util.module_from_spec(spec)
    sys.modules.pop("jc_kernels", None)
    spec.loader.exec_module(mod)
    return mod


def test_a_change_in_any_source_empties_the_modules_cached_kernels(tmp_path, monkeypatch):
    mod = _module(tmp_path, 1)
    assert mod.f() == 1  # compiled and cached
    index = mod.f._cache._cache_file
    assert index._load_index()  # the cache holds it
    sources = iter(["aaa", "aaa", "bbb"])
    monkeypatch.setattr(jitcache, "digest", lambda: next(sources))
    ns = vars(mod)
    assert jitcache.keyed(ns) == 1  # no stamp yet: whatever is cached may predate it
    stamp = tmp_path / "__pycache__" / "jc_kernels.sources"
    assert stamp.read_text() == "aaa" and index._load_index() == {}
    assert mod.f() == 1 and index._load_index() == {}  # loaded in memory already: not saved again
    assert jitcache.keyed(ns) == 0  # same sources: the cache stands
    assert jitcache.keyed(ns) == 1 and stamp.read_text() == "bbb"  # a source changed: emptied


def test_the_step_kernels_are_stamped_with_the_trees_sources():
    from moecast.runtime.core import kernels, presched, step_kernels

    for mod in (kernels, step_kernels, presched):
        fn = next(
            v for v in vars(mod).values() if type(getattr(v, "_cache", None)).__name__ == "FunctionCache"
        )
        stamp = Path(fn._cache.cache_path) / f"{mod.__name__.rsplit('.', 1)[-1]}.sources"
        if not stamp.parent.is_dir():
            pytest.skip("numba caches nowhere writable here")
        assert stamp.read_text() == jitcache.digest()


def test_every_cached_kernel_of_a_module_is_emptied(tmp_path, monkeypatch):
    """A module compiles more than one cached kernel (step_kernels has a dozen): a source change empties
    each of them, not only the first, and the count says how many."""
    mod = _module(tmp_path, 1, "\n\n@njit(cache=True)\ndef g():\n    return 2\n")
    assert (mod.f(), mod.g()) == (1, 2)
    indexes = [mod.f._cache._cache_file, mod.g._cache._cache_file]
    assert all(ix._load_index() for ix in indexes)
    monkeypatch.setattr(jitcache, "digest", lambda: "aaa")
    assert jitcache.keyed(vars(mod)) == 2
    assert [ix._load_index() for ix in indexes] == [{}, {}]


def test_the_digest_covers_every_file_the_cached_kernels_compile_in():
    """A module that keys its cache compiles in its own code, the kernels it imports and eviction's
    codes (kernels takes them as constants): each of those files must be in the digest, or an edit of
    it leaves the cache running the old code."""
    import ast

    core = Path(jitcache.__file__).parent
    keyed = {p.name for p in core.glob("*.py") if "jitcache.keyed(globals())" in p.read_text()}
    assert keyed >= {"kernels.py", "step_kernels.py", "presched.py"}
    compiled_in = set(keyed) | {"eviction.py"}
    for name in keyed:
        for node in ast.walk(ast.parse((core / name).read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "moecast.runtime.core":
                compiled_in |= {
                    f"{a.name}.py" for a in node.names if "@njit" in (core / f"{a.name}.py").read_text()
                }
    assert compiled_in <= set(jitcache.SOURCES), compiled_in - set(jitcache.SOURCES)
