"""``moecast demo``: the whole pipeline on the embedded ``tiny`` model, offline, on a CPU.

Stages (each reused when its output exists, so an interrupted demo resumes where it stopped):

1. ``tiny``: build the embedded Qwen2-MoE on ShareGPT text (``moecast build-tiny``), once per machine.
2. data: OpenCompass-style fixture files (gsm8k, boolq, race-middle, wic, triviaqa, gaokao) in each
   dataset's real column format, since no dataset can be downloaded here.
3. collect: prefill + greedy decode of ShareGPT and the fixture workloads, recording top-k ids and
   weights, router probabilities and gate inputs (``moecast collect --gate-inputs``).
4. train: LLaPor (PreScope), then CasMoE's EAM index, EAP heads and their epsilon cascade, each a
   ``moecast train`` run logged to wandb (offline).
5. compare: replay the held-out requests (never seen in training) under LRU, LFU, SMoE score
   eviction, SMoE substitution, LLaPor prefetch, cascade preloading and Belady's bound
   (``moecast compare``), then print one table and write a PNG plot; reused while the traces, the
   checkpoints and the comparison's settings are the ones stamped beside its table.

Every stage is the same function the matching subcommand calls; the demo only wires them.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json as jsonlib
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from moecast.collect.traceset import VAL_FRACTION
from moecast.errors import InputError

#: the demo's replay models the PreScope paper's A100 (PCIe 4), not this machine: one table everywhere
DEMO_HARDWARE = "prescope-a100-pcie4"
FIXTURE_WORKLOADS = ("gsm8k", "boolq", "race-middle", "wic", "triviaqa", "gaokao")
# every trainer's val share by default; compare replays their test side
HOLDOUT = VAL_FRACTION


def _stage(n: int, total: int, title: str, t0: float) -> None:
    print(f"\n[{n}/{total}] {title}  (t+{time.perf_counter() - t0:.0f} s)", flush=True)


def _done(path: Path) -> bool:
    return path.is_file() and path.stat().st_size > 0


def _reuse(path: Path, settings: dict[str, Any], made: str = "trained", making: str = "training it") -> bool:
    """Whether ``path`` was made with ``settings`` (its stamp beside it) and can be reused; an output
    of other settings (more requests, other epochs, a retrained checkpoint) is made again, from scratch."""
    import json

    stamp = path.with_name(path.name + ".settings.json")
    if _done(path) and stamp.is_file() and json.loads(stamp.read_text()) == settings:
        print(f"reusing {path}")
        return True
    if _done(path):
        print(f"{path.name}: {made} with other settings than this run's; {making} again")
    # until the new output is stamped, a stale stamp must not vouch for it (an interrupted run)
    stamp.unlink(missing_ok=True)
    return False


def _compare_settings(
    traces: Path, checkpoints: tuple[Path, ...], capacities: tuple[float, ...], cold: bool, wandb: bool
) -> dict[str, Any]:
    """What the comparison depends on: the traces, each checkpoint as written (size and mtime: a
    retrained one is another), and its own settings."""
    from moecast.collect.traceset import TraceSet

    files = {p.name: [p.stat().st_size, p.stat().st_mtime_ns] for p in checkpoints}
    return {
        "requests": TraceSet(traces).num_requests,
        "checkpoints": files,
        "capacities": [float(c) for c in capacities],
        "cold": cold,
        "wandb": wandb,
        "hardware": DEMO_HARDWARE,
    }


def _stamp(path: Path, settings: dict[str, Any]) -> None:
    from moecast.collect.traceset import atomic_write_json

    atomic_write_json(path.with_name(path.name + ".settings.json"), settings)


def _label(row: dict[str, str]) -> str:
    policy, predictor, planner = row["policy"], row["predictor"], row.get("planner", "none")
    names = {
        "lru": "LRU, on demand",
        "lfu": "LFU, on demand",
        "score": "SMoE score eviction (Eq. 3)",
        "belady": "Belady (offline bound)",
        "static": "PreScope hot table",
        "prefetch": f"LRU + {predictor} prefetch",
        "presched": f"PreSched + {predictor} prefetch",
        "smoe": f"SMoE substitution + {predictor} prefetch",
    }
    label = names.get(policy, f"{policy}/{predictor}")
    return label if planner == "none" else f"{label} + {planner} preload"


def summarise(table_csv: Path) -> tuple[str, list[dict[str, Any]]]:
    """A compact markdown table from ``moecast compare``'s CSV: the decode steps' hit rate per capacity (a
    prompt is prefilled, loaded on demand and never prefetched: the TPOT's steps are the decode steps),
    the modeled TPOT."""
    with open(table_csv, newline="") as f:
        rows = list(csv.DictReader(f))
    caps = sorted({float(r["capacity_fraction"]) for r in rows})
    by: dict[str, dict[float, dict[str, str]]] = {}
    for r in rows:
        by.setdefault(_label(r), {})[float(r["capacity_fraction"])] = r
    c0 = caps[0]
    head = ["configuration", *(f"decode hit @ {c:.1%}" for c in caps), f"MiB moved @ {c0:.1%}", "substituted"]
    head.append(f"TPOT ms @ {c0:.1%}")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    summary = []
    for label, cells in sorted(by.items(), key=lambda kv: float(kv[1][c0]["decode_hit_rate"])):
        hits = [float(cells[c]["decode_hit_rate"]) if c in cells else float("nan") for c in caps]
        every = [float(cells[c]["hit_rate"]) if c in cells else float("nan") for c in caps]
        first = cells.get(c0, {})
        # MiB, as `moecast run` and every capacity in MB count
        mb = float(first.get("bytes_moved") or 0) / 2**20
        sub = float(first.get("substitution_rate") or 0)
        tpot = first.get("modeled_tpot_ms") or ""
        cols = [
            label,
            *(f"{h:.3f}" for h in hits),
            f"{mb:.1f}",
            f"{sub:.3f}",
            f"{float(tpot):.3f}" if tpot else "-",
        ]
        lines.append("| " + " | ".join(cols) + " |")
        summary.append(
            {
                "configuration": label,
                "decode_hit_rate": dict(zip(caps, hits, strict=True)),
                "hit_rate": dict(zip(caps, every, strict=True)),  # every token's, the prompts' too
                "mib_moved": mb,
                "substitution_rate": sub,
                "modeled_tpot_ms": float(tpot) if tpot else None,
            }
        )
    return "\n".join(lines), summary


def _fit_llapor(
    traces: Path, path: Path, recipe_file: Path, epochs: int, split: dict[str, float], resume: str
) -> None:
    """Train LLaPor on ``traces`` into ``path`` from the recipe in ``recipe_file``."""
    from moecast.train.config import config_args
    from moecast.train.llapor import fit_llapor

    recipe = config_args(fit_llapor, recipe_file)
    fit_llapor(
        str(traces),
        str(path),
        model=recipe["model"],
        data=replace(recipe["data"], **split),
        train=replace(recipe["train"], max_epochs=epochs),
        resume=resume,
    )


def _fit_eam(
    traces: Path, path: Path, recipe_file: Path, encoder: str, split: dict[str, float], wandb: bool
) -> None:
    """Build the EAM index of ``traces`` into ``path`` from the recipe in ``recipe_file``."""
    from moecast.train.config import config_args
    from moecast.train.eam import fit_eam

    recipe = config_args(fit_eam, recipe_file)
    eam_cfg = replace(recipe["eam"], embedder=encoder)
    fit_eam(str(traces), str(path), eam=eam_cfg, data=replace(recipe["data"], **split), wandb=wandb)


def _fit_eap(
    traces: Path,
    path: Path,
    recipe_file: Path,
    encoder: str,
    epochs: int,
    split: dict[str, float],
    resume: str,
) -> None:
    """Train the EAP heads on ``traces`` into ``path`` from the recipe in ``recipe_file``."""
    from moecast.train.config import config_args
    from moecast.train.eap import fit_eap

    recipe = config_args(fit_eap, recipe_file)
    fit_eap(
        str(traces),
        str(path),
        model=replace(recipe["model"], encoder=encoder),
        data=replace(recipe["data"], **split),
        train=replace(recipe["train"], max_epochs=epochs),
        resume=resume,
    )


def _train_predictors(
    traces: Path,
    ckpt: Path,
    preset: str,
    max_new_tokens: int,
    llapor_epochs: int,
    eap_epochs: int,
    encoder: str,
    epsilon: float,
    wandb: bool,
) -> tuple[Path, Path, Path, Path]:
    """Stage 4: LLaPor, the EAM, the EAP and their cascade, each trained by its fit function from the
    shipped recipe (configs/) unless a checkpoint of the same settings exists; their paths."""
    from moecast import configs_dir
    from moecast.collect.traceset import TraceSet
    from moecast.train.cascade import fit_cascade
    from moecast.train.config import SplitConfig

    cfg = configs_dir()
    llapor = ckpt / "llapor.safetensors"
    eam, eap, cascade = ckpt / "eam.safetensors", ckpt / "eap.safetensors", ckpt / "cascade.safetensors"
    # what each checkpoint depends on: the traces it learns from and its own settings
    data = {"preset": preset, "requests": TraceSet(traces).num_requests, "max_new_tokens": max_new_tokens}
    settings = {
        llapor: {**data, "llapor_epochs": llapor_epochs},
        eam: {**data, "encoder": encoder},
        eap: {**data, "encoder": encoder, "eap_epochs": eap_epochs},
    }
    settings[cascade] = {**settings[eap], "epsilon": epsilon}
    # a checkpoint from other settings leaves a run directory whose last.ckpt must not be resumed
    resume = {p: "never" if _done(p) else "auto" for p in (llapor, eap)}
    split = {"val_fraction": HOLDOUT}
    if not _reuse(llapor, settings[llapor]):
        _fit_llapor(traces, llapor, cfg / "llapor_tiny.yaml", llapor_epochs, split, resume[llapor])
        _stamp(llapor, settings[llapor])
    if not _reuse(eam, settings[eam]):
        _fit_eam(traces, eam, cfg / "eam_minilm.yaml", encoder, split, wandb)
        _stamp(eam, settings[eam])
    if not _reuse(eap, settings[eap]):
        _fit_eap(traces, eap, cfg / "eap_minilm_frozen.yaml", encoder, eap_epochs, split, resume[eap])
        _stamp(eap, settings[eap])
    if not _reuse(cascade, settings[cascade]):
        fit_cascade(str(eam), str(eap), str(cascade), epsilon, str(traces), data=SplitConfig(**split))
        _stamp(cascade, settings[cascade])

    return llapor, eam, eap, cascade


def _collect_traces(
    root: Path,
    traces: Path,
    preset: str,
    requests: int,
    fixture_requests: int,
    max_new_tokens: int,
    total: int,
    t0: float,
) -> None:
    """Stages 1-3: the tiny model (built once), the fixture datasets, and traces of both into ``traces``."""
    from moecast.collect.commands import collect
    from moecast.collect.fixtures import write_fixtures
    from moecast.collect.tiny import ensure_tiny

    _stage(1, total, f"tiny model (preset {preset}): build once, then reuse", t0)
    model_path = ensure_tiny(preset)
    print(f"tiny model at {model_path}")
    model = "tiny" if preset == "default" else f"tiny:{preset}"

    _stage(2, total, "fixture datasets in the OpenCompass workloads' column formats", t0)
    data_dir = write_fixtures(root / "data", rows=fixture_requests, seed=0)
    print(f"wrote {data_dir}")

    _stage(3, total, "collect router traces: ShareGPT + 6 fixture workloads, prefill + greedy decode", t0)
    common = dict(
        model=model, out=str(traces), max_new_tokens=max_new_tokens, gate_inputs=True, data_dir=str(data_dir)
    )
    collect(workloads=["sharegpt"], max_requests=requests, **common)
    collect(workloads=FIXTURE_WORKLOADS, max_requests=fixture_requests, **common)


def _compare(
    traces: Path,
    cmp_dir: Path,
    llapor: Path,
    cascade: Path,
    capacities: tuple[float, ...],
    cold: bool,
    wandb: bool,
) -> None:
    """Stage 5: ``moecast compare`` of the held-out requests into ``cmp_dir``, its printout silenced."""
    from moecast.runtime.replay.commands import compare

    quiet = io.StringIO()
    # compare's wide table is in table.md; the demo prints a compact one
    with contextlib.redirect_stdout(quiet):
        compare(
            traces=str(traces),
            policies=["lru", "lfu", "score", "smoe", "prefetch", "belady"],
            predictors=[str(llapor)],
            planners=["none", str(cascade)],
            capacities=[f"{c:g}" for c in capacities],
            holdout="test",
            hardware=DEMO_HARDWARE,
            out=str(cmp_dir),
            cold=cold,
            wandb=wandb,
            json=True,
        )


def _report(
    root: Path,
    traces: Path,
    checkpoints: tuple[Path, ...],
    cmp_dir: Path,
    cold: bool,
    wandb: bool,
    as_json: bool,
    t0: float,
) -> None:
    """Print the demo's outcome: one JSON object, or the compact table and where everything lies."""
    table, summary = summarise(cmp_dir / "table.csv")
    mode = "cold per request" if cold else "stream (caches persist across requests)"
    elapsed = time.perf_counter() - t0
    wandb_dirs = sorted({str(p.parent) for p in root.rglob("offline-run-*")}) if wandb else []
    result = {
        "out": str(root),
        "traces": str(traces),
        "checkpoints": [str(p) for p in checkpoints],
        "table": str(cmp_dir / "table.md"),
        "plot": str(cmp_dir / "plot.png"),
        "wandb_dirs": wandb_dirs,
        "mode": mode,
        "seconds": round(elapsed, 1),
        "summary": summary,
    }
    if as_json:
        print(jsonlib.dumps(result, default=str))
        return
    print(
        f"\nHeld-out test requests of {traces} (TraceSet.splits(), the checkpoints' split), {mode}; hardware profile "
        f"{DEMO_HARDWARE}; capacity = share of each layer's experts resident; decode hit: the hit rate of the "
        "decode steps (the TPOT's; a prompt is prefilled, on demand).\n"
    )
    print(table)
    print(f"\nfull table: {cmp_dir / 'table.md'} (CSV beside it)\nplot:       {cmp_dir / 'plot.png'}")
    if wandb_dirs:
        print("wandb (offline) runs under: " + ", ".join(wandb_dirs))
        print("  compare them:   wandb sync --sync-all  (from each folder), then open project 'moecast'")
    print(f"demo finished in {elapsed:.0f} s; re-running reuses every finished stage")


def demo(
    out: str = "runs/demo",
    preset: str = "default",
    requests: int = 96,
    fixture_requests: int = 16,
    max_new_tokens: int = 32,
    llapor_epochs: int = 8,
    eap_epochs: int = 30,
    encoder: str = "minilm",
    capacities: tuple[float, ...] = (0.125, 0.25, 0.5),
    cold: bool = True,
    epsilon: float = 0.6,
    wandb: bool = True,
    json: bool = False,
) -> Path:
    """Run the whole moecast pipeline on the embedded ``tiny`` model and print the comparison.

    Re-running reuses every finished stage trained with the same settings (delete OUT to start over).

    Args:
        out: Folder for the demo's traces, checkpoints, wandb runs, table and plot.
        preset: ``tiny`` preset (configs/tiny.yaml); ``test`` builds in seconds.
        requests: ShareGPT conversations to collect.
        fixture_requests: Requests per OpenCompass-style fixture workload.
        max_new_tokens: Greedy decode length per request.
        llapor_epochs: LLaPor training epochs (early stopping may end sooner).
        eap_epochs: EAP head training epochs.
        encoder: EAM/EAP sentence encoder: ``minilm`` (packaged all-MiniLM-L6-v2) or a local model folder.
        capacities: Cache capacities to compare, as fractions of each layer's experts.
        cold: Caches start empty for every request (the setting prompt-level planning targets); false: stream.
        epsilon: Cascade gate: EAM answers when its best cosine similarity is at least this.
        wandb: Log the EAM build and one run per compared cell to wandb (training runs always log; offline
            unless configured).
        json: Print the final summary as one JSON object.
    """
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # dozens of offline runs; their banners would bury the table
    os.environ.setdefault("WANDB_SILENT", "true")
    if requests < 1 or fixture_requests < 1:
        raise InputError("--requests and --fixture-requests must be at least 1")
    root = Path(out)
    root.mkdir(parents=True, exist_ok=True)
    traces = root / "traces" / "tiny-mixed"
    ckpt = root / "ckpt"
    ckpt.mkdir(exist_ok=True)
    t0 = time.perf_counter()
    total = 5
    _collect_traces(root, traces, preset, requests, fixture_requests, max_new_tokens, total, t0)

    _stage(4, total, "train predictors: LLaPor (PreScope), EAM + EAP + cascade (CasMoE)", t0)
    llapor, eam, eap, cascade = _train_predictors(
        traces, ckpt, preset, max_new_tokens, llapor_epochs, eap_epochs, encoder, epsilon, wandb
    )

    _stage(5, total, "replay the held-out requests under each policy (moecast compare)", t0)
    cmp_dir = root / "compare"
    # reused like the checkpoints: a rerun logs no second set of identical wandb runs
    done = _compare_settings(traces, (llapor, eam, eap, cascade), capacities, cold, wandb)
    if not _reuse(cmp_dir / "table.csv", done, "compared", "comparing"):
        _compare(traces, cmp_dir, llapor, cascade, capacities, cold, wandb)
        _stamp(cmp_dir / "table.csv", done)
    _report(root, traces, (llapor, eam, eap, cascade), cmp_dir, cold, wandb, json, t0)
    return root
