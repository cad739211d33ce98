"""``load(path)``: open any moecast predictor checkpoint by its ``kind``, without Lightning.

``KINDS`` maps each checkpoint kind to its class; a package of its own adds kinds through the
``moecast.predictors`` entry-point group (:func:`kinds`), so the ``moecast`` command loads them with no
edit here. A kind whose class has a ``fit(ts, train_ids)`` classmethod is also built by `moecast
predictors eval KIND --traces T --save CKPT` (:func:`fitted_kinds`).
"""

from __future__ import annotations

import importlib
import inspect
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


#: the entry-point group a package declares its kinds in, ``name = "module:Class"`` (pyproject.toml:
#: ``[project.entry-points."moecast.predictors"]``)
ENTRY_POINTS = "moecast.predictors"


def kinds() -> dict[str, str]:
    """Every kind this process can load: the installed packages' entry points, then :data:`KINDS`
    (moecast's own and those :func:`register`-ed), which win where a name is both."""
    from importlib.metadata import entry_points

    return {**KINDS, **{ep.name: ep.value for ep in entry_points(group=ENTRY_POINTS) if ep.name not in KINDS}}


def register(kind: str, target: str) -> None:
    """Make checkpoints of ``kind`` loadable: ``target`` is ``"module:Class"``, a class whose ``name`` is
    ``kind`` and which has ``from_checkpoint(tensors, meta, path)`` (docs/adding-a-predictor.md).

    It acts in this process only (a test, a script that then calls ``moecast.cli.run``); for the
    ``moecast`` command, declare it in your package's ``moecast.predictors`` entry points
    (:data:`ENTRY_POINTS`). With a
    ``fit(ts, train_ids)`` classmethod the kind is also built by `moecast predictors eval KIND --save`.
    """
    KINDS[kind] = target


def kind_class(kind: str) -> type[Predictor]:
    """The class registered for ``kind`` (its module imported now)."""
    module, cls = kinds()[kind].split(":")
    return getattr(importlib.import_module(module), cls)


def fits_from_traces(cls: type) -> bool:
    """Whether ``cls`` has a ``fit(ts, train_ids)`` classmethod (more parameters only with defaults)."""
    if not isinstance(inspect.getattr_static(cls, "fit", None), classmethod):
        return False
    try:
        inspect.signature(cls.fit).bind(None, [])
    except TypeError:
        return False
    return True


def fitted_kinds() -> dict[str, type[Predictor]]:
    """kind -> class of every registered kind fitted from traces (:func:`fits_from_traces`), in
    registration order; imports each registered class."""
    classes = {kind: kind_class(kind) for kind in kinds()}
    return {kind: cls for kind, cls in classes.items() if fits_from_traces(cls)}


def load(path: str | Path, fingerprint: str | None = None, against: str = "this model") -> Predictor:
    """Load a predictor checkpoint; with ``fingerprint`` refuse one trained for another model."""
    tensors, meta = load_raw(path)
    kind, known = meta["kind"], kinds()
    if kind not in known:
        raise CheckpointError(
            f"{path}: unknown predictor kind {kind!r}; known kinds: {', '.join(sorted(known))} (a kind of "
            f"another package loads once that package is installed: its {ENTRY_POINTS!r} entry points)"
        )
    if fingerprint is not None:
        check_fingerprint(meta, fingerprint, against, path)
    header = dict(meta)
    # the prefetch gate's calibration (moecast.predictors.calibration) is the checkpoint's, not the
    # predictor's: its loader sees its own tensors only
    calibration = Calibration.take(tensors, meta)
    pred = kind_class(kind).from_checkpoint(tensors, meta, Path(path))
    # the header as written: where and on which split it was trained (moecast.predictors.provenance)
    pred.checkpoint_meta = header
    pred.calibration = calibration
    return pred
