"""Import speed and size on disk of the MoE-Beyond DeepSeek-V2-Lite traces (goal: all files in < 120 s).

    python bench/bench_import.py [--source ../shared/traces/deepseek-v2-lite-puffin] [--max-files N]

Imports into a temporary folder with ``moecast import moe-beyond``'s function and prints the wall
time and the TraceSet's size; with ``--max-files`` both are also extrapolated to every file.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path


def measure(source: Path, out: Path, max_files: int | None = None) -> dict:
    """Seconds and bytes of one import of ``source`` (its first ``max_files`` prompts) into ``out``."""
    from moecast.collect.moe_beyond import import_moe_beyond, list_files

    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    import_moe_beyond(Path(source), out=Path(out), max_files=max_files)
    seconds = time.perf_counter() - t0
    size = sum(p.stat().st_size for p in Path(out).rglob("*") if p.is_file())
    total = len(list_files(Path(source)))
    return {"seconds": seconds, "bytes": size, "files": min(max_files or total, total), "of_files": total}


def rows(quick: bool, puffin: Path, work: Path) -> list[dict]:
    """``quick``: 200 files, the time and size extrapolated to all of them."""
    from bench.figures import fig, skipped

    if not Path(puffin).is_dir():
        return [skipped("import", "../shared/traces absent")]
    out = Path(work) / "ds-import"
    try:
        m = measure(puffin, out, 200 if quick else None)
    finally:
        shutil.rmtree(out, ignore_errors=True)
    n, total, dt, size = m["files"], m["of_files"], m["seconds"], m["bytes"]
    name = f"import of {total} DeepSeek files (s)"
    if n == total:
        return [
            fig("import", name, dt, "{:.1f} s", "< 120 s"),
            fig("import", "TraceSet size on disk (MB)", size / 1e6, "{:.1f} MB"),
        ]
    scale = total / n
    return [
        fig(
            "import", name, dt * scale, "{:.0f} s", "< 120 s", f"quick: {n} files in {dt:.1f} s, extrapolated"
        ),
        fig(
            "import",
            "TraceSet size on disk (MB)",
            size * scale / 1e6,
            "{:.0f} MB",
            note=f"quick: {size / 1e6:.1f} MB for {n} files, extrapolated",
        ),
    ]


def main() -> None:
    here = Path(__file__).resolve().parents[1]
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", default=str(here.parent / "shared" / "traces" / "deepseek-v2-lite-puffin"))
    ap.add_argument("--max-files", type=int, default=None, help="import only the first N prompts")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        m = measure(Path(args.source), Path(tmp) / "ds", args.max_files)
    print(
        f"imported {m['files']} of {m['of_files']} files in {m['seconds']:.1f} s; TraceSet {m['bytes'] / 1e6:.1f} MB"
    )
    if m["files"] < m["of_files"]:
        scale = m["of_files"] / m["files"]
        print(
            f"all {m['of_files']} files, extrapolated: {m['seconds'] * scale:.0f} s, "
            f"{m['bytes'] * scale / 1e6:.0f} MB (goal < 120 s)"
        )


if __name__ == "__main__":
    main()
