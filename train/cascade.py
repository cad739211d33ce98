"""Writing CasMoE's cascade planner (casmoe-eam-eap-cascade.md, "Gating", Table 3).

``moecast train cascade --eam A --eap B --out C --epsilon e [--traces T]`` writes the
gated cascade checkpoint (EAM if its cosine confidence >= epsilon, else EAP) and, with
traces, prints the Table-3-style comparison (:mod:`moecast.train.planner_report`).
"""

from __future__ import annotations

import json as jsonlib
import time
from pathlib import Path
from typing import Any

from moecast.collect.traceset import atomic_write_json
from moecast.train.casmoe import wandb_run
from moecast.train.config import SplitConfig
from moecast.train.planner_report import compare_planners, format_table
from moecast.train.runner import run_dir_for

from moecast.errors import InputError


def _log_table3(run_dir: Path, name: str, rows: list[dict[str, Any]]) -> None:
    """The Table-3 comparison as one wandb run: a table and ``<planner>/<metric>`` scalars."""
    import wandb

    with wandb_run(run_dir, name, "cascade") as run:
        cols = ["planner", "recall_at_k", "f1_micro", "mean_latency_ms", "p50_latency_ms", "eam_share"]
        table = wandb.Table(columns=cols, data=[[r.get(c) for c in cols] for r in rows])
        data: dict[str, Any] = {"table3": table}
        for r in rows:
            for c in cols[1:]:
                if isinstance(r.get(c), (int, float)):
                    data[f"{r['planner']}/{c}"] = r[c]
        run.log(data)


# fit_cascade's default split (frozen: one instance serves every call)
_DATA = SplitConfig()


def fit_cascade(
    eam: str,
    eap: str,
    out: str,
    epsilon: float = 0.5,
    traces: str | None = None,
    epsilons: list[float] | None = None,
    data: SplitConfig = _DATA,
    json: bool = False,
    int8: bool | None = None,
    engine: str | None = None,
    threads: int | None = None,
    run_dir: str | None = None,
    wandb: bool = True,
) -> Path:
    """Write CasMoE's gated cascade (EAM if cosine confidence >= epsilon, else EAP); with traces, compare.

    Args:
        eam: EAM checkpoint (``moecast train eam``).
        eap: EAP checkpoint (``moecast train eap``).
        out: cascade checkpoint to write (.safetensors; it names the two beside it).
        epsilon: the gate threshold on the EAM's best cosine similarity.
        traces: a TraceSet; when given, print the Table-3-style comparison on its val requests.
        epsilons: thresholds to compare (default 0.3 0.5 0.6 0.7 0.8 0.9 plus epsilon).
        data: the split, as the planners were trained with; the comparison runs on val
            (``max_requests``: at most this many of its requests).
        json: print one JSON object for the checkpoint, then one per comparison row, instead of text.
        int8: compare with int8 (true) or fp32 (false) encoders; default: as the checkpoints say.
        engine: compare with the encoders run by onnx, torch or auto; default: as the checkpoints say.
        threads: batch-1 encoder threads for the comparison (default: 1).
        run_dir: where the comparison's table3.json and offline wandb run go (default ``<out>.run``).
        wandb: log the comparison (one row per planner, scalars and a table) to an offline wandb run.
    """
    from moecast.predictors.cascade import Cascade
    from moecast.predictors.registry import load

    eam_p, eap_p = load(eam), load(eap)
    if eam_p.name != "eam" or eap_p.name != "eap":
        raise InputError(f"--eam must be an EAM and --eap an EAP checkpoint (got {eam_p.name}, {eap_p.name})")
    cascade = Cascade(eam_p, eap_p, epsilon)
    path = cascade.save(out, eam, eap)
    if json:  # every line a JSON object: the checkpoint's first, then the comparison's rows
        print(
            jsonlib.dumps(
                {"checkpoint": str(path), "epsilon": epsilon, "shared_embedding": cascade.shared_embedding}
            )
        )
    else:
        print(f"wrote {path} (epsilon {epsilon}, EAP reuses the EAM embedding: {cascade.shared_embedding})")
    if traces:
        eps = sorted({*(epsilons or [0.3, 0.5, 0.6, 0.7, 0.8, 0.9]), epsilon})
        t0 = time.perf_counter()
        rows = compare_planners(
            eam_p, eap_p, traces, eps, None, data.val_fraction, data.seed, data.max_requests,
            int8=int8, engine=engine, threads=threads, test_fraction=data.test_fraction,
        )  # fmt: skip
        rd = run_dir_for(Path(out), run_dir)
        rd.mkdir(parents=True, exist_ok=True)
        atomic_write_json(rd / "table3.json", {"traces": str(traces), "rows": rows})
        if wandb:
            _log_table3(rd, Path(out).stem, rows)
        if json:
            for r in rows:
                print(jsonlib.dumps(r))
        else:
            print(format_table(rows))
            print(f"({time.perf_counter() - t0:.1f} s)")
    return path
