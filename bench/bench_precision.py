"""What a precision costs and saves per expert, on the CPU: bytes, compute time at one token, error.

    python bench/bench_precision.py [--hidden 2048] [--intermediate 1408] [--reps 30] [--out DIR]

One expert of the DeepSeek-V2-Lite shape (gate-up [2I, H], down [H, I], bf16, random normal weights
scaled as the bench's model's: std 0.02), at every precision of runtime/tiers/precision.py, and for each:
- bytes: what the slow tier stores and the link moves for it;
- compute at one token, two ways, interleaved rep by rep and reported as medians: on the packed
  weights with torch's weight-only kernel (what the runtime does), and dequantized to bf16 first
  and then multiplied (what a runtime without the kernel does: its cost falls on every load); each
  call on the next of a ring of distinct copies larger than twice the last-level cache, as the
  runtime's experts come cold from memory (runtime/profile/measure.py's ring);
- error: the weights' relative error and the expert's output's on 64 random tokens
  (runtime/tiers/precision.py's ``relative_error`` and ``expert_output_error``).
Writes DIR/precision-<host>.md (date, command, machine, the table) and prints the table; exits 1
when a row failed, its error on stderr.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import shlex
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


def expert(hidden: int, inter: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "gate_up_proj": (torch.randn(2 * inter, hidden, generator=g) * 0.02).bfloat16(),
        "down_proj": (torch.randn(hidden, inter, generator=g) * 0.02).bfloat16(),
    }


def forward(x: torch.Tensor, linear: Any) -> torch.Tensor:
    """The experts interface's gated expert: down(silu(gate) * up), each projection by ``linear``."""
    gate, up = linear(x, "gate_up_proj").chunk(2, dim=-1)
    return linear(F.silu(gate) * up, "down_proj")


def row(prec: Any, w: dict[str, torch.Tensor], reps: int, ring: int = 1) -> dict:
    """One precision's figures (the module docstring's); ``ring``: distinct copies cycled through."""
    import itertools

    from moecast.runtime.tiers import precision as P

    parts = None if not prec.quantized else {n: P.quantize_matrix(prec, t) for n, t in w.items()}
    stored = w if parts is None else {f"{n}.{k}": t for n, p in parts.items() for k, t in p.items()}
    nbytes = sum(t.numel() * t.element_size() for t in stored.values())
    copies = [{k: t.clone() for k, t in stored.items()} for _ in range(max(1, ring))]
    turn = itertools.cycle(range(len(copies)))
    cur: dict[str, dict[str, torch.Tensor]] = {}

    def take(x: torch.Tensor, n: str) -> torch.Tensor:
        if n == "gate_up_proj":  # the next copy for each expert call
            cur["c"] = copies[next(turn)]
        return x

    def mine(n: str) -> dict[str, torch.Tensor]:
        return {k.split(".", 1)[1]: t for k, t in cur["c"].items() if k.startswith(f"{n}.")}

    if parts is None:
        packed = lambda x, n: F.linear(take(x, n), cur["c"][n])  # noqa: E731
        dequant = packed
    else:
        packed = lambda x, n: P.qlinear(prec, take(x, n), mine(n), w[n].shape[1])  # noqa: E731
        dequant = lambda x, n: F.linear(take(x, n), P.dequantize_matrix(prec, mine(n), w[n].shape[1]))  # noqa: E731
    x = torch.randn(1, w["gate_up_proj"].shape[1], generator=torch.Generator().manual_seed(1)).bfloat16()
    times: dict[str, list[float]] = {"packed": [], "dequant": []}
    for fn in (packed, dequant):  # warm-up
        forward(x, fn)
    for _ in range(reps):  # interleaved, so a change of the host's load reaches both alike
        for key, fn in (("packed", packed), ("dequant", dequant)):
            t0 = time.perf_counter()
            forward(x, fn)
            times[key].append((time.perf_counter() - t0) * 1e3)
    return {
        "precision": prec.tag,
        "bytes": nbytes,
        "packed_ms": statistics.median(times["packed"]),
        "dequant_ms": statistics.median(times["dequant"]),
        "weight_error": max(P.relative_error(t.float(), prec) for t in w.values()),
        "output_error": float(P.expert_output_error({n: t[None] for n, t in w.items()}, prec, tokens=64)[0]),
    }


def table(rows: list[dict]) -> str:
    head = f"{'precision':<10} {'MB':>7} {'x model':>7} {'packed ms':>9} {'dequant ms':>10} {'weight err':>10} {'output err':>10}"
    base = rows[0]["bytes"] if rows else 1
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['precision']:<10} {r['bytes'] / 2**20:>7.2f} {r['bytes'] / base:>7.3f} {r['packed_ms']:>9.3f} "
            f"{r['dequant_ms']:>10.3f} {r['weight_error']:>10.4f} {r['output_error']:>10.4f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from moecast.runtime.tiers.precision import Precision

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=1408)
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args(argv)
    from moecast.runtime.profile.measure import ring_size

    w = expert(args.hidden, args.intermediate)
    rows, failed = [], 0
    for prec in (Precision(), Precision("int8"), Precision("int4", args.group_size)):
        try:
            # a ring as large for every precision: the model dtype's, so none of them fits the cache
            ring = ring_size(sum(t.numel() * t.element_size() for t in w.values()))
            rows.append(row(prec, w, args.reps, ring))
        except Exception:
            failed += 1
            print(f"bench_precision: {prec.tag} FAILED\n{traceback.format_exc()}", file=sys.stderr)
    text = table(rows)
    print(text)
    sys.path.insert(0, str(ROOT))
    from bench import figures

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    md = "\n".join([
        "# bench_precision: one expert at each precision, on the CPU",
        "",
        f"- date: {dt.datetime.now().astimezone().isoformat(timespec='seconds')}",
        f"- command: `python bench/bench_precision.py {' '.join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))}`".rstrip(),
        f"- machine: {figures.describe_machine(figures.machine())}; torch threads {torch.get_num_threads()}",
        f"- expert: hidden {args.hidden}, intermediate {args.intermediate}, bf16, random normal weights (std 0.02); "
        f"one token; medians of {args.reps} interleaved reps, each call on the next of a ring of distinct copies",
        "- packed: the weight-only kernel on the stored bytes (the runtime's path); dequant: the weights made bf16 "
        "first, then multiplied; errors: relative Frobenius, weights (the worse matrix) and output (64 random tokens)",
        "",
        "```",
        text,
        "```",
        "",
    ])  # fmt: skip
    path = out / f"precision-{os.uname().nodename}.md"
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(md)
    tmp.replace(path)
    print(f"wrote {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
