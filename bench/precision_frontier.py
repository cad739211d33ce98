"""The accuracy-against-TPOT frontier of the experts' precision, from two committed results.

    python bench/precision_frontier.py [--tiers bench/results/tiers-vm-26layers-precision.json]
                                       [--accuracy bench/results/accuracy-precision-tiny.md]

TPOT: each precision's fastest row a user can run (no bound, not every expert in RAM) at 25 % of
experts resident in ``--tiers`` (bench_tiers.py's JSON); accuracy: ``moecast eval-accuracy``'s
perplexity change and greedy agreement at alpha 0 on ``tiny`` (its table in ``--accuracy``), both
against the model-precision experts. Prints the table as markdown and writes the plot beside the
accuracy file (precision-frontier.png); exits 1 when a precision has no figure in either file.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def accuracy(path: Path) -> dict[str, tuple[float, float]]:
    """precision tag -> (perplexity change %, agreement %) at alpha 0, from eval-accuracy's table."""
    out = {}
    for line in path.read_text().splitlines():
        cells = line.split()
        if len(cells) >= 5 and cells[1] == "0.00" and cells[3].endswith("%") and cells[4].endswith("%"):
            out[cells[0]] = (float(cells[3].rstrip("%")), float(cells[4].rstrip("%")))
    return out


def fastest(path: Path, capacity: float = 0.25) -> dict[str, dict]:
    """precision tag -> its fastest runnable row at ``capacity`` (bench_tiers' :func:`best_at`)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_tiers import best_at

    rows = [r for r in json.loads(path.read_text()) if r["status"] == "ok" and r["capacity"] == capacity]
    precs = dict.fromkeys(r["expert_dtype"] for r in rows if r.get("expert_dtype"))
    return {p: best_at(rows, p) for p in precs if best_at(rows, p) is not None}


def table(rows: list[tuple[str, dict, tuple[float, float]]]) -> str:
    lines = [
        "| experts | TPOT ms (row) | MB read per token | perplexity change | greedy agreement |",
        "|---|---|---|---|---|",
    ]
    for prec, r, (ppl, agree) in rows:
        lines.append(
            f"| {prec} | {r['measured_tpot_ms']:.0f} ({r['config']}) | {r['read_mb_per_token']:.0f} | "
            f"{ppl:+.2f} % | {agree:.1f} % |"
        )
    return "\n".join(lines)


def plot(rows: list[tuple[str, dict, tuple[float, float]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for prec, r, (ppl, _) in rows:
        ax.scatter(r["measured_tpot_ms"], ppl, s=40)
        ax.annotate(prec, (r["measured_tpot_ms"], ppl), textcoords="offset points", xytext=(5, 4))
    ax.set_xlabel("TPOT, ms (DeepSeek-V2-Lite shape, experts on disk, 25 % resident)")
    ax.set_ylabel("perplexity change, % (tiny)")
    ax.set_title("expert precision: accuracy against TPOT")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp, dpi=120)
    tmp.replace(path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiers", default=str(RESULTS / "tiers-vm-26layers-precision.json"))
    ap.add_argument("--accuracy", default=str(RESULTS / "accuracy-precision-tiny.md"))
    args = ap.parse_args(argv)
    acc, best = accuracy(Path(args.accuracy)), fastest(Path(args.tiers))
    missing = sorted(set(acc) ^ set(best))
    for prec in missing:
        print(f"precision_frontier: {prec} is in only one of {args.tiers}, {args.accuracy}", file=sys.stderr)
    rows = [(p, best[p], acc[p]) for p in best if p in acc]
    rows.sort(key=lambda x: x[1]["measured_tpot_ms"], reverse=True)
    print(table(rows))
    if rows:
        plot(rows, Path(args.accuracy).with_name("precision-frontier.png"))
    return 1 if missing or not rows else 0


if __name__ == "__main__":
    sys.exit(main())
