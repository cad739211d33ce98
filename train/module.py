"""What the per-token trainers' Lightning modules share (LLaPor, PreScope §4.2.2; the sequence model, MoE-Beyond §3.2).

Both validate by recall@k of the true top-k (:mod:`moecast.predictors.metrics`), log it per
layer and per layer group, keep the metrics of the epoch a checkpoint holds, lay a linear
warm-up and a cosine decay over the planned epochs, and record the same run metadata in the
exported predictor.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from moecast.predictors.metrics import MetricAccumulator
from moecast.train.data import split_metadata

from moecast.errors import InputError


def planned_epochs(trainer: Any, what: str) -> int:
    """``trainer.max_epochs`` as the length ``what`` (a warm-up and cosine schedule) is laid out
    over: one clear error when the run has no epoch count (-1: bounded by max_time or max_steps
    only), which would squeeze the whole schedule into the first epoch."""
    total = trainer.max_epochs
    if total is None or int(total) < 1:
        raise InputError(
            f"train.max_epochs must be a positive number of epochs, got {total!r}: {what} is laid out "
            "over it (bound the wall time with train.max_time as well)"
        )
    return int(total)


def warm_cosine(warm_epochs: int, total: int) -> Callable[[int], float]:
    """Learning-rate factor per epoch: linear warm-up over ``warm_epochs``, then cosine from 1 to 0.05."""

    def factor(epoch: int) -> float:
        if epoch < warm_epochs:
            return (epoch + 1) / (warm_epochs + 1)
        t = (epoch - warm_epochs) / max(total - warm_epochs, 1)
        return 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(t, 1.0)))

    return factor


def log_validation(
    module: pl.LightningModule,
    acc: MetricAccumulator,
    moe_layers: list[int],
    groups: dict[str, list[int]] | None = None,
) -> dict[str, Any] | None:
    """Log the held-out metrics (predictors.metrics: recall@k, precision, micro and macro F1)
    overall, per MoE layer and per layer group; returns them, or None when there were no rows.

    Under DDP each rank validated a shard (``eval_sampler``): the ranks' counts are summed first,
    so every rank logs the whole split's figures. ``val/recall`` is recall@k, the monitored value.
    """
    if module.trainer.world_size > 1:
        vec = torch.from_numpy(acc.counts()).to(module.device)
        acc.set_counts(module.all_gather(vec).reshape(-1, len(vec)).sum(0).cpu().numpy())
    if not acc.rows.sum():
        return None
    parts = {f"layer/{layer}": [i] for i, layer in enumerate(moe_layers)}
    parts.update({f"group/{g}": list(ls) for g, ls in (groups or {}).items() if ls})
    res = acc.result(parts)
    names = {
        "recall_at_k": "recall",
        "precision": "precision",
        "f1_micro": "f1_micro",
        "f1_macro": "f1_macro",
    }
    for key, name in names.items():
        module.log(f"val/{name}", res[key], prog_bar=name == "recall")
        for part, summary in res["per_group"].items():
            kind, label = part.split("/", 1)
            module.log(f"val/{name}_{kind}/{label}", summary[key])
    return res


class RecallModule(pl.LightningModule):
    """A per-token predictor's module: validation by recall@k, the best epoch's metrics kept.

    A subclass sets ``moe_layers`` in ``setup`` and fills ``self._acc`` (a
    :class:`MetricAccumulator`) in ``validation_step``; ``layer_groups`` names the groups the
    metrics are also logged for.
    """

    moe_layers: list[int]
    layer_groups: dict[str, list[int]] | None = None

    def on_validation_epoch_end(self) -> None:
        res = log_validation(self, self._acc, self.moe_layers, self.layer_groups)
        if res is not None:
            self.last_val = {"recall_at_k": res["recall_at_k"], "per_layer": res["per_layer"]["recall_at_k"]}

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # the metrics of the epoch these weights are from: the export reads them back from best.ckpt
        checkpoint["moecast_val"] = getattr(self, "last_val", None)

    def run_metadata(self, dm: Any, info: dict[str, Any]) -> dict[str, Any]:
        """What the exported predictor records of its run: model, traces, split, settings, training."""
        m = dm.ts.meta.model
        return {
            "model_name": m.name_or_path,
            "trained_on": str(dm.ts.path),
            "split": split_metadata(dm),
            "hyper_parameters": {**dict(self.hparams), **dict(dm.hparams)},
            # None: read back from a checkpoint saved before any validation epoch
            "training": {**info, **(getattr(self, "last_val", None) or {})},
        }
