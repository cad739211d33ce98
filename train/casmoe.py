"""What CasMoE's three planner builds share (casmoe-eam-eap-cascade.md, "Data Calibration").

The dataset D of (prompt, EP) pairs is read from a TraceSet split by request and prompt
(``TraceSet.splits(val_fraction, test_fraction, seed)``: planners are built on train and
evaluated here on val; ``moecast predictors eval`` reports test); :func:`data_info` is what every planner
checkpoint records about it, :func:`per_layer_table` how a build reports its held-out plan
recall, and :func:`wandb_run` the offline wandb run a build logs to. The builds:
:mod:`moecast.train.eap` (Eqs. 6-9), :mod:`moecast.train.eam` (Eqs. 4-5) and
:mod:`moecast.train.cascade` (the gate, with the Table-3 comparison).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moecast.collect.traceset import TraceSet
from moecast.train.config import SplitConfig, check_flag


@dataclass(frozen=True)
class PlanData(SplitConfig):
    """The (prompt, EP) pairs of a TraceSet a planner learns from, split by request.

    Args:
        val_fraction: share of requests held out (``TraceSet.split``).
        seed: split seed.
        max_requests: use at most this many training requests (quick runs).
        include_decode: count decoded tokens in the EP label too (Eq. 3 sums the prompt's).
    """

    include_decode: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        check_flag("data", "include_decode", self.include_decode)


def data_info(ts: TraceSet, traces: str, weighted: bool, include_decode: bool) -> dict[str, Any]:
    m = ts.model
    return {
        "fingerprint": m.fingerprint,
        "model_name": m.name_or_path,
        "moe_layers": list(m.moe_layers),
        "num_layers": m.num_layers,
        "num_experts": m.num_experts,
        "top_k": m.top_k,
        "trained_on": str(Path(traces).resolve()),
        # Eq. 3 weights each selection by its router weight; traces without weights
        # (imported DeepSeek) fall back to plain counts, said here
        "ep_weighting": "router-weighted" if weighted else "count (TraceSet has no topk_weights)",
        "include_decode": include_decode,
    }


def per_layer_table(name: str, r: dict[str, Any], moe_layers: list[int]) -> str:
    rec = r["per_layer"]["recall_at_k"]
    cells = "  ".join(f"L{m}:{v:.3f}" for m, v in zip(moe_layers, rec))
    return f"{name} plan recall@{r['k']} on {r['requests']} held-out requests: {r['recall_at_k']:.4f}\n  per layer: {cells}"


@contextmanager
def wandb_run(run_dir: Path, name: str, group: str) -> Iterator[Any]:
    """One wandb run (project moecast) under ``run_dir``, offline unless WANDB_MODE=online (sync
    later with `wandb sync`); finished when the block ends, also on an error."""
    import wandb

    mode = "online" if os.environ.get("WANDB_MODE") == "online" else "offline"
    run = wandb.init(
        project="moecast", name=name, group=group, dir=str(run_dir), mode=mode, reinit="finish_previous"
    )
    try:
        yield run
    finally:
        run.finish()
