"""CasMoE Table-3-style comparison on held-out requests: EAP alone, EAM alone, the cascade at several epsilon.

    python bench/bench_casmoe.py --eam EAM.safetensors --eap EAP.safetensors --traces traces/ds-puffin \
        [--epsilons 0.3,0.5,0.6,0.7,0.8,0.9] [--k 6] [--max-requests 200] [--threads 1] [--json]

Prints plan recall@k (against each held-out request's top-k of its true EP label per
layer), F1, and mean / median planner latency per prompt (EAM: embedding + HNSW
query; EAP: encoder + heads; cascade: EAM always, plus the EAP for prompts whose
confidence is below epsilon). Also a static plan (the training requests' mean EP)
for reference. Targets (CasMoE, on a GPU in the paper): EAM <= 5 ms, EAP <= 10 ms,
cascade recall >= EAP at lower mean latency. Builds both checkpoints first when
``--build`` is given (frozen-MiniLM EAP, the quick CPU recipe).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--traces", default="traces/ds-puffin")
    ap.add_argument("--eam", default="runs/casmoe/eam.safetensors")
    ap.add_argument("--eap", default="runs/casmoe/eap.safetensors")
    ap.add_argument("--build", action="store_true", help="build the EAM and train a frozen-MiniLM EAP first")
    ap.add_argument("--epsilons", default="0.3,0.5,0.6,0.7,0.8,0.9")
    ap.add_argument("--k", type=int, default=None, help="recall@k (default: the model's top-k)")
    ap.add_argument("--val-fraction", type=float, default=0.1)
    ap.add_argument("--max-requests", type=int, default=None)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads for the timed planners")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("WANDB_MODE", "offline")

    import torch

    torch.set_num_threads(args.threads)
    if args.build:
        cfg = Path(__file__).resolve().parents[1] / "configs"
        for cmd in (
            [
                "train",
                "eam",
                "--config",
                str(cfg / "eam_minilm.yaml"),
                "--traces",
                args.traces,
                "--out",
                args.eam,
            ],
            [
                "train",
                "eap",
                "--config",
                str(cfg / "eap_minilm_frozen.yaml"),
                "--traces",
                args.traces,
                "--out",
                args.eap,
            ],
        ):
            subprocess.run([sys.executable, "-m", "moecast", *cmd], check=True)

    from moecast.predictors.casmoe import compare_planners, format_table

    eps = [float(x) for x in args.epsilons.split(",") if x]
    t0 = time.perf_counter()
    rows = compare_planners(
        args.eam, args.eap, args.traces, eps, args.k, args.val_fraction, 0, args.max_requests
    )
    if args.json:
        for r in rows:
            print(json.dumps(r))
        return
    print(f"CasMoE planners on held-out requests of {args.traces} (torch threads {args.threads}, this CPU)")
    print(format_table(rows))
    best = {r["planner"]: r for r in rows}
    eap = best["EAP"]
    wins = [
        r
        for r in rows
        if r["planner"].startswith("cascade")
        and r["recall_at_k"] >= eap["recall_at_k"]
        and r["mean_latency_ms"] < eap["mean_latency_ms"]
    ]
    print(
        f"EAM query incl. embedding: {best['EAM']['mean_latency_ms']:.2f} ms/prompt (target <= 5); "
        f"EAP: {eap['mean_latency_ms']:.2f} ms/prompt (target <= 10)"
    )
    print(
        "cascade settings with recall >= EAP at lower mean latency: "
        + (", ".join(r["planner"] for r in wins) if wins else "none")
    )
    print(f"({time.perf_counter() - t0:.1f} s)")


if __name__ == "__main__":
    main()
