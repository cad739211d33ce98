"""Which requests a checkpoint may be scored on: the split of the run that trained it.

A checkpoint records its split in its metadata (``split``: the :class:`SplitSpec`, the id of
the TraceSet it trained on and the sides' sizes). On that TraceSet (or one merged from it) the
held-out sides are the checkpoint's own: test is reported, val was used for selection. On any
other TraceSet no request was seen in training, so all of them are scored. A split that
disagrees with the recorded one would score training requests as held out, and is refused.

``split`` null says the predictor was fitted on no request (router weights read from a model):
every request is held out. A checkpoint that records no split (no ``split`` key, or one that names
requests but no split: :func:`split_record`'s ``requests`` form) is never taken for held out on a
TraceSet it may have been fitted on: its figures are said to be possibly in-sample.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moecast.collect.splits import SplitSpec

from moecast.errors import InputError

#: ``split.method`` of a checkpoint fitted on requests that are no split's train side (:func:`split_record`)
FITTED_REQUESTS = "requests"


def split_record(ts: Any, train_ids: list[str], spec: SplitSpec | None = None) -> dict[str, Any]:
    """The ``split`` a checkpoint fitted on ``train_ids`` of ``ts`` records: the one place it is built.

    Where the requests lie on the train side of ``spec`` (default: the default split) that split is
    recorded, and its val and test sides are held out (:meth:`Splits.metadata`, with the number of
    requests fitted on); otherwise only their TraceSet and count (method ``requests``), and no request
    of that TraceSet is taken for held out. A predictor fitted on no request records ``None`` instead.
    """
    spec = spec or SplitSpec()
    sides = ts.splits(spec.val_fraction, spec.test_fraction, spec.seed)
    if set(train_ids) <= set(sides.train):
        return {**sides.metadata(), "train_requests": len(train_ids)}
    return {"method": FITTED_REQUESTS, "traceset_id": ts.traceset_id, "train_requests": len(train_ids)}


@dataclass
class TrainedOn:
    """What a checkpoint says about the requests it trained on: a grouped split (``spec``), an earlier
    moecast's ungrouped one (``legacy``), no request at all (``nothing``: ``split`` recorded as null),
    or none of these (:attr:`unsplit`: it was fitted on requests no split records)."""

    spec: SplitSpec | None = None  # grouped train / val / test split
    legacy: dict[str, Any] | None = None  # ungrouped {val_fraction, seed} of an earlier moecast
    traceset_id: str | None = None
    path: str | None = None
    requests: int | None = None  # how many requests an unsplit record says it was fitted on
    nothing: bool = False  # fitted on no request (``split`` null): every request is held out

    @property
    def unsplit(self) -> bool:
        """Fitted on requests that no split records: none of them is known to be held out."""
        return self.spec is None and self.legacy is None and not self.nothing

    def same_traceset(self, ts: Any) -> bool:
        if self.traceset_id:
            return bool(ts.contains_traceset(self.traceset_id))
        return bool(self.path) and Path(self.path).resolve() == Path(ts.path).resolve()

    def other_traceset(self, ts: Any) -> bool:
        """Known to be fitted on another TraceSet than ``ts``: by its id only (a path proves nothing,
        the same traces may sit elsewhere)."""
        return bool(self.traceset_id) and not ts.contains_traceset(self.traceset_id)

    def describe(self) -> dict[str, Any] | None:
        if self.spec is not None:
            return self.spec.to_json()
        return None if self.legacy is None else {"method": "ungrouped (earlier moecast)", **self.legacy}


def record_from_meta(meta: Any) -> TrainedOn | None:
    """The training record in one checkpoint's metadata; None when it has none."""
    if not isinstance(meta, dict):
        return None
    if "split" in meta and meta["split"] is None:
        return TrainedOn(nothing=True, path=meta.get("trained_on"))
    if not (meta.get("split") or meta.get("trained_on")):
        return None
    split = meta.get("split") or {}
    spec = SplitSpec.from_json(split)
    legacy = None
    # an earlier moecast's ungrouped split is {val_fraction, seed} with no method; a header with no
    # split, or a split of another method, is no such thing (it would be scored on that split's val)
    if spec is None and "val_fraction" in split and "method" not in split:
        legacy = {"val_fraction": float(split["val_fraction"]), "seed": int(split.get("seed", 0))}
    count = split.get("train_requests") if spec is None and legacy is None else None
    return TrainedOn(spec, legacy, split.get("traceset_id"), meta.get("trained_on"), count)


def trained_on(pred: Any) -> TrainedOn | None:
    """The training record of a loaded checkpoint (a cascade: its EAM's); None when it has none."""
    for source in ("checkpoint_meta", "meta", "extra_meta"):
        record = record_from_meta(getattr(pred, source, None))
        if record is not None:
            return record
    eam = getattr(pred, "eam", None)
    return trained_on(eam) if eam is not None else None


def trained_on_file(path: str | Path) -> TrainedOn | None:
    """:func:`trained_on` from a checkpoint's header alone (no tensors read)."""
    from moecast.predictors.checkpoint import load_metadata

    meta = load_metadata(path)
    record = record_from_meta(meta)
    eam = (meta.get("files") or {}).get("eam")
    if record is None and meta.get("kind") == "cascade" and eam:
        p = Path(eam) if Path(eam).is_absolute() else Path(path).parent / eam
        return trained_on_file(p) if p.is_file() else None
    return record


@dataclass
class Chosen:
    """The requests to score, and how they were chosen (reported beside the figures)."""

    name: str  # test | val | train | all
    requests: list[str]
    train: list[str]  # the training side (baselines built on the spot count on it)
    spec: dict[str, Any] | None
    checkpoint_traceset: bool
    notes: list[str] = field(default_factory=list)

    def report(self) -> dict[str, Any]:
        return {
            "split": self.name,
            "split_spec": self.spec,
            "checkpoint_traceset": self.checkpoint_traceset,
            "split_notes": self.notes,
        }


def _disagrees(
    spec: SplitSpec, val_fraction: float | None, test_fraction: float | None, seed: int | None
) -> str:
    given = {"val_fraction": val_fraction, "test_fraction": test_fraction, "seed": seed}
    bad = [f"{k} {v:g}" for k, v in given.items() if v is not None and v != getattr(spec, k)]
    return ", ".join(bad)


def choose(
    ts: Any,
    record: TrainedOn | None,
    split: str | None = None,
    val_fraction: float | None = None,
    test_fraction: float | None = None,
    seed: int | None = None,
    who: str = "the checkpoint",
) -> Chosen:
    """The requests of ``ts`` to score ``split`` on (None: test on the checkpoint's own TraceSet,
    all elsewhere). ``record`` None means a predictor built here from ``ts`` (a baseline)."""
    if split not in (None, "test", "val", "train", "all"):
        raise InputError(f"--split must be test, val, train or all, not {split!r}")
    # fitted on no request: every TraceSet is one it never saw
    same = record is None or (not record.nothing and record.same_traceset(ts))
    notes: list[str] = []
    if record is not None and record.legacy is not None and same:
        return _legacy(ts, record, split, val_fraction, seed, who)
    if record is not None and record.unsplit and not record.other_traceset(ts):
        return _unsplit(ts, record, split, val_fraction, test_fraction, seed, who)
    if record is not None and record.spec is not None and same:
        bad = _disagrees(record.spec, val_fraction, test_fraction, seed)
        if bad:
            raise InputError(
                f"{bad} disagrees with the split {who} was trained on ({record.spec.to_json()}): its held-out "
                "requests would include training ones; leave the split options out"
            )
        spec = record.spec
    else:
        base = record.spec if record is not None and record.spec is not None else SplitSpec()
        spec = SplitSpec(
            base.val_fraction if val_fraction is None else val_fraction,
            base.test_fraction if test_fraction is None else test_fraction,
            base.seed if seed is None else seed,
        )
    name = split or ("test" if same else "all")
    if not same and name != "all":
        where = (
            "was fitted on no request"
            if record is not None and record.nothing
            else "was trained on another TraceSet"
        )
        notes.append(f"{who} {where}: {name} is this TraceSet's {name} side")
    if name == "all" and not same:
        return Chosen("all", list(ts.request_ids), [], None, False, ["none of them was trained on"])
    sides = ts.splits(spec.val_fraction, spec.test_fraction, spec.seed)
    return Chosen(name, sides[name], sides.train, spec.to_json(), same, notes)


def in_sample_note(record: TrainedOn, who: str) -> str:
    """Why an unsplit checkpoint's figures on a TraceSet it may have been fitted on may be in-sample."""
    if record.traceset_id and record.requests is not None:
        return (
            f"{who} was fitted on {record.requests} requests of this TraceSet that are no split's train "
            "side, so these figures are in part in-sample"
        )
    return (
        f"{who} records no training split, so these figures may be in-sample (they may include "
        "requests it was fitted on)"
    )


def _unsplit(
    ts: Any,
    record: TrainedOn,
    split: str | None,
    val_fraction: float | None,
    test_fraction: float | None,
    seed: int | None,
    who: str,
) -> Chosen:
    """A checkpoint fitted on requests no split records: every request by default, any side on
    request, each said to be possibly in-sample (nothing here is known to be held out)."""
    spec = SplitSpec(
        SplitSpec.val_fraction if val_fraction is None else val_fraction,
        SplitSpec.test_fraction if test_fraction is None else test_fraction,
        SplitSpec.seed if seed is None else seed,
    )
    sides = ts.splits(spec.val_fraction, spec.test_fraction, spec.seed)
    name = split or "all"
    chosen = list(ts.request_ids) if name == "all" else sides[name]
    return Chosen(
        name,
        chosen,
        sides.train,
        None if name == "all" else spec.to_json(),
        record.same_traceset(ts),
        [in_sample_note(record, who)],
    )


def _legacy(
    ts: Any, record: TrainedOn, split: str | None, val_fraction: float | None, seed: int | None, who: str
) -> Chosen:
    """A checkpoint of an earlier moecast: its ungrouped train / val split, and no test side."""
    legacy = record.legacy or {"val_fraction": 0.1, "seed": 0}
    vf = legacy["val_fraction"] if val_fraction is None else val_fraction
    sd = legacy["seed"] if seed is None else seed
    if split == "test":
        raise InputError(
            f"{who} recorded no test split (an earlier moecast trained it with train / val only); "
            "retrain it, or score --split val"
        )
    train, val = ts.split(vf, sd)
    name = split or "val"
    chosen = {"val": val, "train": train, "all": list(ts.request_ids)}[name]
    note = (
        f"{who} was trained with the ungrouped split of an earlier moecast: its val side was also used "
        "for selection and may hold copies of training prompts"
    )
    spec = {"method": "ungrouped (earlier moecast)", "val_fraction": vf, "seed": sd}
    return Chosen(name, chosen, train, spec, True, [note])


def holdout(ts: Any, which: str | float, checkpoints: list[str]) -> tuple[list[str], list[str]]:
    """(held-out requests, training requests) of ``ts`` for ``replay --holdout``: the test (or
    val) side of the split the checkpoints were trained on, which must be one split. ``which``
    is test, val, or a number: the test share, refused where it disagrees with a checkpoint's."""
    name, share = _holdout_arg(which)
    # a checkpoint with no record at all is as unsplit as one with only its TraceSet: its held-out
    # requests are unknown
    records = [(c, trained_on_file(c) or TrainedOn()) for c in checkpoints if c and Path(c).is_file()]
    old = [c for c, r in records if r.legacy is not None]
    if old:
        raise InputError(
            f"{old[0]} was trained with the ungrouped split of an earlier moecast, which has no test "
            "side and may hold copies of training prompts on its held-out side; retrain it to replay "
            "its held-out requests"
        )
    unsplit = [c for c, r in records if r.unsplit and not r.other_traceset(ts)]
    if unsplit:
        raise InputError(
            f"{unsplit[0]} records no training split, so which requests of {ts.path} it was fitted on is "
            "unknown and none can be replayed as held out; refit it on a split's train side (`moecast "
            "predictors eval KIND --traces T --save CKPT` records the split), or replay without --holdout"
        )
    specs = {c: r.spec for c, r in records if r.spec is not None}
    if len(set(specs.values())) > 1:
        listed = "; ".join(f"{c}: {s.to_json()}" for c, s in specs.items())
        raise InputError(
            f"the checkpoints were trained on different splits ({listed}); the held-out requests of one "
            "are training requests of another, so no one --holdout fits them all"
        )
    spec = next(iter(specs.values()), None)
    if spec is not None and share is not None and share != spec.test_fraction:
        raise InputError(
            f"--holdout {share:g} disagrees with the split {next(iter(specs))} was trained on "
            f"(test_fraction {spec.test_fraction:g}); give --holdout test"
        )
    if spec is None:
        spec = SplitSpec(test_fraction=0.1 if share is None else share)
    sides = ts.splits(spec.val_fraction, spec.test_fraction, spec.seed)
    if not sides[name]:
        raise InputError(f"--holdout {which} leaves no held-out requests in {ts.path}")
    return sides[name], sides.train


class InSampleWarning(UserWarning):
    """A checkpoint is scored on requests it trained or was selected on."""


def warn_in_sample(ts: Any, checkpoints: list[str | None], replayed: list[str]) -> None:
    """Say (a warning, one line) where ``replayed`` holds requests a checkpoint trained on or was
    selected on (its split's train and val sides, on the TraceSet it trained on): a replay without
    ``--holdout`` scores them in-sample."""
    import warnings

    for c in (c for c in checkpoints if c and Path(c).is_file()):
        r = trained_on_file(c)
        if r is None or (r.unsplit and not r.other_traceset(ts)):
            # nothing says which requests it was fitted on: any replayed one may be among them
            note = in_sample_note(r or TrainedOn(), c).replace("these figures", "the replay's figures")
            warnings.warn(InSampleWarning(note), stacklevel=2)
            continue
        if r.spec is None or not r.same_traceset(ts):
            continue
        sides = ts.splits(r.spec.val_fraction, r.spec.test_fraction, r.spec.seed)
        seen = len({*sides.train, *sides.val} & set(replayed))
        if seen:
            warnings.warn(
                InSampleWarning(
                    f"{seen} of the {len(replayed)} replayed requests are {c}'s training or validation "
                    "requests (in-sample figures); --holdout test replays its test side only"
                ),
                stacklevel=2,
            )


def _holdout_arg(which: str | float) -> tuple[str, float | None]:
    if which in ("test", "val"):
        return str(which), None
    try:
        share = float(which)
    except (TypeError, ValueError):
        share = float("nan")
    if not 0 < share < 1:
        raise InputError(f"--holdout must be test, val or the test share (e.g. 0.1), not {which!r}")
    return "test", share
