"""What the split does to held-out figures: the count baselines under the ungrouped split of earlier
moecast versions (``TraceSet.split(0.1, 0)``) and under the grouped test split (``TraceSet.splits()``).

    python bench/bench_splits.py [--traces traces/ds-puffin] [--checkpoint CKPT] [--json]

Rows per baseline (each built on the training side of its own split): the ungrouped held-out
requests, the same without the copies of training prompts, the copies alone, and the grouped test
side. A baseline that remembers training routes (MoE-Infinity's activation matrices) scores the
copies from memory; the gap between the first two rows is what the duplicates added. With
``--checkpoint`` (trained on the grouped split): its test side, and its training requests whose
prompt has a copy there, which is how a held-out copy of a training prompt is scored.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

BASELINES = ("frequency", "cooccurrence", "moe-infinity")


def measure(traces: Path, checkpoint: Path | None = None) -> list[dict]:
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
            rows.append(_row(name, label, requests, evaluate_predictor(pred, ts, requests, progress=False)))
    if checkpoint is not None:
        from moecast.predictors.registry import load

        pred = load(checkpoint, fingerprint=ts.model.fingerprint)
        count = {}
        for r in sides.train:
            count[keys[r]] = count.get(keys[r], 0) + 1
        copied = [r for r in sides.train if count[keys[r]] > 1]
        for label, requests in (("grouped test", sides.test), ("training prompts with a copy", copied)):
            res = evaluate_predictor(pred, ts, requests, progress=False)
            rows.append(_row(checkpoint.name, label, requests, res))
    return rows


def _row(name: str, label: str, requests: list[str], res: dict) -> dict:
    return {
        "baseline": name,
        "requests": label,
        "n_requests": len(requests),
        "tokens": res["tokens"],
        "recall_at_k": res["recall_at_k"],
    }


LABELS = {
    "ungrouped held-out": "ungrouped held-out (earlier versions)",
    "ungrouped held-out without copies": "ungrouped held-out without its copies of training prompts",
    "copies of training prompts": "the ungrouped held-out copies of training prompts alone",
    "grouped test": "grouped test",
    "training prompts with a copy": "training prompts with a copy (scored from memory)",
}


def rows(quick: bool, ds_traces: Path, ds_checkpoint: Path | None = None) -> list[dict]:
    """bench/run_all.py's entry: recall@k of each baseline, and of the DeepSeek LLaPor checkpoint when it
    was trained on the grouped split, on each side of :func:`measure`. The same in ``quick`` and full
    runs (about a minute)."""
    from moecast.collect.traceset import open_traces
    from moecast.predictors.provenance import trained_on_file

    from bench.figures import fig, first_file, missing, shown

    if not Path(ds_traces).is_dir():
        return [missing("splits", f"no DeepSeek TraceSet at {ds_traces}")]
    k = open_traces(ds_traces).model.top_k
    ckpt = first_file(ds_checkpoint)
    record = trained_on_file(str(ckpt)) if ckpt is not None else None
    grouped = record is not None and record.spec is not None  # its test side is then one it never saw
    out = []
    for r in measure(Path(ds_traces), ckpt if grouped else None):
        llapor = r["baseline"] == getattr(ckpt, "name", None)
        who = "LLaPor" if llapor else f"baseline {r['baseline']}"
        note = f"{r['n_requests']} requests, {r['tokens']} tokens"
        note += f"; checkpoint {shown(ckpt)}" if llapor else ""
        goal = ">= 0.85" if llapor and r["requests"] == "grouped test" else ""
        out.append(
            fig(
                "splits", f"{who} recall@{k}, {LABELS[r['requests']]}", r["recall_at_k"], "{:.4f}", goal, note
            )
        )
    if not grouped:
        out.append(
            missing("splits", "no DeepSeek LLaPor checkpoint trained on the grouped split", "LLaPor recall")
        )
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", default="traces/ds-puffin")
    ap.add_argument("--checkpoint", type=Path, default=None)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    for r in measure(Path(args.traces), args.checkpoint):
        if args.json:
            print(json.dumps(r))
        else:
            print(
                f"{r['baseline']:<36}{r['requests']:<36}{r['n_requests']:>5} requests {r['tokens']:>7} tokens"
                f"  recall@k {r['recall_at_k']:.4f}"
            )


if __name__ == "__main__":
    main()
