"""CLI functions ``moecast replay`` and ``moecast compare`` (mapped in moecast/cli.py)."""

from __future__ import annotations

import csv
import io
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from moecast.runtime.core.policy import POLICIES, with_policies
from moecast.runtime.core.spec import DEFAULT
from moecast.runtime.replay.engine import ReplayConfig, ReplayResult
from moecast.runtime.tiers.precision import expert_setting

from moecast.errors import InputError


def _fmt(v: object) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4f}"
    return str(v)


def replay(
    traces: str = "",
    policy: str = DEFAULT.policy,
    capacity: str = str(DEFAULT.capacity),
    cold: bool = ReplayConfig.cold,
    shared: bool = ReplayConfig.shared,
    predictor: str | None = None,
    planner: str | None = None,
    plan_weight: float = ReplayConfig.plan_weight,
    hardware: str | None = DEFAULT.hardware,
    alpha: float | None = DEFAULT.alpha,
    predictor_ms: float | None = DEFAULT.predictor_ms,
    batch_size: int = ReplayConfig.batch_size,
    holdout: str | None = None,
    expert_dtype: str = DEFAULT.expert_dtype,
    group_size: int = DEFAULT.group_size,
    json: bool = False,
) -> None:
    """Replay a TraceSet through one runtime configuration and print the metrics.

    Policies: <POLICY_HELP>.

    Args:
        traces: TraceSet directory.
        policy: one of <POLICY_NAMES>.
        capacity: per-layer cache size: a fraction of the experts (0.25), whole experts (6), or bytes (512MB).
        cold: start every request (group of --batch-size requests) with an empty cache; default: caches persist (stream).
        shared: one cache for all layers (capacity x layers experts) instead of one per layer.
        predictor: none, oracle (future knowledge: the routing that will happen, an upper bound), or a
            predictor checkpoint (.safetensors) that drives prefetching; null: the policy's own (oracle,
            i.e. future knowledge, for <PREFETCHING>; none for the others).
        planner: a prompt-ahead predictor checkpoint (EAM, EAP, cascade), or hot (the training requests'
            hot-expert table as the plan, the baseline a planner must beat): preloads each request's
            planned experts and is a prefetch prior.
        plan_weight: weight of the plan as a log-linear prior on --predictor's scores (0: preload only).
        hardware: hardware profile name (configs/hardware) or YAML path; default: this machine's
            (``moecast profile`` writes ``local``), else prescope-a100-pcie4, as ``moecast run``.
        alpha: SMoE substitution threshold (policy smoe; default 0.3, as in ``moecast run``); 0 leaves
            routing unchanged. Policies that do not substitute take none.
        predictor_ms: the predictor's latency per layer (ms), charged before its prefetch may start;
            default: a figure the checkpoint's header carries (``predictor_ms``), else the hardware
            profile's, which ``moecast profile --predictor CKPT`` times for that checkpoint on this machine.
        batch_size: decode batch: requests interleaved per step.
        holdout: replay only held-out requests: test (or val) of the split that --predictor and
            --planner were trained on (``TraceSet.splits``; the default split without a checkpoint);
            a number is the test share, refused where it disagrees with a checkpoint's split.
        expert_dtype: precision of the slow tier's experts (as ``moecast run --expert-dtype``): model, int8,
            int4 or int4-gN; the link moves that precision's bytes. A capacity in bytes counts what a slot holds:
            the precision's bytes where experts compute on the CPU (a profile's fast_tier: cpu), the
            model's where a device dequantizes them into its slots (fast_tier: device). Two copies:
            mixed (model+int4), or HIGH+LOW such as int8+int4 or model+int4-g64: a demand miss reads the
            low copy, the link window lands as many prefetches as fit at the low copy and turns the most
            confident into high ones with the time left, and idle link time upgrades resident low
            copies (a capacity in bytes counts the high copy).
        group_size: int4's group along each matrix's input dimension (32, 64, 128 or 256).
        json: print one JSON object instead of a table.
    """
    from moecast.collect.traceset import TraceSet
    from moecast.runtime.replay import engine

    expert_setting(expert_dtype, group_size)  # as run and compare take it (two copies of one dtype refused)
    _need_traces(traces)
    requests, hot_from = _held_out(TraceSet(traces), holdout, [predictor, planner])
    cfg = ReplayConfig(
        policy=policy,
        capacity=capacity,
        cold=cold,
        shared=shared,
        predictor=predictor,
        planner=planner,
        plan_weight=plan_weight,
        hardware=hardware,
        alpha=alpha,
        predictor_ms=predictor_ms,
        batch_size=batch_size,
        requests=requests,
        hot_requests=hot_from,
        progress=not json,
        expert_dtype=expert_dtype,
        group_size=group_size,
    )
    res = engine.replay(traces, cfg)
    if json:
        print(_json_line(res))
        return
    _print_result(res, predictor_given=predictor is not None)


def _held_out(
    ts, holdout: str | float | None, checkpoints: list[str | None]
) -> tuple[list[str] | None, list[str] | None]:
    """(requests to replay, requests the hot table counts on) for --holdout; (None, None) without it,
    and a warning where a checkpoint trained or was selected on some of them (every request replayed)."""
    if holdout is None:
        from moecast.predictors.provenance import warn_in_sample

        warn_in_sample(ts, checkpoints, list(ts.request_ids))
        return None, None
    from moecast.predictors.provenance import holdout as split_holdout

    return split_holdout(ts, holdout, [c for c in checkpoints if c])


#: a shipped profile whose link leaves a layer's prefetches room (NVLink-C2C)
FAST_LINK = "gh200-nvlink-c2c"


def _check_checkpoint(name: str, ts: Any) -> None:
    """Refuse a checkpoint that is missing, unreadable or made for another model than ``ts``'s, from its
    header alone (a `compare` would find out only at its cell, after the cells before it ran)."""
    if name in ("none", "oracle", "hot"):
        return
    from moecast.predictors.checkpoint import (
        CheckpointError,
        check_fingerprint,
        load_metadata,
        missing_checkpoint,
    )

    if not Path(name).is_file():
        raise CheckpointError(missing_checkpoint(name))
    check_fingerprint(load_metadata(name), ts.meta.model.fingerprint, f"TraceSet {ts.path}", name)


def _need_traces(traces: str) -> None:
    if not traces:
        raise InputError(
            "give the TraceSet to replay with --traces PATH (written by `moecast collect` or `moecast import`)"
        )


def _json_line(res: ReplayResult) -> str:
    from moecast.jsonout import dumps

    # strict: an absent link's layer times are infinite, an undefined rate NaN
    return dumps(res.to_json())


def _print_result(res: ReplayResult, predictor_given: bool = True) -> None:
    d = res.to_json()
    keys = [
        "policy",
        "predictor",
        "mode",
        "capacity",
        "shared",
        "batch_size",
        "hardware",
        "expert_dtype",
        "expert_bytes",
        "hit_rate",
        "decode_hit_rate",
        "prefetch_accuracy",
        "substitution_rate",
        "cpu_experts",
        "loads",
        "bytes_moved",
        "mb_per_token",
        "wasted_mb_per_token",
        "low_share",
        "upgrades",
        "gate_refused",
        "modeled_tpot_ms",
        "modeled_tpot_ms_with_preload",
        "tpot_basis",
        "predictor_ms",
        "requests",
        "tokens",
        "wall_s",
    ]
    width = max(len(k) for k in keys)
    for k in keys:
        print(f"{k:<{width}}  {_fmt(d[k])}")
    print("hit rate per layer: " + " ".join(f"{h:.3f}" for h in res.hit_rate_per_layer))
    if d.get("hot_table_from"):
        print(f"hot-expert table counted on {d['hot_table_from']}")
    if d["modeled_tpot_ms_with_preload"] is not None:
        print(
            f"modeled_tpot_ms leaves out the hot-expert table's preload ({d['preload_ms']:.2f} ms of transfers "
            "at each cache start); modeled_tpot_ms_with_preload charges it"
        )
    # a predictor that prefetches (under static it is the table the policy pins, and is charged no latency)
    prefetcher = d["predictor"] not in (None, "none") and d["predictor_ms_from"] != "no predictor"
    if prefetcher:
        print(f"predictor latency {d['predictor_ms']:.4f} ms per layer, from {d['predictor_ms_from']}")
    if d["mb_per_token_by_copy"]:
        print(
            "MB per token by copy: " + ", ".join(f"{k} {v:.2f}" for k, v in d["mb_per_token_by_copy"].items())
        )
    if d.get("gate_calibrated_on"):
        print(f"prefetch gate calibrated on {d['gate_calibrated_on']}")
    if prefetcher and not d["prefetches_landed"]:
        faster = "" if d["hardware"] == FAST_LINK else f"; compare --hardware {FAST_LINK}"
        print(
            f"note: no prefetch landed, so the predictor changed nothing here. Either it asked for no expert "
            "that was not resident already (under LRU a predictor of the last token's experts asks for none), "
            "or none fitted: a prefetch may not delay a layer's own loads (SMoE), so it lands only if a "
            f"transfer fits in the link time a layer leaves free, which under {d['hardware']} may never "
            f"happen{faster}"
        )
    if not predictor_given and d["predictor"] == "oracle":
        # the prefetching policies default to the oracle, so their numbers are an upper bound the user
        # did not ask for; say so next to the table rather than only in --help
        print(
            "note: predictor oracle (future knowledge): the policy's default; pass --predictor CKPT or none"
        )


def _words(values: Sequence[str], commas: bool = True) -> list[str]:
    """The non-empty items of a list option; a bare string is one item, not its letters. ``commas``: an
    item ``lru,lfu`` is two (names and numbers hold no comma; a path may, so predictors pass False)."""
    items = [str(v) for v in ([values] if isinstance(values, str) else values)]
    if commas:
        items = [w for v in items for w in v.split(",")]
    return [w.strip() for w in items if w.strip()]


# the columns of compare's table.md and table.csv
COMPARE_COLUMNS = [
    "policy",
    "predictor",
    "planner",
    "capacity",
    "capacity_fraction",
    "mode",
    "expert_dtype",
    "hit_rate",
    "decode_hit_rate",
    "prefetch_accuracy",
    "substitution_rate",
    "cpu_experts",
    "bytes_moved",
    "mb_per_token",
    "wasted_mb_per_token",
    "low_share",
    "modeled_tpot_ms",
    "modeled_tpot_ms_with_preload",
    "tpot_basis",
]


def compare(
    traces: str = "",
    policies: Sequence[str] = ("lru", "lfu", "static", "belady", "presched"),
    predictors: Sequence[str] = ("none",),
    capacities: Sequence[str] = ("0.1", "0.25", "0.5"),
    planners: Sequence[str] = ("none",),
    plan_weight: float = ReplayConfig.plan_weight,
    holdout: str | None = None,
    out: str = "compare",
    cold: bool = ReplayConfig.cold,
    shared: bool = ReplayConfig.shared,
    hardware: str | None = DEFAULT.hardware,
    alpha: float | None = DEFAULT.alpha,
    predictor_ms: float | None = DEFAULT.predictor_ms,
    batch_size: int = ReplayConfig.batch_size,
    expert_dtypes: Sequence[str] = (DEFAULT.expert_dtype,),
    group_size: int = DEFAULT.group_size,
    wandb: bool = True,
    json: bool = False,
) -> None:
    """Replay every (policy, predictor, capacity) cell; write table.md, table.csv, plot.png and wandb runs.

    Policies that never prefetch (<NOT_PREFETCHING>) are run once per capacity with
    predictor none; the others once per predictor. One wandb run per cell, grouped "<traces>/compare".

    Args:
        traces: TraceSet directory.
        policies: policy names (see `moecast replay --help`).
        predictors: none (no predictor, also for <PREFETCHING>, whose
            `moecast replay` default is the oracle), oracle (future knowledge: an upper bound), checkpoint
            paths. Policies that never prefetch run with none only.
        capacities: capacities (fractions, experts or bytes); those that hold fewer experts
            than the model's top-k are skipped with a note.
        planners: none, hot and/or prompt-ahead checkpoints (EAM, EAP, cascade); each
            planner preloads its plan per request (under static it is pinned in the table's place) and
            runs with every policy except belady. hot (the training requests' hot-expert table as the
            plan) is added beside any checkpoint planner, so each is judged against what costs nothing.
        plan_weight: weight of a plan as a log-linear prior on the predictor's scores (0: preload only).
        holdout: replay only held-out requests: test (or val) of the split the checkpoints were trained
            on, which must be one split (a number is the test share; default: every request).
        out: output directory (created; must not be a file).
        cold: caches start empty per request; default stream.
        shared: one cache for all layers.
        hardware: hardware profile name or YAML path; default: this machine's (``moecast profile``), else
            prescope-a100-pcie4.
        alpha: substitution threshold for policy smoe (default 0.3, as in ``moecast replay`` and ``run``).
        predictor_ms: the predictor's latency per layer (ms) before its prefetch may start; default: a
            figure each checkpoint's header carries, else the hardware profile's (``moecast profile
            --predictor CKPT`` times it).
        batch_size: decode batch size.
        expert_dtypes: precisions of the slow tier's experts (model, int8, int4, or two copies: mixed,
            int8+int4, ...; see `moecast replay --help`): each cell runs at each.
        group_size: int4's group along each matrix's input dimension (32, 64, 128 or 256).
        wandb: log one offline wandb run per cell.
        json: print one JSON object per cell instead of the table.
    """
    from moecast.collect.traceset import TraceSet
    from moecast.runtime.replay import engine

    dtypes = _words(expert_dtypes) or [DEFAULT.expert_dtype]
    for dt in dtypes:  # each precision checked before any replay runs
        expert_setting(dt, group_size)
    _need_traces(traces)
    pols, preds, caps, plans = _compare_lists(policies, predictors, capacities, planners)
    # every check that needs no replay runs before out/ is created or a replay starts (they take
    # minutes), so a bad argument leaves nothing behind
    cells = _cells(pols, preds, plans)
    outdir = Path(out)
    ts = TraceSet(traces)
    for name in preds + plans:
        _check_checkpoint(name, ts)
    caps = _usable_capacities(caps, ts, json)
    checkpoints = [c for c in preds + plans if c not in ("none", "oracle", "hot")]
    requests, hot_from = _held_out(ts, holdout, checkpoints)
    _make_out(out)  # before any replay runs (they take minutes)
    rows: list[dict] = []
    from tqdm import tqdm

    # the capacities of one (policy, predictor, planner) cell run as lanes of one vectorised pass
    for (p, pr, pl), dt in tqdm([(c, d) for c in cells for d in dtypes], desc="compare", disable=json):
        cfg = ReplayConfig(
            policy=p,
            cold=cold,
            shared=shared,
            predictor=pr,
            planner=None if pl == "none" else pl,
            plan_weight=plan_weight,
            hardware=hardware,
            alpha=alpha if POLICIES[p].substitutes else None,
            predictor_ms=predictor_ms,
            batch_size=batch_size,
            requests=requests,
            hot_requests=hot_from,
            expert_dtype=dt,
            group_size=group_size,
        )
        for res in engine.replay_capacities(ts, cfg, caps):
            row = {
                **res.to_json(),
                "predictor": _stem(pr, ("none", "oracle")),
                "planner": _stem(pl, ("none",)),
            }
            rows.append(row)
            if json:
                print(_json_line(res))
            if wandb:
                _log_wandb(row, ts, outdir)
    _write_compare(rows, outdir, ts.path, cold, json)


def _compare_lists(
    policies: Sequence[str], predictors: Sequence[str], capacities: Sequence[str], planners: Sequence[str]
) -> tuple[list[str], list[str], list[str], list[str]]:
    """compare's policies, predictors, capacities and planners as checked lists (hot joins any
    checkpoint planner, so each is judged against what costs nothing)."""
    pols = _words(policies)
    if not pols:
        raise InputError(f"--policies is empty; give one or more of {', '.join(POLICIES)}")
    for p in pols:
        if p not in POLICIES:
            raise InputError(f"unknown policy {p!r}; choose from {', '.join(POLICIES)}")
    caps = _words(capacities)
    if not caps:
        raise InputError("--capacities is empty; give e.g. --capacities 0.1 0.25 0.5")
    plans = _words(planners) or ["none"]
    if any(p not in ("none", "hot") for p in plans) and "hot" not in plans:
        plans.append("hot")
    return pols, _words(predictors, commas=False) or ["none"], caps, plans


def _make_out(out: str) -> None:
    """Create compare's output directory ``out``, or say in one line why it cannot be."""
    try:
        Path(out).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InputError(
            f"--out {out}: {exc.strerror} ({exc.filename}); give a directory for table.md, table.csv and "
            "plot.png, or a path that can be created"
        ) from exc


def _stem(name: str, keep: tuple[str, ...]) -> str:
    """A checkpoint's name as a table shows it (its file's stem), or ``name`` itself where it is a keyword."""
    return name if name in keep else Path(name).stem


def _write_compare(rows: list[dict], outdir: Path, traces: Path, cold: bool, json: bool) -> None:
    """table.csv, table.md and plot.png of a compare (atomically), and the table on stdout unless --json."""
    from moecast.collect.traceset import atomic_write_bytes

    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=COMPARE_COLUMNS, extrasaction="ignore")
    w.writeheader()
    w.writerows(rows)
    atomic_write_bytes(outdir / "table.csv", buf.getvalue().encode())
    md = ["| " + " | ".join(COMPARE_COLUMNS) + " |", "|" + "---|" * len(COMPARE_COLUMNS)]
    md += ["| " + " | ".join(_fmt(r[c]) for c in COMPARE_COLUMNS) + " |" for r in rows]
    note = f"\nTraces: {traces}; mode: {'cold per request' if cold else 'stream'}; hardware: {rows[0]['hardware']}; TPOT basis: {rows[0]['tpot_basis']}; modeled_tpot_ms leaves out a hot-expert table's preload, modeled_tpot_ms_with_preload charges its transfers at every cache start\n"
    atomic_write_bytes(outdir / "table.md", ("\n".join(md) + "\n" + note).encode())
    _plot(rows, outdir / "plot.png")
    if not json:
        print("\n".join(md))
        print(note.strip())
        print(f"wrote {outdir / 'table.md'}, {outdir / 'table.csv'}, {outdir / 'plot.png'}")


def _cells(pols: list[str], preds: list[str], plans: list[str]) -> list[tuple[str, str, str]]:
    """The (policy, predictor, planner) runs of a compare; raises if none is left."""
    cells: list[tuple[str, str, str]] = []
    for p in pols:
        spec = POLICIES[p]
        for pr in preds if spec.prefetches else ["none"]:
            for pl in plans:
                if pl != "none" and spec.eviction == "belady":
                    continue  # belady is the demand-only bound; a plan would change what it bounds
                cells.append((p, pr, pl))
    cells = list(dict.fromkeys(cells))  # a name given twice runs once
    if not cells:
        # only belady with only planners: every pair was skipped above
        raise InputError(
            f"no cell to run: no planner applies to {', '.join(pols)} (belady is the demand-only bound); "
            "include none in --planners (e.g. --planners none,CKPT) or add a policy such as lru"
        )
    return cells


def _usable_capacities(caps: list[str], ts, json: bool) -> list[str]:
    """The capacities that hold at least top-k experts; the others are skipped with one note.

    A sweep's default (0.1) is below top-k on small models (tiny: 3 of 32 experts, top-4), and one
    unusable point should not sink the rest; `moecast replay` with that one capacity still refuses it.
    """
    from moecast.runtime.core.cache import resolve_capacity

    m = ts.meta.model
    E, k = m.num_experts, m.top_k
    kept: list[str] = []
    skipped: list[str] = []
    for c in caps:
        # top_k=0 disables only the top-k check, so a malformed capacity is still an error here and
        # the count equals the one replay resolves
        n = resolve_capacity(c, E, 0, m.expert_bytes)
        if n >= k:
            kept.append(c)
        else:
            skipped.append(f"{c} ({n} experts)")
    if not kept:
        raise InputError(
            f"every capacity in --capacities ({', '.join(caps)}) holds fewer experts than top-k = {k} of "
            f"{E}; use at least {k} experts ({k / E:.3f})"
        )
    if skipped:
        note = (
            f"note: skipping capacities {', '.join(skipped)}: below top-k = {k} of {E} experts, where one "
            f"token's experts would evict each other; the smallest usable is {k} experts ({k / E:.3f})"
        )
        # --json keeps stdout one JSON object per cell
        print(note, file=sys.stderr if json else sys.stdout)
    return kept


def _log_wandb(row: dict, ts, outdir: Path) -> None:
    import wandb

    name = f"{row['policy']}-{row['predictor']}-{row.get('planner', 'none')}-c{row['capacity']}"
    run = wandb.init(
        mode=os.environ.get("WANDB_MODE", "offline"),
        project="moecast",
        group=f"{Path(str(ts.path)).name}/compare",
        job_type="replay",
        name=name,
        config={k: v for k, v in row.items() if not isinstance(v, list)},
        dir=str(outdir),
        reinit="finish_previous",
    )
    run.log(
        {
            k: v
            for k, v in row.items()
            if isinstance(v, (int, float)) and v is not None and not isinstance(v, bool)
        }
    )
    run.finish()


def _series_name(row: dict) -> str:
    """A plot line: one (policy, predictor, planner) cell at one precision of the slow tier."""
    name = f"{row['policy']}/{row['predictor']}"
    if row.get("planner", "none") != "none":
        name = f"{name}+{row['planner']}"
    dtype = row.get("expert_dtype", "model")
    return name if dtype == "model" else f"{name} {dtype}"


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    series: dict[str, list[tuple[float, float, float | None]]] = {}
    for r in rows:
        series.setdefault(_series_name(r), []).append(
            (r["capacity_fraction"], r["hit_rate"], r["modeled_tpot_ms"])
        )
    colours = plt.get_cmap("tab20").colors  # more series than the default 10-colour cycle
    for i, (name, pts) in enumerate(series.items()):
        pts.sort()
        style = dict(marker="os^Dv"[i % 5], color=colours[(2 * i) % 20 + (i // 10) % 2], label=name)
        a1.plot([p[0] for p in pts], [p[1] for p in pts], **style)
        a2.plot([p[0] for p in pts], [p[2] if p[2] is not None else float("nan") for p in pts], **style)
    a1.set_xlabel("capacity (fraction of experts per layer)")
    a1.set_ylabel("hit rate")
    a2.set_xlabel("capacity (fraction of experts per layer)")
    a2.set_ylabel("modeled TPOT (ms)")
    a1.legend(fontsize=7)
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)


# the presets' names and help, from runtime/core/policy.py (jsonargparse reads these docstrings)
replay.__doc__ = with_policies(replay.__doc__ or "")
compare.__doc__ = with_policies(compare.__doc__ or "")
