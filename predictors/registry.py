"""``load(path)``: open any moecast predictor checkpoint by its ``kind``, without Lightning."""

from __future__ import annotations

import importlib
from pathlib import Path

from moecast.predictors.base import Predictor
from moecast.predictors.calibration import Calibration
from moecast.predictors.checkpoint import CheckpointError, check_fingerprint, load_raw

# checkpoint kind -> "module:Class"; each class has ``from_checkpoint(tensors, meta, path)``.
KINDS: dict[str, str] = {
    "llapor": "moecast.predictors.llapor:LLaPor",
    "sequence": "moecast.predictors.sequence:SequencePredictor",
    "frequency": "moecast.predictors.baselines:FrequencyPredictor",
    "hot": "moecast.predictors.baselines:HotTablePlanner",
    "gate-reuse": "moecast.predictors.baselines:GateReusePredictor",
    "moe-infinity": "moecast.predictors.baselines:ActivationMatrixPredictor",
    "cooccurrence": "moecast.predictors.baselines:CooccurrencePredictor",
    "eam": "moecast.predictors.eam:EAM",
    "eap": "moecast.predictors.eap:EAP",
    "cascade": "moecast.predictors.cascade:Cascade",
}


def register(kind: str, target: str) -> None:
    KINDS[kind] = target


def load(path: str | Path, fingerprint: str | None = None, against: str = "this model") -> Predictor:
    """Load a predictor checkpoint; with ``fingerprint`` refuse one trained for another model."""
    tensors, meta = load_raw(path)
    kind = meta["kind"]
    if kind not in KINDS:
        raise CheckpointError(
            f"{path}: unknown predictor kind {kind!r}; known kinds: {', '.join(sorted(KINDS))}"
        )
    if fingerprint is not None:
        check_fingerprint(meta, fingerprint, against, path)
    module, cls = KINDS[kind].split(":")
    header = dict(meta)
    # the prefetch gate's calibration (moecast.predictors.calibration) is the checkpoint's, not the
    # predictor's: its loader sees its own tensors only
    calibration = Calibration.take(tensors, meta)
    pred = getattr(importlib.import_module(module), cls).from_checkpoint(tensors, meta, Path(path))
    # the header as written: where and on which split it was trained (moecast.predictors.provenance)
    pred.checkpoint_meta = header
    pred.calibration = calibration
    return pred
