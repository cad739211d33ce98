"""``moecast predictors eval``: score a predictor on a TraceSet's split and print its metrics.

CHECKPOINT is a ``.safetensors`` predictor, or the name of one built on the spot from the
TraceSet's training split: any registered kind with a ``fit(ts, train_ids)`` classmethod
(``predictors/registry.py``; :func:`buildable`), a variant of one (:data:`VARIANTS`), or one of the
:data:`SPECIAL` specs; ``--save PATH`` keeps what was built as a checkpoint, with its split.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tqdm import tqdm

from moecast.errors import InputError
from moecast.jsonout import dumps

#: specs built from a folder rather than fitted on traces (the folder after the colon), with their help
SPECIAL = {
    "gate-reuse:MODEL_DIR": "router weights read from a model folder",
    "moe-beyond:DIR": "MoE-Beyond's published predictions, its ``predicted_csvs`` folder",
}
#: names that fit a registered kind with other settings: name -> (kind, keyword arguments of its fit)
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {"frequency-request": ("frequency", {"mode": "request"})}


def buildable() -> dict[str, str]:
    """name -> horizon of each predictor `predictors eval NAME` fits on the training side: every
    registered kind with a ``fit(ts, train_ids)`` classmethod (registry order), each followed by its
    :data:`VARIANTS`."""
    from moecast.predictors.registry import fitted_kinds

    out: dict[str, str] = {}
    for kind, cls in fitted_kinds().items():
        out[kind] = cls.horizon
        out.update({name: cls.horizon for name, (of, _) in VARIANTS.items() if of == kind})
    return out


def baseline_help() -> str:
    """The names `predictors eval` builds, for its help: ``frequency (statistical), ... or moe-beyond:DIR (...)``."""
    named = [f"{name} ({horizon})" for name, horizon in buildable().items()]
    named += [f"{spec} ({words})" for spec, words in SPECIAL.items()]
    return f"{', '.join(named[:-1])} or {named[-1]}"


def _special(spec: str) -> bool:
    return any(spec.startswith(s.split(":")[0] + ":") for s in SPECIAL)


def build_baseline(spec: str, ts: Any, train_ids: list[str]) -> Any:
    """The predictor ``spec`` names, built from ``ts``: a registered kind's (or a :data:`VARIANTS`
    name's) ``fit(ts, train_ids)``, or a :data:`SPECIAL` spec's folder read."""
    from moecast.predictors.baselines import GateReusePredictor, PublishedPredictions
    from moecast.predictors.registry import fits_from_traces, kind_class, kinds

    if spec.startswith("moe-beyond:"):
        return PublishedPredictions.from_folder(spec.split(":", 1)[1], ts)
    if spec.startswith("gate-reuse:"):
        ts.require("gate_inputs", "the gate-reuse baseline")
        return GateReusePredictor.from_model_dir(spec.split(":", 1)[1], ts)
    kind, settings = VARIANTS.get(spec, (spec, {}))
    cls = kind_class(kind) if kind in kinds() else None
    if cls is None or not fits_from_traces(cls):
        names = [*buildable(), *SPECIAL]
        raise InputError(f"{spec}: no such checkpoint file, and not a baseline name ({', '.join(names)})")
    return cls.fit(ts, train_ids, **settings)


def evaluate_predictor(
    pred: Any,
    ts: Any,
    requests: list[str],
    k: int | None = None,
    extra_k: tuple[int, ...] = (),
    progress: bool = True,
    groups_hint: dict[str, list[int]] | None = None,
    online_lr: float = 0.0,
) -> dict[str, Any]:
    """Metrics of ``pred`` over ``requests`` (see ``moecast.predictors.metrics``).

    Per-group figures use the predictor's own layer groups, else ``groups_hint``
    (for baselines, which have none: the groups LLaPor would detect, so the two compare).
    ``online_lr`` > 0: after scoring each request, one online update (PreScope §4.2.2) on its
    true routing, so request r is predicted by a model that has seen the requests before it."""
    from moecast.predictors.base import StreamingPredictor
    from moecast.predictors.metrics import MetricAccumulator

    if not requests:
        raise InputError(f"{ts.path}: the chosen split holds no requests; use --split all or more requests")
    missing = [f for f in getattr(pred, "needs", ()) if f != "token_id" and not ts.has(f)]
    if missing:
        ts.require(missing[0], f"predictor {pred.name}")
    # the protocol the live runtime asks (attach's online_update); errors name the keyword, which the
    # command line shows as its flag (moecast.errors.as_flags: --online-lr)
    if online_lr and not (isinstance(pred, StreamingPredictor) and pred.learns_online):
        raise InputError(
            f"online_lr={online_lr} asks for online updates, but the {pred.name} predictor has no online "
            "update (it does not learn online); LLaPor has one"
        )
    if online_lr and not all(hasattr(pred, m) for m in ("features", "score_features", "update")):
        raise InputError(
            f"online_lr={online_lr}: the {pred.name} predictor learns online token by token only; the "
            "request-by-request update here needs LLaPor's features, score_features and update"
        )
    m = ts.meta.model
    acc = MetricAccumulator(m.num_layers, m.num_experts, k or m.top_k, extra_k)
    for trace in tqdm(
        ts.iter_requests(requests),
        total=len(requests),
        desc=f"eval {pred.name}",
        disable=not progress,
        leave=False,
    ):
        if online_lr:  # score, then learn from the same features
            feats = pred.features(trace)
            acc.update(pred.score_features(feats), trace.topk_ids)
            pred.update(feats, trace.topk_ids, lr=online_lr)
        else:
            acc.update(pred.score_request(trace), trace.topk_ids)
    groups = getattr(pred, "groups", None) or getattr(pred, "meta", {}).get("groups") or groups_hint
    return acc.result(groups)


def detected_groups(ts: Any, train_ids: list[str], max_rows: int = 20000) -> dict[str, list[int]] | None:
    """The layer groups LLaPor training detects (PreScope §3.1) on this split, for baselines' per-group rows."""
    import numpy as np
    from moecast.predictors.llapor_groups import detect_groups, gate_cosine, routing_correlation

    if not train_ids:
        return None
    topk = ts.array("topk_ids", train_ids)
    sub = np.arange(0, len(topk), max(1, len(topk) // max_rows))
    cos = gate_cosine(ts.array("gate_inputs", train_ids)[sub]) if ts.has("gate_inputs") else None
    groups, _ = detect_groups(cos, routing_correlation(topk[sub], ts.num_experts), ts.num_layers)
    return groups


def evaluate(
    checkpoint: str | list[str],
    traces: str | None = None,
    split: str | None = None,
    val_fraction: float | None = None,
    test_fraction: float | None = None,
    seed: int | None = None,
    k: int | None = None,
    json: bool = False,
    save: str | None = None,
    max_requests: int | None = None,
    online_lr: float = 0.0,
) -> dict[str, Any] | list[dict[str, Any]]:
    """Evaluate a predictor checkpoint (or a named baseline) on a TraceSet and say which split it scored.

    Args:
        checkpoint: predictor .safetensors, or the name of a predictor built here (fitted on the
            training side): <BASELINES>; several are scored one after another
        traces: TraceSet directory
        split: test | val | train | all. Default: test (never trained or selected on) on the
            TraceSet the checkpoint was trained on, all requests on any other
        val_fraction: share of requests in val (default: the checkpoint's split, else 0.1)
        test_fraction: share of requests in test (default: the checkpoint's split, else 0.1)
        seed: split seed (default: the checkpoint's split, else 0)
        k: recall@k, 1 to the number of experts (default: the model's top-k)
        json: print one JSON object instead of a table
        save: with a name, also write what was built as a checkpoint here (with the split it was
            fitted on)
        max_requests: evaluate at most this many requests of the split
        online_lr: > 0 updates LLaPor online (PreScope §4.2.2) after each request, at this learning
            rate, with its training loss; the checkpoint file is left as it is
    """
    from moecast.collect.splits import SplitSpec
    from moecast.predictors.provenance import choose, split_record

    if not isinstance(checkpoint, str):
        if len(checkpoint) != 1:
            given = dict(split=split, val_fraction=val_fraction, test_fraction=test_fraction, seed=seed, k=k)
            return [
                evaluate(c, traces, **given, json=json, max_requests=max_requests, online_lr=online_lr)
                for c in checkpoint
            ]
        checkpoint = checkpoint[0]
    ts = _eval_traces(traces, online_lr, k)
    pred, record = _load_checkpoint(checkpoint, ts)
    chosen = choose(ts, record, split, val_fraction, test_fraction, seed, who=checkpoint)
    requests = chosen.requests[:max_requests] if max_requests else chosen.requests
    if pred is None:
        pred = build_baseline(checkpoint, ts, chosen.train)
        if save:
            if not _special(checkpoint):  # fitted on chosen.train: the split it scores, not fit's guess
                pred.meta["split"] = split_record(ts, chosen.train, SplitSpec.from_json(chosen.spec))
            pred.save(save)
    extra = tuple(x for x in (1, 2, 4) if x < ts.meta.model.top_k)
    hint = None if getattr(pred, "groups", None) else detected_groups(ts, chosen.train)
    res = evaluate_predictor(
        pred, ts, requests, k, extra_k=extra, progress=not json, groups_hint=hint, online_lr=online_lr
    )
    out = {
        "predictor": pred.label,
        "horizon": pred.horizon,
        "checkpoint": checkpoint,
        "traces": str(ts.path),
        **chosen.report(),
        "requests": len(requests),
        "online_lr": online_lr,
        **res,
    }
    if json:
        print(dumps(out))
    else:
        print(format_table(out, ts.meta.model.moe_layers))
    return out


def _eval_traces(traces: str | None, online_lr: float, k: int | None) -> Any:
    """The TraceSet to evaluate on, once --traces, --online-lr and --k are checked against it."""
    from moecast.collect.traceset import open_traces

    if not traces:
        raise InputError("moecast predictors eval needs --traces DIR (the TraceSet to evaluate on)")
    ts = open_traces(traces)
    if online_lr < 0:
        raise InputError(
            f"online_lr={online_lr} is negative; give a learning rate >= 0 (0: no online update)"
        )
    E = ts.meta.model.num_experts
    if k is not None and not (isinstance(k, int) and 1 <= k <= E):
        raise InputError(f"--k must be an integer from 1 to the model's {E} experts, not {k!r}")
    return ts


def _load_checkpoint(checkpoint: str, ts: Any) -> tuple[Any, Any]:
    """(the predictor loaded from a checkpoint file, else None for a baseline; what it was trained on)."""
    from moecast.predictors.provenance import trained_on
    from moecast.predictors.registry import load

    pred = None
    if Path(checkpoint).is_file():
        fp = ts.meta.model.fingerprint
        pred = load(checkpoint, fingerprint=fp, against=f"TraceSet {ts.path} ({ts.meta.model.name_or_path})")
    from moecast.predictors.provenance import TrainedOn

    record = None if pred is None else trained_on(pred)
    if pred is not None and record is None:
        record = TrainedOn()  # records nothing: scored whole, its figures said to be possibly in-sample
    if checkpoint.startswith("moe-beyond:"):
        # MoE-Beyond's own predictions, of a model trained on its own data: scored whole, as on a
        # TraceSet it never saw
        record = TrainedOn(traceset_id="moe-beyond")
    return pred, record


def remember(
    checkpoint: str,
    traces: str | None = None,
    out: str | None = None,
    requests: str = "train",
    ngrams: list[int] | None = None,
    max_postings: int = 32,
    weight: float = 1.0,
    forget: bool = False,
    json: bool = False,
) -> dict[str, Any]:
    """Give a LLaPor checkpoint a context memory built from a TraceSet (or rebuild or remove it).

    The memory (moecast.predictors.context_memory) holds the routes that the traces' tokens took
    after each context of ``ngrams`` tokens. LLaPor adds its votes to the network's scores for
    tokens whose context it has seen. The network's weights are copied unchanged, so no
    retraining is needed when new traffic is collected.

    Args:
        checkpoint: LLaPor .safetensors
        traces: TraceSet of the same model
        out: where to write the checkpoint with the memory (may be ``checkpoint`` itself)
        requests: train (the checkpoint's own training split of these traces, so that
            `moecast predictors eval` on its held-out split stays held out) | all (every request:
            held-out figures on these traces are then no longer held out)
        ngrams: context lengths to index (default 6 8 16 32); an empty list removes the memory
        max_postings: occurrences kept per context (the latest)
        weight: the votes' weight against the network's softmax (both sum to k per layer)
        forget: remove the checkpoint's memory (no --traces needed; as ``ngrams: []`` in a config)
        json: print one JSON object instead of a line
    """
    from moecast.collect.traceset import open_traces
    from moecast.predictors.context_memory import MemoryConfig, build
    from moecast.predictors.llapor import LLaPor
    from moecast.predictors.registry import load

    if forget and ngrams:
        raise InputError("--forget removes the memory and --ngrams builds one: give one of them")
    if not out or not (traces or forget):
        raise InputError(
            "moecast predictors remember needs --traces DIR and --out CKPT.safetensors (--forget needs only --out)"
        )
    if requests not in ("train", "all"):
        raise InputError(f"--requests must be train or all, not {requests!r}")
    ngrams = [] if forget else [6, 8, 16, 32] if ngrams is None else list(ngrams)
    ts = open_traces(traces) if traces else None
    if ts is None:  # removing a memory reads no traces, so there is no model to check the checkpoint against
        pred = load(checkpoint)
    else:
        pred = load(checkpoint, fingerprint=ts.meta.model.fingerprint, against=f"TraceSet {ts.path}")
    if not isinstance(pred, LLaPor):
        raise InputError(f"{checkpoint} is a {pred.name} checkpoint; a context memory goes with LLaPor only")
    if ngrams and ts is not None:  # only --forget (no ngrams) goes without traces
        cfg = MemoryConfig(tuple(ngrams), max_postings, weight)
        if requests == "train":
            from moecast.predictors.provenance import choose, trained_on

            ids = choose(ts, trained_on(pred), "train", who=checkpoint).requests
        else:
            ids = list(ts.request_ids)
        pred.memory = build(ts, ids, cfg, progress=True)
    else:
        pred.memory = None
    source = None if pred.memory is None else {"traces": str(ts.path), "requests": requests}
    path = pred.save(out, {"memory_from": source})
    res = {"checkpoint": str(path), "memory": None if pred.memory is None else pred.memory.metadata()}
    if json:
        print(dumps(res))
    elif pred.memory is None:
        print(f"wrote {path}: its context memory removed")
    else:
        print(
            f"wrote {path} with a context memory of {ts.path} ({requests} requests, contexts of {ngrams} tokens)"
        )
    return res


def calibrate(checkpoint: str, traces: str | None = None, json: bool = False) -> dict[str, Any]:
    """Fit the prefetch gate's calibration on a TraceSet and write it into the predictor's checkpoint.

    Under ``--policy prefetch-gated`` a late prefetch starts only where the predictor's probability of
    use pays for its bytes (moecast.runtime.core.gate). That probability comes from the predictor's
    scores by histogram binning (moecast.predictors.calibration), fitted here on the val side of the
    checkpoint's split of the TraceSet (tune on val, report test), which the replay would fit
    itself. ``moecast run`` reads it from the checkpoint; `moecast replay` uses it too. The checkpoint
    is rewritten atomically with its predictor unchanged; running this again replaces the calibration.

    Args:
        checkpoint: predictor .safetensors (rewritten in place)
        traces: TraceSet of the same model; its val side of the checkpoint's split is fitted on
        json: print one JSON object instead of a line
    """
    from moecast.collect.traceset import open_traces
    from moecast.predictors.calibration import fit, write
    from moecast.predictors.provenance import choose, trained_on
    from moecast.predictors.registry import load

    if not traces:
        raise InputError("moecast predictors calibrate needs --traces DIR (its val side is fitted on)")
    if not Path(checkpoint).is_file():
        raise InputError(f"{checkpoint}: no such checkpoint; the gate calibrates a predictor checkpoint file")
    ts = open_traces(traces)
    pred = load(checkpoint, fingerprint=ts.meta.model.fingerprint, against=f"TraceSet {ts.path}")
    chosen = choose(ts, trained_on(pred), "val", who=checkpoint)
    if not chosen.requests:
        raise InputError(
            f"{ts.path} holds no val request of {checkpoint}'s split; calibrate on a TraceSet whose split has a "
            "val side (the gate is tuned on val, never on test)"
        )
    cal = fit(pred, ts, chosen.requests)
    about = {"traces": str(ts.path), "traceset_id": ts.traceset_id, "side": "val"}
    write(checkpoint, cal, {**about, "requests": len(chosen.requests), "split": chosen.spec})
    res = {"checkpoint": str(checkpoint), **about, "requests": len(chosen.requests), "samples": cal.samples}
    if json:
        print(dumps(res))
    else:
        print(
            f"wrote {checkpoint}: the prefetch gate calibrated on the {res['requests']} val requests of {ts.path} "
            f"({cal.samples} predictions)"
        )
    return res


def format_table(res: dict[str, Any], moe_layers: list[int]) -> str:
    lines = [
        f"{res['predictor']} ({res['horizon']}) on {res['traces']} [{res['split']}: {res['requests']} requests, {res['tokens']} tokens]"
        + (f", updated online at lr {res['online_lr']:g} after each request" if res.get("online_lr") else ""),
        *(f"note: {n}" for n in res.get("split_notes") or []),
        f"{'scope':<14}{'recall@' + str(res['k']):>10}{'precision':>11}{'f1_micro':>10}{'f1_macro':>10}",
        f"{'all':<14}{res['recall_at_k']:>10.4f}{res['precision']:>11.4f}{res['f1_micro']:>10.4f}{res['f1_macro']:>10.4f}",
    ]
    for g, r in (res.get("per_group") or {}).items():
        lines.append(
            f"{'group ' + g:<14}{r['recall_at_k']:>10.4f}{r['precision']:>11.4f}{r['f1_micro']:>10.4f}{r['f1_macro']:>10.4f}"
        )
    extra = [
        f"recall@{key.split('_')[-1]} {v:.4f}"
        for key, v in res.items()
        if key.startswith("recall_at_") and key != "recall_at_k"
    ]
    if extra:
        lines.append(
            "also: "
            + ", ".join(extra)
            + f" (recall@x: share of the predicted x inside the true top-{res['k']}"
            + ("; recall@4 is PreScope Table 3's Top-4 accuracy)" if "recall_at_4" in res else ")")
        )
    per = res["per_layer"]["recall_at_k"]
    lines.append("per layer recall@k: " + " ".join(f"{moe_layers[i]}:{v:.3f}" for i, v in enumerate(per)))
    return "\n".join(lines)


_EVALUATE_DOC = evaluate.__doc__ or ""


def evaluate_doc() -> str:
    """``evaluate``'s docstring (its --help) naming what it builds as the registry holds it now, kinds
    registered after this module was imported included (as runtime/tiers/registry.py's tier_help)."""
    return _EVALUATE_DOC.replace("<BASELINES>", baseline_help())


# moecast.cli refreshes the docstring from it before printing --help; building the list imports every
# registered kind, which only --help should pay for
evaluate.help_doc = evaluate_doc  # type: ignore[attr-defined]
