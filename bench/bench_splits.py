"""What the split does to held-out figures: the count baselines under the ungrouped split of earlier
moecast versions (``TraceSet.split(0.1, 0)``) and under the grouped test split (``TraceSet.splits()``).

    python bench/bench_splits.py [--traces traces/ds-puffin] [--json]

Rows per baseline (each built on the training side of its own split): the ungrouped held-out
requests, the same without the copies of training prompts, the copies alone, and the grouped test
side. A baseline that remembers training routes (MoE-Infinity's activation matrices) scores the
copies from memory; the gap between the first two rows is what the duplicates added.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

BASELINES = ("frequency", "cooccurrence", "moe-infinity")


def measure(traces: Path) -> list[dict]:
    from moecast.collect.traceset import open_traces
    from moecast.predictors.commands import build_baseline, evaluate_predictor

    ts = open_traces(traces)
    keys = ts.prompt_keys()
    old_train, old_val = ts.split(0.1, 0)
    seen = {keys[r] for r in old_train}
    copies = [r for r in old_val if keys[r] in seen]
    fresh = [r for r in old_val if keys[r] not in seen]
    sides = ts.splits()
    rows = []
    for name in BASELINES:
        old = build_baseline(name, ts, old_train)
        new = build_baseline(name, ts, sides.train)
        for label, pred, requests in (
            ("ungrouped held-out", old, old_val),
            ("ungrouped held-out without copies", old, fresh),
            ("copies of training prompts", old, copies),
            ("grouped test", new, sides.test),
        ):
            res = evaluate_predictor(pred, ts, requests, progress=False)
            rows.append(
                {
                    "baseline": name,
                    "requests": label,
                    "n_requests": len(requests),
                    "tokens": res["tokens"],
                    "recall_at_k": res["recall_at_k"],
                }
            )
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", default="traces/ds-puffin")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    for r in measure(Path(args.traces)):
        if args.json:
            print(json.dumps(r))
        else:
            print(
                f"{r['baseline']:<14}{r['requests']:<36}{r['n_requests']:>5} requests {r['tokens']:>7} tokens"
                f"  recall@k {r['recall_at_k']:.4f}"
            )


if __name__ == "__main__":
    main()
