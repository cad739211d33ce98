"""The CPU an expert read takes, into buffers of small pages against transparent huge pages.

    python bench/bench_read_pages.py [--dir DIR] [--expert-mb 4.6] [--rounds 3] [--budget 15] [--out DIR]

An O_DIRECT read pins the pages of the buffer it reads into; the disk tier's buffers
(:func:`moecast.runtime.tiers.offload.aligned_bytes`) ask for 2 MB pages (``MADV_HUGEPAGE``). Each
round measures, in turn, the profile's read-CPU probe
(:func:`moecast.runtime.profile.measure.read_cpu_probe`: CPU time per read of an expert of
``--expert-mb`` while the cores compute experts) with the buffers on small pages (the madvise
skipped) and as the runtime allocates them, and how many reads each finished in its budget. ``--dir``
is an offload directory (its experts are read) or any folder on the disk to test (a temporary file
is written there and removed). Rounds interleave the two, so other load on the machine falls on
both; the figures are medians over rounds. Writes ``read-pages-<host>.md`` and ``.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"


def measure(directory: str, expert_bytes: int, rounds: int, budget: float) -> dict[str, list[dict]]:
    """Per page kind, each round's read CPU (ms) and reads per second."""
    from moecast.runtime.profile.measure import read_cpu_probe
    from moecast.runtime.tiers import offload

    real = offload._huge_pages
    out: dict[str, list[dict]] = {"small pages": [], "huge pages": []}
    try:
        for r in range(rounds):
            for kind in out:
                offload._huge_pages = real if kind == "huge pages" else (lambda mm, start, length: None)
                probe = read_cpu_probe(directory, expert_bytes, budget_s=budget)
                # the reads' rate over the time they were timed (not the probe's set-up)
                rate = probe.reads / probe.wall_s
                out[kind].append({"read_cpu_ms": probe.ms, "reads_per_s": rate, "how": probe.how})
                print(
                    f"round {r + 1} {kind:<11}: {probe.ms:.3f} ms of CPU per read, {rate:.1f} reads/s",
                    flush=True,
                )
    finally:
        offload._huge_pages = real
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default=str(Path.home() / ".cache" / "moecast" / "bench_read_pages"))
    ap.add_argument(
        "--expert-mb", type=float, default=4.6, help="the expert read (4.6: a DeepSeek-V2-Lite int4 expert)"
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--budget", type=float, default=15.0, help="seconds per measurement")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args(argv)
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    mode = thp.read_text().strip() if thp.exists() else "absent"
    try:
        got = measure(args.dir, int(args.expert_mb * 1e6), args.rounds, args.budget)
    except Exception as exc:  # a user's command: one line on stderr, a non-zero exit
        print(f"bench_read_pages: FAILED: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    med = {
        k: {m: float(np.median([r[m] for r in v])) for m in ("read_cpu_ms", "reads_per_s")}
        for k, v in got.items()
    }
    host = platform.node() or "host"
    lines = [
        "# Expert reads into small pages and huge pages", "",
        f"- date: {datetime.now(timezone.utc).isoformat(timespec='seconds')}",
        f"- command: `bench/bench_read_pages.py {' '.join(argv if argv is not None else sys.argv[1:])}`",
        f"- machine: {host}, {platform.machine()}, transparent_hugepage: {mode}",
        f"- reads of {args.dir}, scaled to an expert of {args.expert_mb} MB; {args.rounds} rounds interleaved", "",
        "| buffer pages | read CPU ms (median) | reads / s (median) |", "|---|---|---|",
        *(f"| {k} | {v['read_cpu_ms']:.3f} | {v['reads_per_s']:.1f} |" for k, v in med.items()),
    ]  # fmt: skip
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"read-pages-{host}.md").write_text(text)
    (out / f"read-pages-{host}.json").write_text(json.dumps({"medians": med, "rounds": got}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
