"""Every benchmark from one entry point, into one table of figures.

    python bench/run_all.py [--quick] [--only NAME,...] [--out DIR] [--results DIR] [--train]

:data:`BENCHES` names each bench's module and the function that returns its figures as data
(``rows(quick, ...)``, built with bench/figures.py); a bench asks for the inputs it needs by naming
them as parameters (:func:`inputs`). Each bench runs in a process of its own, so a crash or a
timeout marks its row and the others still run; what it prints goes to OUT/logs/NAME.log. A bench
that lacks an input (a checkpoint, ../shared, the built ``tiny``) says so in its row. ``--quick``
runs smaller versions (each said in its notes) in minutes; ``--train`` also trains the predictors
that are missing (LLaPor on DeepSeek, ~30 min; the CasMoE EAM and EAP).

RESULTS/run_all.json keeps each bench's latest rows with the date, command and machine of their
run, and RESULTS/run_all.md is rendered from it; a run of some benches replaces only theirs. A full
run writes to bench/results, a quick one to OUT (default $MOECAST_HOME/bench). Timings are
wall-clock on this machine under whatever else runs on it: the load average is recorded before and
after every bench.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # bench.* by module name, when run as a script

from bench import figures as F  # noqa: E402

BENCHES: dict[str, tuple[str, str]] = {
    "collect": ("bench.bench_collect", "rows"),
    "import": ("bench.bench_import", "rows"),
    "tiny": ("bench.bench_tiny", "rows"),
    "replay": ("bench.bench_replay", "rows"),
    "predictors": ("bench.bench_predictors", "rows"),
    "splits": ("bench.bench_splits", "rows"),
    "prefetch": ("bench.bench_prefetch", "rows"),
    "casmoe": ("bench.bench_casmoe", "rows"),
    "live": ("bench.bench_live", "rows"),
    "policylang": ("bench.bench_policylang", "rows"),
    "tiers": ("bench.bench_tiers", "rows"),
    "gpu": ("bench.bench_gpu", "rows"),
}
RESULTS = ROOT / "bench" / "results"


def inputs(args: argparse.Namespace, work: Path) -> dict:
    """Every input a bench may name as a parameter, from the options or where the README puts it."""

    def first(*paths: Path) -> Path:
        return next((p for p in paths if p.exists()), paths[0])

    runs = F.RUNS
    return {
        "work": work,
        "train": args.train,
        "puffin": F.PUFFIN,
        "ds_traces": Path(args.ds_traces or F.DS_TRACES),
        "ds_checkpoint": Path(args.ds_checkpoint or runs / "llapor_ds.safetensors"),
        "seq_checkpoint": Path(args.seq_checkpoint or runs / "seq_ds.safetensors"),
        "tiny_checkpoint": Path(
            args.tiny_checkpoint
            or first(runs / "llapor_tiny.safetensors", runs / "demo" / "ckpt" / "llapor.safetensors")
        ),
        "tiny_traces": Path(
            args.tiny_traces or first(ROOT / "traces" / "tiny-sg", runs / "demo" / "traces" / "tiny-mixed")
        ),
        "eam": Path(args.eam or runs / "casmoe" / "eam.safetensors"),
        "eap": Path(args.eap or runs / "casmoe" / "eap.safetensors"),
    }


def _child(module: str, function: str, quick: bool, kwargs: dict, result: Path, log: Path) -> None:
    """In the bench's own process: its output to the log, its rows (and the inputs it took) to ``result``."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    fn = getattr(importlib.import_module(module), function)
    params = inspect.signature(fn).parameters
    if next(iter(params), None) != "quick":
        raise TypeError(f"{module}.{function} must be rows(quick: bool, ...) to run here")
    taken = {k: v for k, v in kwargs.items() if k in params and k != "quick"}
    rows = fn(quick, **taken)
    bad = [r for r in rows if not isinstance(r, dict) or set(F.KEYS) - set(r)]
    if bad:
        raise TypeError(f"{module}.{function} returned rows without the keys {F.KEYS} (bench/figures.py)")
    tmp = result.with_suffix(".tmp")
    tmp.write_text(json.dumps({"rows": rows, "inputs": {k: str(v) for k, v in taken.items()}}))
    tmp.replace(result)


def run_bench(name: str, quick: bool, kwargs: dict, logs: Path, timeout: float) -> dict | None:
    """{"rows", "inputs"} of one bench, run in a fresh process; None when its module is absent."""
    module, function = BENCHES[name]
    if importlib.util.find_spec(module) is None:
        return None
    log, result = logs / f"{name}.log", logs / f"{name}.json"
    result.unlink(missing_ok=True)
    proc = mp.get_context("spawn").Process(target=_child, args=(module, function, quick, kwargs, result, log))
    proc.start()
    proc.join(timeout)
    if proc.is_alive():
        proc.kill()
        proc.join()
        why = f"timed out after {timeout:.0f} s"
    elif result.is_file():
        return json.loads(result.read_text())
    else:
        lines = (
            [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()] if log.is_file() else []
        )
        why = f"exit {proc.exitcode}: {lines[-1][:120] if lines else 'no message'}"
    row = F.failed(name, why)
    row["note"] = f"log {log}"
    return {"rows": [row], "inputs": {}}


def describe(inputs_taken: dict) -> list[str]:
    """The files a bench read, each with how it was made where its metadata says."""
    out = []
    for key, value in inputs_taken.items():
        p = Path(value)
        if key in ("work", "train") or not p.exists():
            continue
        text = f"{key}: {F.shown(p)}"
        if p.suffix == ".safetensors":
            try:
                meta = F.checkpoint_meta(p)
            except (OSError, ValueError):
                meta = {}
            secs = (meta.get("training") or {}).get("train_seconds")
            on = meta.get("trained_on")
            split = (meta.get("split") or {}).get("method")  # absent: the ungrouped split of earlier versions
            text += f" ({meta.get('kind', '?')}" + (f", trained on {F.shown(on)}" if on else "")
            text += f", split {split}" if split else ""
            text += (f" in {secs:.0f} s" if isinstance(secs, (int, float)) else "") + ")"
        out.append(text)
    return out


def render(results: dict) -> str:
    """run_all.md from run_all.json: runs, inputs, then every figure."""
    benches = results["benches"]
    lines = [
        "# Benchmark results",
        "",
        "Rendered by `python bench/run_all.py` from `run_all.json` beside it: each bench's figures from its",
        "latest run, with that run's date, command and machine (`--only NAME` reruns one bench and replaces",
        'its rows). Rows marked "oracle" or "bound" are bounds, not results. Timings are wall-clock under the',
        "load average given.",
        "",
        "| bench | date | command | machine | seconds | load before / after |",
        "|---|---|---|---|---|---|",
    ]
    for name, b in benches.items():
        secs = "" if b.get("seconds") is None else f"{b['seconds']:.0f}"
        lines.append(
            f"| {name} | {b['date']} | `{b['command']}` | {F.describe_machine(b['machine'])} | "
            f"{secs} | {b['load_before']} / {b['load_after']} |"
        )
    read = [f"- {name}: " + "; ".join(b["inputs"]) for name, b in benches.items() if b.get("inputs")]
    if read:
        lines += ["", "Inputs:", "", *read]
    figs = [f for b in benches.values() for f in b["figures"]]
    return "\n".join([*lines, "", F.markdown_table(figs), ""])


def store(results_dir: Path, entries: dict) -> Path:
    """Merge ``entries`` into RESULTS/run_all.json (in BENCHES order) and render run_all.md, atomically."""
    results_dir.mkdir(parents=True, exist_ok=True)
    path = results_dir / "run_all.json"
    old = json.loads(path.read_text())["benches"] if path.is_file() else {}
    merged = {**old, **entries}
    order = [n for n in BENCHES if n in merged] + [n for n in merged if n not in BENCHES]
    results = {"benches": {n: merged[n] for n in order}}
    for target, text in (
        (path, json.dumps(results, indent=1) + "\n"),
        (path.with_suffix(".md"), render(results)),
    ):
        tmp = target.with_name(target.name + ".tmp")
        tmp.write_text(text)
        tmp.replace(target)
    return path


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller versions of every bench (minutes)")
    ap.add_argument("--only", default="", help=f"comma-separated subset of: {', '.join(BENCHES)}")
    ap.add_argument("--out", default=None, help="scratch and logs (default $MOECAST_HOME/bench)")
    ap.add_argument(
        "--results", default=None, help="run_all.json/.md here (default: bench/results; quick: OUT)"
    )
    ap.add_argument("--train", action="store_true", help="train missing predictor checkpoints (long)")
    ap.add_argument("--timeout", type=float, default=7200, help="seconds a bench may run")
    for name in (
        "ds-traces",
        "ds-checkpoint",
        "seq-checkpoint",
        "tiny-checkpoint",
        "tiny-traces",
        "eam",
        "eap",
    ):
        ap.add_argument(f"--{name}", default=None, help="default: where the README's commands write it")
    args = ap.parse_args(argv)
    names = [n.strip() for n in args.only.split(",") if n.strip()] or list(BENCHES)
    unknown = [n for n in names if n not in BENCHES]
    if unknown:
        ap.error(f"unknown bench(es) {', '.join(unknown)}; choose from {', '.join(BENCHES)}")
    args.names = names
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    from moecast import home

    for k, v in (("HF_HUB_OFFLINE", "1"), ("WANDB_MODE", "offline"), ("TOKENIZERS_PARALLELISM", "false")):
        os.environ.setdefault(k, v)
    out = Path(args.out or home() / "bench")
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    kwargs = inputs(args, out / "work")
    command = " ".join(["python bench/run_all.py", *(argv if argv is not None else sys.argv[1:])])
    info = F.machine()
    load_first, started, entries = F.loadavg(), time.time(), {}
    for name in args.names:
        entry = _run_entry(name, args, kwargs, logs, command, info)
        if entry is not None:
            entries[name] = entry
    _print_summary(entries, info, load_first, args.quick, logs, started)
    if entries:
        results_dir = Path(args.results) if args.results else (out if args.quick else RESULTS)
        print(f"wrote {store(results_dir, entries)} and run_all.md")
    return failed_status(entries)


def failed_status(entries: dict) -> int:
    """1 when any bench's figure is FAILED (each named on stderr with its reason), else 0."""
    bad = [(n, f) for n, e in entries.items() for f in e["figures"] if f.get("verdict") == "FAILED"]
    for name, f in bad:
        print(
            f"run_all: {name}: {f['name']} FAILED: {f['value']} {f.get('note', '')}".rstrip(), file=sys.stderr
        )
    return 1 if bad else 0


def _run_entry(
    name: str, args: argparse.Namespace, kwargs: dict, logs: Path, command: str, info: dict
) -> dict | None:
    """Run bench ``name`` and return its run_all.json entry; None (said) when its module is absent."""
    before, t0 = F.loadavg(), time.perf_counter()
    print(f"[{time.strftime('%H:%M:%S')}] {name} (load {before}) ...", flush=True)
    got = run_bench(name, args.quick, kwargs, logs, args.timeout)
    if got is None:
        print(f"    skipped: {BENCHES[name][0]} is not in this checkout", flush=True)
        return None
    dt = time.perf_counter() - t0
    print(
        f"    {dt:.0f} s: " + "; ".join(f"{f['name']} = {f['value']}" for f in got["rows"][:3]),
        flush=True,
    )
    return {
        "date": time.strftime("%Y-%m-%d"),
        "command": command,
        "mode": "quick" if args.quick else "full",
        "machine": info,
        "seconds": round(dt, 1),
        "load_before": before,
        "load_after": F.loadavg(),
        "inputs": describe(got["inputs"]),
        "figures": got["rows"],
    }


def _print_summary(
    entries: dict, info: dict, load_first: str, quick: bool, logs: Path, started: float
) -> None:
    """Every bench's figures as one table, then the machine, the load and the mode of the run."""
    print("\n" + F.format_table([f for e in entries.values() for f in e["figures"]]))
    print(f"\nmachine: {F.describe_machine(info)}")
    print(
        f"load average (1/5/15 min): before {load_first}, after {F.loadavg()}; "
        "timings are wall-clock under that load"
    )
    print(
        f"mode: {'quick' if quick else 'full'}; logs of every bench: {logs}; total {time.time() - started:.0f} s"
    )


if __name__ == "__main__":
    sys.exit(main())
