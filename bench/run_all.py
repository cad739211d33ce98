"""Every benchmark the issues name, from one entry point, into one table of figures.

    python bench/run_all.py [--quick] [--only NAME,...] [--json OUT] [--logs DIR] [--train]

Each benchmark runs as its own subprocess (bench/bench_*.py or a ``moecast`` command) and its
figures are parsed from what it prints (a JSON line where the bench has one, its text otherwise).
A bench that fails, times out or lacks an input (a checkpoint, ../shared, the built ``tiny``) is
marked in the table and the others still run; a figure the parser cannot find reads
"see output" and points at the bench's log. ``--quick`` runs smaller versions (subsets and fewer
repeats, each said in the table) in a few minutes; without it the full versions run (the whole
Puffin TraceSet, the 1,999-file import, ...). ``--train`` also trains the predictors that are
missing (LLaPor on DeepSeek, ~30 min; the CasMoE EAM/EAP), otherwise they are reported missing.

Benches: collect, import, tiny, replay, predictors, prefetch, casmoe, live, policylang (``--only``).
Timings are wall-clock on this machine, under whatever else runs on it: the load average is
recorded before and after every bench.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
SHARED_PUFFIN = ROOT.parent / "shared" / "traces" / "deepseek-v2-lite-puffin"
DS_TRACES = ROOT / "traces" / "ds-puffin"
PUFFIN_FILES = 1999


@dataclass
class Figure:
    bench: str
    name: str
    value: str
    goal: str = ""
    verdict: str = ""  # ok | MISS | "" (no goal or not judged) | FAILED | MISSING | SKIPPED
    number: float | None = None
    note: str = ""


@dataclass
class Ctx:
    quick: bool
    logs: Path
    work: Path
    train: bool
    results: dict = field(default_factory=dict)


def _judge(value: float | None, goal: str) -> str:
    """'ok' / 'MISS' for goals of the form '<= 10', '< 60', '>= 0.85', '>= 3x'; '' when not judgeable."""
    if value is None or not goal:
        return ""
    m = re.match(r"\s*(<=|<|>=|>)\s*([-+\d.eE]+)", goal)
    if not m:
        return ""
    op, bound = m.group(1), float(m.group(2))
    ok = {"<=": value <= bound, "<": value < bound, ">=": value >= bound, ">": value > bound}[op]
    return "ok" if ok else "MISS"


def fig(bench, name, number, fmt="{:.3f}", goal="", note="", judge=True) -> Figure:
    if number is None:
        return Figure(bench, name, "see output", goal, "", None, note)
    return Figure(bench, name, fmt.format(number), goal, _judge(number, goal) if judge else "", number, note)


def _num(pattern: str, text: str, group: int = 1) -> float | None:
    m = re.search(pattern, text, re.MULTILINE)
    if not m:
        return None
    try:
        return float(m.group(group).replace(",", ""))
    except (ValueError, IndexError):
        return None


def _json_lines(text: str) -> list[dict]:
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{") and line.endswith("}"):
            with contextlib.suppress(json.JSONDecodeError):
                out.append(json.loads(line))
    return out


def _run(ctx: Ctx, name: str, cmd: list[str], timeout: float, env: dict | None = None):
    """(returncode or None on timeout, stdout, stderr, seconds); output kept in ctx.logs/NAME.log."""
    full_env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "WANDB_MODE": "offline",
        "TOKENIZERS_PARALLELISM": "false",
    }
    full_env.update(env or {})
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=full_env)
        rc, out, err = p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired as exc:
        rc = None
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        err = exc.stderr.decode() if isinstance(exc.stderr, bytes) else (exc.stderr or "")
    dt = time.perf_counter() - t0
    log = ctx.logs / f"{name}.log"
    with open(log, "a") as fh:
        fh.write(f"$ {' '.join(cmd)}\n# rc={rc} {dt:.1f} s\n--- stdout\n{out}\n--- stderr\n{err}\n")
    return rc, out, err, dt


def _failed(bench: str, rc, err: str, dt: float, ctx: Ctx) -> Figure:
    if rc is None:
        why = f"timed out after {dt:.0f} s"
    else:
        lines = [ln for ln in err.strip().splitlines() if ln.strip()]
        why = f"rc {rc}: {lines[-1][:120] if lines else 'no message'}"
    return Figure(bench, "(bench)", why, "", "FAILED", note=f"log {ctx.logs / (bench + '.log')}")


def _py(script: str, *args: str) -> list[str]:
    return [sys.executable, str(BENCH / script), *args]


def _tiny_built(preset: str = "default") -> bool:
    from moecast import home

    p = home() / "tiny" / preset
    return (p / "build_info.json").is_file() and (p / "config.json").is_file()


def _ckpt_meta(path: Path) -> dict:
    """moecast metadata from a .safetensors header (no torch import)."""
    with open(path, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        header = json.loads(fh.read(n))
    return json.loads(header.get("__metadata__", {}).get("moecast", "{}"))


def _first(*paths: Path) -> Path | None:
    return next((p for p in paths if p and p.is_file()), None)


# ----------------------------------------------------------------------------- benches


def b_collect(ctx: Ctx) -> list[Figure]:
    model, note = "tiny", ""
    if not _tiny_built("default"):
        model, note = "tiny:test", "tiny default not built; on the test preset"
    args = ["--model", model]
    if ctx.quick:
        args += ["--requests", "8", "--max-new-tokens", "16", "--repeats", "2"]
        note = ", ".join(filter(None, [note, "quick: 8 requests x 16 tokens, best of 2"]))
    rc, out, err, dt = _run(ctx, "collect", _py("bench_collect.py", *args), 1200)
    if rc != 0:
        return [_failed("collect", rc, err, dt, ctx)]
    return [
        fig(
            "collect",
            f"tracing overhead on {model}",
            _num(r"tracing overhead\s+([-+]?[\d.]+) %", out),
            "{:+.1f} %",
            "<= 10 %",
            note,
        ),
        fig(
            "collect",
            f"collection tokens/s on {model} (to disk)",
            _num(r"collection to disk \(end to end\)\s+([\d,]+) tok/s", out),
            "{:,.0f}",
            note=note,
        ),
    ]


def b_import(ctx: Ctx) -> list[Figure]:
    if not SHARED_PUFFIN.is_dir():
        return [Figure("import", "(bench)", "../shared/traces absent", verdict="SKIPPED")]
    n = 200 if ctx.quick else None
    out = ctx.work / "ds-import"
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "moecast", "import", "moe-beyond", str(SHARED_PUFFIN), "--out", str(out)]
    if n:
        cmd += ["--max-files", str(n)]
    rc, _stdout, err, dt = _run(ctx, "import", cmd, 1800)
    if rc != 0:
        return [_failed("import", rc, err, dt, ctx)]
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    figs = []
    if n:
        scale = PUFFIN_FILES / n
        figs.append(
            fig(
                "import",
                f"import of {PUFFIN_FILES} DeepSeek files (s)",
                dt * scale,
                "{:.0f} s",
                "< 120 s",
                f"quick: {n} files in {dt:.1f} s, extrapolated",
            )
        )
        figs.append(
            fig(
                "import",
                "TraceSet size on disk (MB)",
                size * scale / 1e6,
                "{:.0f} MB",
                note=f"quick: {size / 1e6:.1f} MB for {n} files, extrapolated",
            )
        )
    else:
        figs.append(fig("import", f"import of {PUFFIN_FILES} DeepSeek files (s)", dt, "{:.1f} s", "< 120 s"))
        figs.append(fig("import", "TraceSet size on disk (MB)", size / 1e6, "{:.1f} MB"))
    shutil.rmtree(out, ignore_errors=True)
    return figs


def b_tiny(ctx: Ctx) -> list[Figure]:
    if not _tiny_built("default") and ctx.quick:
        return [
            Figure(
                "tiny",
                "(bench)",
                "tiny default not built (moecast build-tiny, ~7 min)",
                verdict="MISSING",
            )
        ]
    args = ["--val-tokens", "8192"] if ctx.quick else []
    rc, out, err, dt = _run(ctx, "tiny", _py("bench_tiny.py", *args), 1800)
    if rc != 0:
        return [_failed("tiny", rc, err, dt, ctx)]
    note = "quick: 8,192 held-out tokens" if ctx.quick else ""
    ent, uniform = [], None
    lines = out.splitlines()
    hdr = next((i for i, ln in enumerate(lines) if ln.split()[:3] == ["layer", "entropy", "uniform"]), None)
    for ln in lines[hdr + 1 :] if hdr is not None else []:
        cells = ln.split()
        if not cells or not cells[0].isdigit():
            break
        try:
            ent.append(float(cells[1]))
            uniform = float(cells[2])
        except (IndexError, ValueError):
            break
    m = re.search(r"mean co-occurrence recall@(\d+) ([\d.]+) vs chance ([\d.]+) \(([\d.]+)x\)", out)
    figs = [
        fig("tiny", "tiny build time (s)", _num(r"build: ([\d.]+) s total", out), "{:.0f} s", "<= 600 s"),
        fig("tiny", "tiny held-out perplexity", _num(r"perplexity ([\d.]+)", out), "{:.1f}", note=note),
        Figure(
            "tiny",
            "tiny router entropy, mean over layers vs uniform ln E",
            f"{sum(ent) / len(ent):.3f} vs {uniform:.3f} (min layer {min(ent):.3f})" if ent else "see output",
            "< uniform",
            ("ok" if sum(ent) / len(ent) < uniform else "MISS") if ent else "",
            note=note,
        ),
        fig(
            "tiny",
            "tiny co-occurrence recall vs chance (x)",
            float(m.group(4)) if m else None,
            "{:.2f}x",
            ">= 3 x",
            f"recall@{m.group(1)} {m.group(2)} vs chance {m.group(3)}" if m else note,
        ),
    ]
    return figs


FLOOR_RE = r"overhead on this machine now: ([\d.]+) us"


def b_replay(ctx: Ctx) -> list[Figure]:
    if not DS_TRACES.is_dir():
        return [Figure("replay", "(bench)", f"{DS_TRACES} absent (moecast import ...)", verdict="MISSING")]
    args = ["--traces", str(DS_TRACES)]
    note = ""
    if ctx.quick:
        args += ["--requests", "300"]
        note = "quick: first 300 of 1999 requests"
    rc, out, err, dt = _run(ctx, "replay", _py("bench_replay.py", *args), 1800)
    if rc != 0:
        return [_failed("replay", rc, err, dt, ctx)]
    # current format: "cold replay of N requests, K policies x 5 capacities: X s wall (...)";
    # older: "full replay, K policies x 5 capacities, cold per request: X s"
    m = re.search(r"cold replay of (\d+) requests, (\d+) policies x 5 capacities: ([\d.]+) s", out)
    if m:
        npol, secs = int(m.group(2)), float(m.group(3))
    else:
        npol = _num(r"full replay, (\d+) policies", out)
        secs = _num(r"full replay, \d+ policies x 5 capacities, cold per request: ([\d.]+) s", out)
    figs = [
        fig(
            "replay",
            f"{'Puffin replay (subset)' if ctx.quick else 'full Puffin replay'}, "
            f"{int(npol) if npol else '?'} policies x 5 capacities, cold (s)",
            secs,
            "{:.1f} s",
            "< 60 s",
            note,
            judge=not ctx.quick,
        )
    ]
    floor = _num(FLOOR_RE, out)
    cpu = dict(re.findall(r"^per-layer decision.*?, (\w+), capacity.*?total_cpu ([\d.]+)", out, re.MULTILINE))
    decisions = re.findall(r"^per-layer decision.*?, (\w+), capacity.*?total ([\d.]+)", out, re.MULTILINE)
    if not decisions:
        old = _num(r"per-layer decision cost.*total ([\d.]+)", out)
        decisions = [("lru", old)] if old is not None else []
    for pol, us in decisions:
        figs.append(
            fig(
                "replay",
                f"per-layer decision, {pol} + substitution + prefetch choice (us)",
                float(us),
                "{:.1f} us",
                "<= 10 us",
                (f"CPU time {cpu[pol]} us; " if pol in cpu else "")
                + f"wall time; numpy call floor {floor} us under this load",
            )
        )
    if not decisions:
        figs.append(Figure("replay", "per-layer decision (us)", "see output", "<= 10 us"))
    rows = re.findall(
        r"^\|?\s*(\w+)\s*\|?\s*(cold|stream)\s*\|?\s*([\d.]+)\s*\|?\s*([\d.]+)\s*\|?\s*([\d.]+)\s*\|?\s*$",
        out,
        re.MULTILINE,
    )
    for pol, mode, a, b, c in rows:
        why = note
        if pol in ("prefetch", "presched"):  # these policies' default predictor is the oracle
            why = ", ".join(filter(None, [note, "oracle predictor (the policy's default): a bound"]))
        figs.append(Figure("replay", f"hit rate 10/25/50 % {pol} {mode}", f"{a} / {b} / {c}", note=why))
    if not rows:
        figs.append(Figure("replay", "hit rates", "see output", note=str(ctx.logs / "replay.log")))
    skipped = re.findall(r"^\|\s*(\w+)\s*\|\s*-\s*\|.*\((.*)\)\s*$", out, re.MULTILINE)
    for pol, why in skipped:
        figs.append(
            Figure("replay", f"hit rate {pol}", f"skipped: {why}", note="DeepSeek traces are ids only")
        )
    return figs


DS_CKPTS = (ROOT / "runs" / "llapor_ds.safetensors", Path("/tmp/best/llapor_ds.safetensors"))
SEQ_CKPT = ROOT / "runs" / "seq_ds.safetensors"  # moecast train sequence (configs/sequence_deepseek.yaml)
TINY_CKPTS = (
    ROOT / "runs" / "llapor_tiny.safetensors",
    Path("/tmp/best/llapor_tiny.safetensors"),
    ROOT / "runs" / "demo" / "ckpt" / "llapor.safetensors",
)
TINY_TRACES = (
    Path("/tmp/pp/tiny-sg"),
    ROOT / "traces" / "tiny-sg",
    ROOT / "runs" / "demo" / "traces" / "tiny-mixed",
)


def _tiny_pair() -> tuple[Path | None, Path | None]:
    """(tiny TraceSet with gate inputs, a LLaPor checkpoint trained on it) from the usual places."""
    traces = next((t for t in TINY_TRACES if (t / "meta.json").is_file()), None)
    for ck in TINY_CKPTS:
        if ck.is_file():
            try:
                on = _ckpt_meta(ck).get("trained_on")
            except (OSError, ValueError):
                continue
            if on and (Path(on) / "meta.json").is_file():
                return Path(on), ck
    return traces, None


def b_predictors(ctx: Ctx) -> list[Figure]:
    """bench_predictors.py --json: LLaPor on DeepSeek and tiny, baselines, latency, training time."""
    figs: list[Figure] = []
    ds = _first(*DS_CKPTS)
    tiny_traces, tiny_ck = _tiny_pair()
    args = ["--traces", str(DS_TRACES), "--out-dir", str(ctx.work / "predictors"), "--json"]
    ds_note, tiny_note = "", ""
    if ds is not None:
        args += ["--checkpoint", str(ds)]
        ds_note = f"checkpoint {ds}"
        if SEQ_CKPT.is_file():
            args += ["--sequence-checkpoint", str(SEQ_CKPT)]
    elif ctx.quick:
        ds_note = "no checkpoint: quick-trained here (1 epoch, 300 requests), not the goal run"
    elif ctx.train:
        ds_note = "trained here with configs/llapor_deepseek.yaml"
    else:
        args.append("--skip-ds")
    if not DS_TRACES.is_dir():
        args.append("--skip-ds")
    if tiny_traces is None:
        args.append("--skip-tiny")
    else:
        args += ["--tiny-traces", str(tiny_traces)]
        if tiny_ck is not None:
            args += ["--tiny-checkpoint", str(tiny_ck)]
            tiny_note = f"checkpoint {tiny_ck}"
        elif ctx.quick:
            tiny_note = "no checkpoint: quick-trained here (5 epochs)"
        elif not ctx.train:
            args.append("--skip-tiny")
    if ctx.quick:
        args.append("--quick")
    if "--skip-ds" in args and "--skip-tiny" in args:
        return [
            Figure(
                "predictors",
                "LLaPor DeepSeek / tiny",
                f"no checkpoints ({DS_CKPTS[0].relative_to(ROOT)}, {TINY_CKPTS[0].relative_to(ROOT)}) "
                "and no tiny traces; --quick trains small ones, --train full ones",
                verdict="MISSING",
            )
        ]
    rc, out, err, dt = _run(ctx, "predictors", _py("bench_predictors.py", *args), 3600 if ctx.train else 1800)
    if rc != 0:
        return [_failed("predictors", rc, err, dt, ctx)]
    rows = _json_lines(out)
    judged = ds is not None or (ctx.train and not ctx.quick)
    ds_rows = [r for r in rows if str(r.get("bench", "")).startswith("deepseek")]
    tiny_rows = [r for r in rows if str(r.get("bench", "")).startswith("tiny")]
    lat = {r.get("traces"): r for r in rows if r.get("bench") == "latency"}
    q = "quick: 60 held-out requests; " if ctx.quick else ""
    if "--skip-ds" in args:
        figs.append(
            Figure(
                "predictors",
                "LLaPor DeepSeek held-out recall@6",
                "no checkpoint (runs/llapor_ds.safetensors; --train)",
                ">= 0.85",
                "MISSING",
            )
        )
    else:
        ll = next((r for r in ds_rows if str(r.get("predictor", "")).startswith("llapor")), None)
        figs.append(
            fig(
                "predictors",
                "LLaPor DeepSeek held-out recall@6",
                ll and ll.get("recall_at_k"),
                "{:.4f}",
                ">= 0.85",
                q + ds_note,
                judge=judged,
            )
        )
        for r in ds_rows:
            if r is not ll and r.get("recall_at_k") is not None:
                seq = str(r["predictor"]).startswith("sequence")
                figs.append(
                    fig(
                        "predictors",
                        f"{'' if seq else 'baseline '}{r['predictor']} recall@6 ({r.get('horizon')})",
                        r["recall_at_k"],
                        "{:.4f}",
                        note="MoE-Beyond-style, causal; the next token's experts, all layers" if seq else "",
                    )
                )
        figs.append(
            fig(
                "predictors",
                "LLaPor DeepSeek training time (s)",
                ll and ll.get("train_seconds"),
                "{:.0f} s",
                "<= 1800 s",
                ds_note,
                judge=judged,
            )
        )
    if "--skip-tiny" in args:
        figs.append(
            Figure(
                "predictors",
                "tiny LLaPor held-out recall@k",
                "no tiny traces with gate inputs / checkpoint (see bench_predictors.py)",
                ">= 0.97",
                "MISSING",
            )
        )
    else:
        ll = next((r for r in tiny_rows if str(r.get("predictor", "")).startswith("llapor")), None)
        skipped = next((r.get("skipped") for r in tiny_rows if r.get("skipped")), None)
        figs.append(
            fig(
                "predictors",
                "tiny LLaPor held-out recall@k",
                ll and ll.get("recall_at_k"),
                "{:.4f}",
                ">= 0.97",
                skipped or (q + tiny_note),
                judge=tiny_ck is not None,
            )
        )
        ref = next((r for r in tiny_rows if r.get("bench") == "tiny-reference"), None)
        if ref:

            def per_layer(v: list) -> str:
                return " ".join(f"{x:.3f}" for x in v if x is not None)

            figs.append(
                Figure(
                    "predictors",
                    "tiny: true router of layer l on its input state, layers 1..L-1",
                    per_layer(ref["input_state"]),
                    note=f"all but layer l's attention; gate reuse {per_layer(ref['gate_reuse'])}; "
                    f"LLaPor {per_layer(ref['llapor_per_layer'][1:])}",
                )
            )
            for key in (k for k in ref if k.startswith("window_")):
                v = [x for x in ref[key] if x is not None]
                figs.append(
                    Figure(
                        "predictors",
                        f"tiny: ... plus layer l's own attention over the last {key[7:]} tokens, layers 1..L-1",
                        per_layer(v),
                        note=f"mean {sum(v) / len(v):.3f}; the context layer l-1 cannot see, by the model's weights",
                    )
                )
    for name, r in lat.items():
        us = r.get("score_at_us_median", r.get("score_layer_us_median"))
        wide = str(name).startswith("wide")
        torch_us = r.get("torch_all_layers_us_per_layer")
        figs.append(
            fig(
                "predictors",
                f"LLaPor inference ms/layer ({name}, batch 1, 1 thread)",
                us / 1e3 if isinstance(us, (int, float)) else None,
                "{:.4f} ms",
                "<= 0.1 ms",
                ("random weights, gate inputs at a real model's width; " if wide else "")
                + "score_at (features + network), int8 weights; "
                f"unfolded features_at + score_layer {r.get('unfolded_us_median', float('nan')):.1f} us; "
                f"score_layer alone {r.get('score_layer_us_median', float('nan')):.1f} us "
                f"(float32 {r.get('score_layer_float32_us_median', float('nan')):.1f} us); "
                + (
                    f"torch all layers {torch_us:.1f} us/layer; "
                    if isinstance(torch_us, (int, float))
                    else ""
                )
                + f"load {_fmt_load(r.get('loadavg_1min'))}",
            )
        )
    if not any(f.name.startswith("LLaPor inference") for f in figs):
        figs.append(Figure("predictors", "LLaPor inference ms/layer", "see output", "<= 0.1 ms"))
    return figs


PREFETCH_HW = ("prescope-a100-pcie4", "gh200-nvlink-c2c")
NON_LEARNED = ("lru", "lfu", "static", "belady")


def b_prefetch(ctx: Ctx) -> list[Figure]:
    """LLaPor prefetch vs every non-learned policy at 10 % capacity on the held-out DeepSeek requests
    (``moecast replay --holdout 0.1 --json``), per hardware profile: the LLaPor issue's replay target."""
    ds = _first(*DS_CKPTS)
    if ds is None or not DS_TRACES.is_dir():
        return [Figure("prefetch", "(bench)", "no DeepSeek LLaPor checkpoint or traces", verdict="MISSING")]
    holdout = "0.1"
    figs: list[Figure] = []
    for hw in PREFETCH_HW:
        hits: dict[str, float] = {}
        tpot: dict[str, float] = {}
        for name, extra in (
            *((p, [p]) for p in NON_LEARNED),
            ("LLaPor prefetch", ["prefetch", "--predictor", str(ds)]),
            ("PreSched, no predictor", ["presched", "--predictor", "none"]),
            ("LLaPor + PreSched", ["presched", "--predictor", str(ds)]),
            ("oracle + PreSched (bound)", ["presched", "--predictor", "oracle"]),
        ):
            cmd = [sys.executable, "-m", "moecast", "replay", "--traces", str(DS_TRACES), "--policy", *extra]
            cmd += [
                "--capacity",
                "0.1",
                "--cold",
                "true",
                "--holdout",
                holdout,
                "--hardware",
                hw,
                "--json",
                "true",
            ]
            rc, out, err, dt = _run(ctx, "prefetch", cmd, 900)
            rows = _json_lines(out)
            if rc != 0 or not rows:
                return [*figs, _failed("prefetch", rc, err, dt, ctx)]
            hits[name] = float(rows[-1]["hit_rate"])
            tpot[name] = float(rows[-1]["modeled_tpot_ms"])
        best = max(NON_LEARNED, key=lambda p: hits[p])
        q = f"held-out {holdout} of the requests, cold, capacity 10 %; {hw}"

        # a CPU-computed miss moves nothing but is not a hit: PreSched can cut the step time while
        # its hit rate falls, so every row says both
        t = {name: f"modeled TPOT {v:.1f} ms" for name, v in tpot.items()}
        figs.append(
            fig("prefetch", f"10 % hit, best non-learned ({best}), {hw}", hits[best], note=f"{t[best]}; {q}")
        )
        for name in ("LLaPor prefetch", "LLaPor + PreSched"):
            f = fig(
                "prefetch",
                f"10 % hit, {name}, {hw}",
                hits[name],
                goal=f"> {best}",
                note=f"{t[name]}; {q}",
                judge=False,
            )
            f.verdict = "ok" if hits[name] > hits[best] else "MISS"  # exact, not the rounded print
            figs.append(f)
        # the same scheduler without prefetch: what LLaPor adds under PreSched, in hit rate and time
        figs.append(
            fig(
                "prefetch",
                f"10 % hit, PreSched without a predictor, {hw}",
                hits["PreSched, no predictor"],
                note=t["PreSched, no predictor"],
            )
        )
        bound = "oracle + PreSched (bound)"
        figs.append(fig("prefetch", f"10 % hit, {bound}, {hw}", hits[bound], note=t[bound]))
    return figs


def b_casmoe(ctx: Ctx) -> list[Figure]:
    eam, eap = ROOT / "runs" / "casmoe" / "eam.safetensors", ROOT / "runs" / "casmoe" / "eap.safetensors"
    args = ["--traces", str(DS_TRACES), "--eam", str(eam), "--eap", str(eap), "--json"]
    if not (eam.is_file() and eap.is_file()):
        if not ctx.train:
            return [
                Figure(
                    "casmoe",
                    "EAM / EAP / cascade",
                    "no checkpoints (runs/casmoe/{eam,eap}.safetensors; --train or bench_casmoe.py --build)",
                    verdict="MISSING",
                )
            ]
        args.append("--build")
    if ctx.quick:
        args += ["--max-requests", "50"]
    figs: list[Figure] = []
    # the checkpoints' default (fp32, 1 thread) and the fastest setting measured on this 2-core CPU
    # the fastest setting also times single prompts by length: how far the encoder alone is from 5 ms
    fast = ["--int8", "--threads", "2", "--lengths", "--repeats", "5" if ctx.quick else "20"]
    for setting, extra in (("fp32 1 thread", []), ("int8 2 threads", fast)):
        log = "casmoe" if not extra else "casmoe-int8"
        rc, out, err, dt = _run(ctx, log, _py("bench_casmoe.py", *args, *extra), 3600)
        if rc != 0:
            return [*figs, _failed(log, rc, err, dt, ctx)]
        args = [a for a in args if a != "--build"]  # built once
        figs += _casmoe_figures(ctx, setting, _json_lines(out))
    return figs


def _casmoe_figures(ctx: Ctx, setting: str, lines: list[dict]) -> list[Figure]:
    rows = {r.get("planner"): r for r in lines if "planner" in r}
    note = "quick: 50 held-out requests; " if ctx.quick else ""
    eam_r, eap_r = rows.get("EAM", {}), rows.get("EAP", {})
    engine = eam_r.get("engine", "?")
    figs = [
        fig(
            "casmoe",
            f"EAM latency per prompt, {setting} (ms)",
            eam_r.get("mean_latency_ms"),
            "{:.2f} ms",
            "<= 5 ms",
            f"{note}{engine}; p50 {eam_r.get('p50_latency_ms', float('nan')):.2f} ms; recall {eam_r.get('recall_at_k', float('nan')):.4f}",
        ),
        fig(
            "casmoe",
            f"EAP latency per prompt, {setting} (ms)",
            eap_r.get("mean_latency_ms"),
            "{:.2f} ms",
            "<= 10 ms",
            f"{note}{engine}; p50 {eap_r.get('p50_latency_ms', float('nan')):.2f} ms; recall {eap_r.get('recall_at_k', float('nan')):.4f}",
        ),
    ]
    casc = [r for n, r in rows.items() if n and n.startswith("cascade")]
    if casc and eap_r:
        from moecast.train.planner_report import cascade_wins

        wins = cascade_wins(list(rows.values()))
        best = (
            min(wins, key=lambda r: r["mean_latency_ms"])
            if wins
            else max(casc, key=lambda r: (r["recall_at_k"], -r["mean_latency_ms"]))
        )
        d = best["recall_at_k"] - eap_r["recall_at_k"]
        figs.append(
            Figure(
                "casmoe",
                f"cascade recall vs EAP (best cascade), {setting}",
                f"{best['recall_at_k']:.4f} vs {eap_r['recall_at_k']:.4f} ({d:+.4f}); "
                f"{best['latency_vs_eap_ms']:+.2f} +- {best['latency_vs_eap_se_ms']:.2f} ms vs EAP",
                ">= EAP at lower latency",
                "ok" if wins else "MISS",
                note=f"{best['planner']}, EAM share {best.get('eam_share', float('nan')):.2f}; latency paired per prompt",
            )
        )
    else:
        figs.append(
            Figure(
                "casmoe", f"cascade recall vs EAP, {setting}", "see output", note=str(ctx.logs / "casmoe.log")
            )
        )
    for r in lines:
        if r.get("bench") == "casmoe-length" and r.get("timed") == "EAM":
            figs.append(
                fig(
                    "casmoe",
                    f"EAM latency, one {r['prompt']} prompt ({r['tokens']} tokens), {setting} (ms)",
                    r["p50_ms"],
                    "{:.2f} ms",
                    "<= 5 ms",
                    f"p50 of {5 if ctx.quick else 20} plans; min {r['min_ms']:.2f} ms",
                )
            )
    return figs


def b_live(ctx: Ctx) -> list[Figure]:
    args = (
        ["--tokens", "16", "--repeats", "2", "--texts", "3", "--text-tokens", "32", "--alphas", "0,0.3"]
        if ctx.quick
        else []
    )
    rc, out, err, dt = _run(ctx, "live", _py("bench_live.py", *args), 1800)
    if rc != 0:
        return [_failed("live", rc, err, dt, ctx)]
    preset = re.search(r"tiny \((\w+) preset\)", out)
    note = ", ".join(
        filter(
            None,
            [
                f"tiny {preset.group(1)}" if preset else "",
                "quick: 16 tokens x 2, 3 texts x 32 tokens" if ctx.quick else "",
            ],
        )
    )
    return [
        fig(
            "live",
            "live runtime overhead at full residency",
            _num(r"^\s+overhead\s+([-+]?[\d.]+) %", out),
            "{:+.1f} %",
            "<= 15 %",
            note,
        ),
        fig(
            "live",
            "LLaPor per-layer prediction in the decode loop (us)",
            _num(r"per-layer prediction\s+([\d.]+) us median", out),
            "{:.1f} us",
            "<= 100 us",
            note
            + "; window + score_at (that layer's features and network), tiny, runs/llapor_tiny.safetensors",
        ),
        fig(
            "live",
            "LLaPor per-layer prediction out of the loop, warm caches (us)",
            _num(r"out of the loop\s+([\d.]+) us median", out),
            "{:.1f} us",
            "<= 100 us",
            note + "; the same calls on snapshots of the live windows, back to back",
        ),
        fig(
            "live",
            "alpha=0.3 perplexity change",
            _num(r"alpha = 0\.3: perplexity change ([-+]?[\d.]+) %", out),
            "{:+.2f} %",
            "<= 2 %",
            note,
        ),
        fig(
            "live",
            "alpha=0.3 greedy agreement",
            _num(r"agreement with alpha = 0 ([\d.]+) %", out),
            "{:.1f} %",
            ">= 95 %",
            note,
        ),
    ]


def b_policylang(ctx: Ctx) -> list[Figure]:
    if not DS_TRACES.is_dir():
        return [Figure("policylang", "(bench)", f"{DS_TRACES} absent", verdict="MISSING")]
    n = "50" if ctx.quick else "200"
    rc, out, err, dt = _run(ctx, "policylang", _py("bench_policylang.py", "--requests", n, "--json"), 1800)
    if rc != 0:
        return [_failed("policylang", rc, err, dt, ctx)]
    res = next((r for r in _json_lines(out) if r.get("bench") == "policylang"), None)
    if res is None:
        return [Figure("policylang", "side by side", "see output", note=str(ctx.logs / "policylang.log"))]
    if res.get("error"):
        return [Figure("policylang", "MoE-PolicyLang", res["error"], verdict="MISSING")]
    figs = []
    by: dict[str, list] = {}
    for r in res["rows"]:
        by.setdefault(r["policy"], []).append(r)
    for pol, rows in by.items():
        figs.append(
            Figure(
                "policylang",
                f"hit rate 10/25/50 % {pol}: moecast | PolicyLang {rows[0]['their_policy']}",
                " / ".join(f"{r['moecast']:.3f}" for r in rows)
                + "  |  "
                + " / ".join(f"{r['policylang']:.3f}" for r in rows),
                note=f"{res['subset']}, cold per request; softmax {res['softmax']}",
            )
        )
    return figs


BENCHES: dict[str, Callable[[Ctx], list[Figure]]] = {
    "collect": b_collect,
    "import": b_import,
    "tiny": b_tiny,
    "replay": b_replay,
    "predictors": b_predictors,
    "prefetch": b_prefetch,
    "casmoe": b_casmoe,
    "live": b_live,
    "policylang": b_policylang,
}


# ----------------------------------------------------------------------------- machine and table


def machine() -> dict:
    info: dict = {"cores": os.cpu_count()}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        from importlib.metadata import version

        info["torch"] = version("torch")
    except Exception:
        info["torch"] = "?"
    try:
        import torch

        info["cuda"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except Exception:
        info["cuda"] = None
    info["python"] = sys.version.split()[0]
    return info


def _fmt_load(x: object) -> str:
    return f"{x:.2f}" if isinstance(x, (int, float)) else str(x)


def _load() -> str:
    try:
        return "/".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "?"


def print_table(figs: list[Figure], info: dict) -> None:
    w = [11, 56, 46, 24, 8]
    head = ["bench", "figure", "value", "goal", "verdict"]
    print("\n" + "  ".join(h.ljust(n) for h, n in zip(head, w)) + "  note")
    print("-" * (sum(w) + 2 * len(w) + 30))
    for f in figs:
        cells = [f.bench, f.name, f.value, f.goal, f.verdict]
        print("  ".join(str(c).ljust(n) for c, n in zip(cells, w)) + "  " + f.note)
    print(
        f"\nmachine: {info.get('cpu', '?')}, {info.get('cores')} cores"
        + (f", GPU {info['cuda']}" if info.get("cuda") else ", no GPU")
        + f"; torch {info.get('torch')}, python {info.get('python')}"
    )
    print(
        f"load average (1/5/15 min): before {info.get('load_before')}, after {info.get('load_after')}; "
        "timings are wall-clock under that load"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller versions of every bench (minutes)")
    ap.add_argument("--only", default="", help=f"comma-separated subset of: {', '.join(BENCHES)}")
    ap.add_argument(
        "--json", default=None, metavar="OUT", help="also write every figure and the machine here"
    )
    ap.add_argument("--logs", default=None, help="folder for each bench's output (default: a temp folder)")
    ap.add_argument("--train", action="store_true", help="train missing predictor checkpoints (long)")
    args = ap.parse_args()
    names = [n.strip() for n in args.only.split(",") if n.strip()] or list(BENCHES)
    unknown = [n for n in names if n not in BENCHES]
    if unknown:
        sys.exit(f"run_all: unknown bench(es) {', '.join(unknown)}; choose from {', '.join(BENCHES)}")
    logs = Path(args.logs) if args.logs else Path(tempfile.mkdtemp(prefix="moecast-bench-"))
    logs.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="moecast-bench-work-"))
    ctx = Ctx(quick=args.quick, logs=logs, work=work, train=args.train)
    info = machine()
    info["load_before"] = _load()
    started = time.time()
    figs: list[Figure] = []
    per_bench = {}
    try:
        for name in names:
            before = _load()
            t0 = time.perf_counter()
            print(f"[{time.strftime('%H:%M:%S')}] {name} (load {before}) ...", flush=True)
            try:
                got = BENCHES[name](ctx)
            except Exception as exc:  # a bench's parser must never stop the others
                got = [Figure(name, "(bench)", f"{type(exc).__name__}: {str(exc)[:100]}", verdict="FAILED")]
            dt = time.perf_counter() - t0
            per_bench[name] = {"seconds": round(dt, 1), "load_before": before, "load_after": _load()}
            print(f"    {dt:.0f} s: " + "; ".join(f"{f.name} = {f.value}" for f in got[:3]), flush=True)
            figs.extend(got)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    info["load_after"] = _load()
    info["wall_s"] = round(time.time() - started, 1)
    print_table(figs, info)
    print(
        f"mode: {'quick' if args.quick else 'full'}; logs of every bench: {logs}; total {info['wall_s']:.0f} s"
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "mode": "quick" if args.quick else "full",
                    "machine": info,
                    "benches": per_bench,
                    "figures": [asdict(f) for f in figs],
                },
                indent=2,
            )
        )
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
