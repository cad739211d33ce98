"""Writing CasMoE's cascade planner (casmoe-eam-eap-cascade.md, "Gating", Table 3).

``moecast train cascade --eam A --eap B --out C --epsilon e [--traces T]`` writes the
gated cascade checkpoint (EAM if its cosine confidence >= epsilon, else EAP) and, with
traces, prints the Table-3-style comparison (:mod:`moecast.train.planner_report`).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from moecast.collect.traceset import atomic_write_json
from moecast.train.casmoe import wandb_run
from moecast.train.planner_report import compare_planners, format_table

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


def build_cascade_checkpoint(
    eam: str,
    eap: str,
    out: str,
    epsilon: float = 0.5,
    traces: str | None = None,
    epsilons: list[float] | None = None,
    val_fraction: float = 0.1,
    seed: int = 0,
    max_requests: int | None = None,
    json_out: bool = False,
    int8: bool | None = None,
    engine: str | None = None,
    threads: int | None = None,
    run_dir: str | None = None,
    wandb: bool = True,
    test_fraction: float = 0.1,
) -> Path:
    """Write CasMoE's gated cascade (EAM if cosine confidence >= epsilon, else EAP); with traces, compare.

    Args:
        eam: EAM checkpoint (``moecast train eam``).
        eap: EAP checkpoint (``moecast train eap``).
        out: cascade checkpoint to write (.safetensors; it names the two beside it).
        epsilon: the gate threshold on the EAM's best cosine similarity.
        traces: a TraceSet; when given, print the Table-3-style comparison on its val requests.
        epsilons: thresholds to compare (default 0.3 0.5 0.6 0.7 0.8 0.9 plus epsilon).
        val_fraction: share of requests in val, where the comparison runs (``TraceSet.splits``).
        seed: split seed.
        max_requests: compare on at most this many val requests.
        json_out: print one JSON object per comparison row instead of a table.
        int8: compare with int8 (true) or fp32 (false) encoders; default: as the checkpoints say.
        engine: compare with the encoders run by onnx, torch or auto; default: as the checkpoints say.
        threads: batch-1 encoder threads for the comparison (default: 1).
        run_dir: where the comparison's table3.json and offline wandb run go (default ``<out>.run``).
        wandb: log the comparison (one row per planner, scalars and a table) to an offline wandb run.
        test_fraction: share of requests in test (as the planners were trained with).
    """
    from moecast.predictors.cascade import Cascade
    from moecast.predictors.registry import load

    eam_p, eap_p = load(eam), load(eap)
    if eam_p.name != "eam" or eap_p.name != "eap":
        raise InputError(f"--eam must be an EAM and --eap an EAP checkpoint (got {eam_p.name}, {eap_p.name})")
    cascade = Cascade(eam_p, eap_p, epsilon)
    path = cascade.save(out, eam, eap)
    print(f"wrote {path} (epsilon {epsilon}, EAP reuses the EAM embedding: {cascade.shared_embedding})")
    if traces:
        eps = sorted(set([*(epsilons or [0.3, 0.5, 0.6, 0.7, 0.8, 0.9]), epsilon]))
        t0 = time.perf_counter()
        rows = compare_planners(
            eam_p,
            eap_p,
            traces,
            eps,
            None,
            val_fraction,
            seed,
            max_requests,
            int8=int8,
            engine=engine,
            threads=threads,
            test_fraction=test_fraction,
        )
        from moecast.train.cli import run_dir_for

        rd = run_dir_for(Path(out), run_dir)
        rd.mkdir(parents=True, exist_ok=True)
        atomic_write_json(rd / "table3.json", {"traces": str(traces), "rows": rows})
        if wandb:
            _log_table3(rd, Path(out).stem, rows)
        if json_out:
            for r in rows:
                print(json.dumps(r))
        else:
            print(format_table(rows))
            print(f"({time.perf_counter() - t0:.1f} s)")
    return path


def build_cascade(argv: list[str]) -> Path:
    """``moecast train cascade --eam A --eap B --out C [--epsilon e] [--traces T]``."""
    from jsonargparse import auto_cli

    return auto_cli(build_cascade_checkpoint, args=argv, as_positional=False)
