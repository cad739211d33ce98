"""The README's generated tables: the commands (from moecast/cli.py) and the headline results (from bench/results).

    python bench/readme_table.py          # rewrite both tables between their markers in README.md
    python bench/readme_table.py --check  # exit 1 when README.md differs from what they would be

The results table is a few headline figures, each row naming the results file it reads: the disk
tier's TPOT (one run of bench/bench_tiers.py, :data:`TIERS`), the GPU's (one run of
bench/bench_gpu.py, :data:`GPU`) and rows of bench/results/run_all.json (:data:`RUN_ALL_ROWS`).
Every other figure is in bench/results/run_all.md, which the README links; ``bench/run_all.py``
refreshes run_all.json, and this script the README.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
RESULTS = ROOT / "bench" / "results"
RUN_ALL = RESULTS / "run_all.json"

# The disk tier's row: (the bench_tiers run, the capacity, the start of the configurations whose
# best is shown, the configurations shown beside it).
TIERS = ("tiers-vm-26layers", 0.25, "llapor", ("lru", "page cache"))
# The GPU's row: the bench_gpu run whose DeepSeek-shaped TPOT rows are shown.
GPU = "gpu-NVIDIA-H200"

# (how the README names the row, the (bench, start of the figure's name in run_all.json) it shows);
# {0}, {1}... in the label stand for the rest of each figure's name, such as the policy a "best"
# figure picked. At 10 % DeepSeek keeps exactly its top-k experts per layer.
RUN_ALL_ROWS = (
    (
        "hit rate, modeled TPOT, 10 % of experts resident, GH200 profile (replay of the DeepSeek test split): "
        "LLaPor + PreSched; best non-learned policy{1}",
        (
            ("prefetch", "10 %, gh200-nvlink-c2c: hit rate, modeled TPOT, LLaPor + PreSched"),
            ("prefetch", "10 %, gh200-nvlink-c2c: hit rate, modeled TPOT, best non-learned"),
        ),
    ),
    (
        "LLaPor recall@6, DeepSeek test split (expert ids only); best baseline (co-occurrence)",
        (
            ("splits", "LLaPor recall@6, grouped test"),
            ("splits", "baseline cooccurrence recall@6, grouped test"),
        ),
    ),
    (
        "LLaPor recall@4, tiny's held-out requests (with gate inputs)",
        (("predictors", "tiny LLaPor held-out recall@k"),),
    ),
    (
        "LLaPor's per-layer call, DeepSeek (batch 1, one thread)",
        (("predictors", "LLaPor inference ms/layer (deepseek"),),
    ),
    (
        "the runtime's decision per MoE layer (batch 1: LRU, substitution, prefetch)",
        (("replay", "per-layer decision, lru"),),
    ),
    (
        "SMoE substitution at alpha 0.3 on tiny: perplexity change; greedy agreement",
        (("live", "alpha=0.3 perplexity change"), ("live", "alpha=0.3 greedy agreement")),
    ),
)


def _link(path: Path) -> str:
    return f"[{path.name}](bench/results/{path.name})"


def _figure(benches: dict, bench: str, start: str, path: Path) -> dict:
    figures = benches.get(bench, {}).get("figures", [])
    f = next((f for f in figures if f["name"].startswith(start)), None)
    if f is None:
        raise SystemExit(f"readme_table: no {bench} figure starting {start!r} in {path}; update RUN_ALL_ROWS")
    return f


def run_all_rows(run_all: Path = RUN_ALL) -> tuple[list[str], list[str]]:
    """The table's rows from run_all.json, and the note on when and where they were measured."""
    from bench.figures import describe_machine

    benches = json.loads(run_all.read_text())["benches"]
    rows, used, bases = [], {}, {}
    for label, figures in RUN_ALL_ROWS:
        got = [_figure(benches, bench, start, run_all) for bench, start in figures]
        rests = [f["name"][len(start) :] for f, (_, start) in zip(got, figures)]
        value = "; ".join(f["value"] for f in got)
        rows.append(f"| {label.format(*rests)} | {value} | {_link(run_all.with_suffix('.md'))} |")
        for f, (bench, _) in zip(got, figures):
            used[bench] = benches[bench]
            if f.get("tpot_basis"):
                bases[f["tpot_basis"]] = True
    dates = sorted({b["date"] for b in used.values()})
    machines = sorted({describe_machine(b["machine"]) for b in used.values()})
    span = dates[0] if len(dates) == 1 else f"{dates[0]} to {dates[-1]}"
    notes = [f"The {run_all.with_suffix('.md').name} rows: measured {span} on {' and '.join(machines)}."]
    notes += [f"Modeled TPOT there: the mean over {basis}." for basis in bases]
    return rows, notes


def tiers_row(results: Path = RESULTS, spec: tuple = TIERS) -> str:
    """The disk tier's row: measured TPOT of the best ``spec`` configuration and the ones beside it,
    at its capacity, the experts on disk; the layer count from the run's .md."""
    name, capacity, best_of, beside = spec
    path = results / f"{name}.json"
    rows = [r for r in json.loads(path.read_text()) if r.get("capacity") == capacity]
    # the noise floor repeats LRU: the host's spread, not a configuration
    ok = {r["config"]: r["measured_tpot_ms"] for r in rows
          if r.get("status", "").startswith("ok") and r.get("measured_tpot_ms") and not r.get("runs_tpot_ms")}  # fmt: skip
    candidates = [c for c in ok if c.startswith(best_of)]
    missing = [c for c in beside if c not in ok]
    if not candidates or missing:
        raise SystemExit(f"readme_table: {path} lacks {missing or best_of + '*'} at {capacity}; update TIERS")
    best = min(candidates, key=ok.get)
    md = path.with_suffix(".md")
    found = re.search(r"(\d+) MoE layers", md.read_text()) if md.is_file() else None
    shape = f", {found.group(1)} MoE layers" if found else ""
    times = "; ".join(f"{c} {ok[c]:.0f} ms" for c in (best, *beside))
    return (
        f"| TPOT with the experts on disk, CPU only, {capacity * 100:g} % of them resident in RAM "
        f"(DeepSeek-V2-Lite shape{shape}): the best LLaPor policy, {', '.join(beside)} | {times} | {_link(md)} |"
    )


def gpu_row(results: Path = RESULTS, name: str = GPU) -> str:
    """The GPU's row: one run of bench/bench_gpu.py (``name``.json), the DeepSeek-shaped model's
    measured TPOT per configuration."""
    path = results / f"{name}.json"
    rows = [r for r in json.loads(path.read_text()) if r.get("model") == "deepseek-shaped"]
    tpot = [r for r in rows if r.get("kind") == "tpot" and r.get("status", "").startswith("ok")]
    if not tpot:
        raise SystemExit(f"readme_table: {path} has no measured DeepSeek-shaped TPOT; update GPU")
    # the layer count is in accelerate's row ("6 of 26" layers resident)
    layers = next((r["resident_layers"].split(" of ")[-1] for r in rows if r.get("resident_layers")), None)
    shape = f", {layers} MoE layers" if layers else ""
    times = "; ".join(f"{r['config']} {r['measured_tpot_ms']:.1f} ms" for r in tpot)
    return (
        f"| TPOT on an {name[4:].replace('-', ' ')}, {tpot[0]['capacity'] * 100:g} % of experts resident "
        f"(DeepSeek-V2-Lite shape{shape}) | {times} | {_link(path.with_suffix('.md'))} |"
    )


def results_table(results: Path = RESULTS) -> str:
    """The README's headline results table and the notes under it."""
    rows, notes = run_all_rows(results / RUN_ALL.name)
    lines = [
        "| measured | value | results file |",
        "|---|---|---|",
        tiers_row(results),
        gpu_row(results),
        *rows,
    ]
    notes.append(
        "Each results file gives its command, machine and date; every figure measured, with its command: "
        "[bench/results/run_all.md](bench/results/run_all.md)."
    )
    return "\n".join(lines) + "\n\n" + " ".join(notes)


def commands_table() -> str:
    """One row per ``moecast`` subcommand, in moecast/cli.py's order, with its docstring's first line."""
    from moecast.cli import COMMANDS, _describe

    lines = ["| command | what it does |", "|---|---|"]
    for name, target in COMMANDS.items():
        for sub, t in target.items() if isinstance(target, dict) else [("", target)]:
            lines.append(f"| `moecast {(name + ' ' + sub).strip()}` | {_describe(t)} |")
    return "\n".join(lines)


def render(text: str) -> str:
    """``text`` (the README) with both generated blocks rewritten between their markers."""
    for key, body in (("commands", commands_table()), ("results", results_table())):
        begin, end = f"<!-- {key}: generated by bench/readme_table.py -->", f"<!-- end {key} -->"
        if begin not in text or end not in text:
            raise SystemExit(f"readme_table: README.md lacks the markers {begin} ... {end}")
        head, rest = text.split(begin, 1)
        text = f"{head}{begin}\n{body}\n{end}{rest.split(end, 1)[1]}"
    return text


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="exit 1 when README.md is not up to date")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    text = README.read_text()
    new = render(text)
    if args.check:
        if new != text:
            raise SystemExit("README.md's generated tables are out of date: run python bench/readme_table.py")
        return
    if new != text:
        tmp = README.with_name(README.name + ".tmp")
        tmp.write_text(new)
        tmp.replace(README)
    print(f"{README.name}: tables {'rewritten' if new != text else 'already up to date'}")


if __name__ == "__main__":
    main()
