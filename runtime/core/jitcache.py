"""numba's on-disk cache of the step's kernels, kept in step with every file the kernels compile in.

numba drops a cached function when the file that defines it changes, not when a file it compiles in
does (numba's docs, "Notes on Caching": changes to functions in other files are not detected).
``step_kernels`` and ``presched`` compile ``kernels``' functions into theirs, and ``kernels`` takes
``eviction``'s codes as compile-time constants: an edit of ``kernels.py`` alone would leave the others
running the old code from the cache, with tests passing or failing on code no longer in the tree.
:func:`keyed` stamps each module's cache with a digest of all of :data:`SOURCES` and, where the
stamp differs, empties the module's cached functions (numba's ``Cache.flush``) before any is loaded.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

#: the files whose code the step's cached kernels hold (this directory)
SOURCES = ("eviction.py", "kernels.py", "step_kernels.py", "presched.py")


def digest() -> str:
    """A digest of :data:`SOURCES` as they are now."""
    h = hashlib.sha256()
    here = Path(__file__).parent
    for name in SOURCES:
        h.update((here / name).read_bytes())
    return h.hexdigest()[:16]


def keyed(namespace: dict[str, Any]) -> int:
    """Call at the end of a kernel module with its ``globals()``: where the module's cache was written
    from other :data:`SOURCES` than the tree's, its cached functions are emptied and the stamp renewed.
    Returns how many were emptied (0 where the cache is current, absent or not writable)."""
    cached = [v for v in namespace.values() if type(getattr(v, "_cache", None)).__name__ == "FunctionCache"]
    if not cached:
        return 0
    stamp = Path(cached[0]._cache.cache_path) / f"{namespace['__name__'].rsplit('.', 1)[-1]}.sources"
    now = digest()
    try:
        if stamp.read_text() == now:
            return 0
    except OSError:
        pass  # no stamp yet: whatever the cache holds may predate it
    try:
        for fn in cached:
            fn._cache.flush()
        stamp.parent.mkdir(parents=True, exist_ok=True)
        tmp = stamp.with_name(f".{stamp.name}.{os.getpid()}")
        tmp.write_text(now)
        os.replace(tmp, stamp)
    except OSError:  # a read-only install: numba cannot write its cache there either
        return 0
    return len(cached)
