"""How much slower the CPU computes experts while the disk reads experts: the floor a disk row pays.

    python bench/bench_read_interference.py [--dir DIR] [--inter 1408] [--precision model,int4-g128]
        [--read-mb 4.6] [--threads 2] [--window 1.0] [--rounds 10] [--out DIR]

The disk tier reads while the CPU computes, and the all-in-RAM row reads nothing. This measures what
reading alone costs the compute: one token through experts at each of ``--precision``
(the runtime's kernels; a ring of experts larger than the last-level cache, as a decode step reads
its weights; DeepSeek-V2-Lite's shape by default), timed in windows of ``--window`` seconds under three conditions in turn:

- ``none``: nothing else runs;
- ``reads, this process``: ``--threads`` threads read whole experts back to back, as the runtime's
  I/O threads do (sharing the interpreter with the compute);
- ``reads, another process``: the same reads from a separate process (no interpreter shared).

Each round runs the three, so the host's drift falls on all of them; a condition's slowdown is the
median over rounds of its window's time per expert over the ``none`` window's of the same round.
Reads come from ``--dir``: an offload directory (its experts are read as the runtime reads them) or
any folder on the disk to test (a temporary file of ``--read-mb`` blocks is written there and removed). Writes
``read-interference-<host>.md`` and ``.json`` to ``--out``; exits 1 with one line on stderr when a
measurement fails.
"""

from __future__ import annotations

import argparse
import json
import platform
import signal
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
CONDITIONS = ("none", "reads, this process", "reads, another process")
HIDDEN = 2048


def paired_slowdown(times: list[float], base: list[float]) -> float:
    """The median over rounds of ``times[r] / base[r]``: each round's ratio to its own baseline."""
    return float(statistics.median(t / b for t, b in zip(times, base, strict=True)))


def expert_ring(inter: int, precision: str, llc: int) -> tuple[Any, list[Any]]:
    """(the call computing one token through an expert, the ring of experts it cycles): gated bf16
    experts (gate-up [2 inter, HIDDEN], down [HIDDEN, inter]) quantized to ``precision`` and computed
    with the runtime's kernels, as many as make twice ``llc`` bytes as stored (64 at most)."""
    import torch
    from moecast.runtime.tiers import precision as P

    prec = P.Precision.of_tag(precision)
    x = torch.full((1, HIDDEN), 0.01, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(0)

    def matrix(out_f: int, in_f: int) -> Any:
        w = (torch.randn(out_f, in_f, generator=gen) * 0.02).to(torch.bfloat16)
        return P.quantize_matrix(prec, w) if prec.quantized else {"w": w}

    first = (matrix(2 * inter, HIDDEN), matrix(HIDDEN, inter))
    stored = sum(t.numel() * t.element_size() for m in first for t in m.values())
    count = min(64, max(2, -(-2 * llc // stored)))
    ring = [first, *((matrix(2 * inter, HIDDEN), matrix(HIDDEN, inter)) for _ in range(count - 1))]

    def linear(h: Any, parts: dict, in_f: int) -> Any:
        return torch.nn.functional.linear(h, parts["w"]) if "w" in parts else P.qlinear(prec, h, parts, in_f)

    def expert(w: tuple[dict, dict]) -> Any:
        g, u = linear(x, w[0], HIDDEN).chunk(2, dim=-1)
        return linear(torch.nn.functional.silu(g) * u, w[1], inter)

    return expert, ring


def window(expert: Any, ring: list[Any], seconds: float) -> float:
    """ms per expert over a window of ``seconds``, the ring computed in turn."""
    import torch

    n, t0 = 0, time.perf_counter()
    with torch.inference_mode():
        while time.perf_counter() - t0 < seconds:
            expert(ring[n % len(ring)])
            n += 1
    return (time.perf_counter() - t0) * 1e3 / n


def _reader_process(directory: str, expert_bytes: int, threads: int) -> subprocess.Popen:
    """Another process reading as ``--reader`` does, until it is stopped; returns once it reads."""
    argv = [sys.executable, __file__, "--reader", "--dir", directory, "--read-mb", str(expert_bytes / 1e6),
            "--threads", str(threads)]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline() if proc.stdout else ""
    if "reading" not in line:
        err = proc.stderr.read() if proc.stderr else ""
        proc.kill()
        proc.wait()
        raise RuntimeError(f"the reading process did not start: {(err or line).strip().splitlines()[-1:]}")
    return proc


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Each precision's ms per expert under each condition, round by round, and the reads' rate in
    this process."""
    from moecast.runtime.profile.measure import _block_reads, _reading, llc_bytes

    expert_bytes = int(args.read_mb * 1e6)
    rings = {p: expert_ring(args.inter, p, llc_bytes()) for p in args.precision.split(",")}
    for expert, ring in rings.values():
        window(expert, ring, min(0.5, args.window))  # the kernels' first calls
    got: dict[str, dict[str, list[float]]] = {p: {c: [] for c in CONDITIONS} for p in rings}
    gbps: list[float] = []
    with _block_reads(Path(args.dir), expert_bytes) as (read, nbytes):
        counted = [0]

        def counting() -> None:
            read()
            counted[0] += 1

        def beside(cond: str, expert: Any, ring: list[Any]) -> float:
            if cond == "none":
                return window(expert, ring, args.window)
            if cond == "reads, this process":
                with _reading(counting, args.threads):
                    time.sleep(0.1)  # the reads under way before the window
                    n0, t0 = counted[0], time.perf_counter()
                    ms = window(expert, ring, args.window)
                    gbps.append((counted[0] - n0) * nbytes / (time.perf_counter() - t0) / 1e9)
                    return ms
            proc = _reader_process(args.dir, expert_bytes, args.threads)
            try:
                return window(expert, ring, args.window)
            finally:
                _stop(proc)

        for r in range(args.rounds):
            for p, (expert, ring) in rings.items():
                for cond in CONDITIONS:
                    got[p][cond].append(beside(cond, expert, ring))
                print(
                    f"round {r + 1} {p}: " + ", ".join(f"{c} {got[p][c][-1]:.3f} ms" for c in CONDITIONS),
                    flush=True,
                )
    rings_len = {p: len(ring) for p, (_, ring) in rings.items()}
    return {"ms_per_expert": got, "read_gbps_this_process": gbps, "ring": rings_len, "block_bytes": nbytes}


def reader_main(args: argparse.Namespace) -> int:
    """``--reader``: read until stopped (the other process of the third condition)."""
    from moecast.runtime.profile.measure import _block_reads, _reading

    # stopped with SIGTERM: leave through the blocks below, which join the readers and remove a temporary file
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    with _block_reads(Path(args.dir), int(args.read_mb * 1e6)) as (read, _), _reading(read, args.threads):
        print("reading", flush=True)
        while True:
            time.sleep(1.0)


def report(args: argparse.Namespace, got: dict[str, Any], argv: list[str]) -> tuple[str, dict]:
    summary = {
        p: {
            c: {"ms_per_expert": float(statistics.median(v)), "slowdown": paired_slowdown(v, ms["none"])}
            for c, v in ms.items()
        }
        for p, ms in got["ms_per_expert"].items()
    }
    rate = float(statistics.median(got["read_gbps_this_process"])) if got["read_gbps_this_process"] else None
    rate_text = f"{rate:.2f} GB/s" if rate is not None else "no rate"
    host = platform.node() or "host"
    rings = ", ".join(f"{p}: {n}" for p, n in got["ring"].items())
    lines = [
        "# Compute beside disk reads", "",
        f"- date: {datetime.now(timezone.utc).isoformat(timespec='seconds')}",
        f"- command: `{' '.join(['bench/bench_read_interference.py', *argv])}`",
        f"- machine: {host}, {platform.machine()}",
        f"- one token through experts of hidden {HIDDEN}, intermediate {args.inter} (rings of {rings} experts), "
        f"windows of {args.window} s; reads of {got['block_bytes'] / 1e6:.2f} MB blocks from {args.dir} on "
        f"{args.threads} threads, {rate_text} in this process (median)",
        f"- {args.rounds} rounds, each running every precision under the three conditions in turn; slowdown: "
        "the median of each round's ratio to its own `none` window", "",
        "| experts | condition | ms per expert (median) | slowdown |", "|---|---|---|---|",
        *(f"| {p} | {c} | {v['ms_per_expert']:.3f} | {v['slowdown']:.3f}x |"
          for p, by in summary.items() for c, v in by.items()),
    ]  # fmt: skip
    return "\n".join(lines) + "\n", {"summary": summary, "read_gbps": rate, **got}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    default_dir = Path.home() / ".cache" / "moecast" / "bench_tiers" / "lite-L26" / "experts"
    ap.add_argument("--dir", default=str(default_dir if default_dir.is_dir() else default_dir.parents[2]))
    ap.add_argument(
        "--inter", type=int, default=1408, help="the experts' intermediate size (DeepSeek-V2-Lite's)"
    )
    ap.add_argument("--read-mb", type=float, default=4.6, help="the read block where --dir holds no offload")
    ap.add_argument(
        "--precision",
        default="model,int4-g128",
        help="the computed experts' precisions (model, int8, int4-g128)",
    )
    ap.add_argument("--threads", type=int, default=2, help="reading threads (the runtime's io_threads)")
    ap.add_argument("--window", type=float, default=1.0, help="seconds per condition and round")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--reader", action="store_true", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.reader:
        return reader_main(args)
    try:
        got = measure(args)
    except Exception as exc:  # a user's command: one line on stderr, a non-zero exit
        print(f"bench_read_interference: FAILED: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    text, data = report(args, got, argv)
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    host = platform.node() or "host"
    from moecast.collect.traceset import atomic_write_bytes

    atomic_write_bytes(out / f"read-interference-{host}.md", text.encode())
    atomic_write_bytes(out / f"read-interference-{host}.json", (json.dumps(data, indent=1) + "\n").encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
