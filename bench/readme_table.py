"""The README's generated tables: the commands (from moecast/cli.py) and the results (from bench/results).

    python bench/readme_table.py          # rewrite both tables between their markers in README.md
    python bench/readme_table.py --check  # exit 1 when README.md differs from what they would be

The results table picks the headline rows of bench/results/run_all.json (:data:`RESULTS`), beside
them the same figures as measured on the ungrouped split of earlier versions
(bench/results/ungrouped-split.json, :data:`BEFORE`), and under it one line per GPU run of
bench/bench_gpu.py (bench/results/gpu-*.json), so every figure in the README comes from a file under
bench/results; ``bench/run_all.py`` refreshes run_all.json, and this script the README.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
RUN_ALL = ROOT / "bench" / "results" / "run_all.json"
UNGROUPED = RUN_ALL.with_name("ungrouped-split.json")

# (bench, the start of the figure's name in run_all.json, how the README names it; {rest} in the
# label stands for the rest of the figure's name, such as the policy a "best" row picked). At 10 %
# DeepSeek keeps exactly its top-k experts per layer, where LRU, LFU and Belady coincide: 25 % is
# where the policies part, so the headline shows both.
RESULTS = (
    ("collect", "tracing overhead on tiny", "tracing overhead while collecting"),
    ("import", "import of", "import of the 1,999 DeepSeek trace files"),
    ("replay", "full Puffin replay", "replay of every DeepSeek trace{rest}"),
    ("replay", "per-layer decision, lru", "the runtime's decision per MoE layer (batch 1)"),
    ("splits", "LLaPor recall@6, grouped test", "LLaPor recall@6, DeepSeek test split (expert ids only)"),
    (
        "splits",
        "baseline cooccurrence recall@6, grouped test",
        "best baseline recall@6, DeepSeek test split (co-occurrence)",
    ),
    ("predictors", "tiny LLaPor held-out recall@k", "LLaPor recall@4, tiny (with gate inputs)"),
    ("predictors", "LLaPor inference ms/layer (deepseek", "LLaPor's per-layer call, DeepSeek"),
    *(
        ("prefetch", f"{cap} %, gh200-nvlink-c2c: hit rate, modeled TPOT, {config}", label)
        for cap, first in (
            (10, "hit rate, modeled TPOT, 10 % of experts resident (GH200, test split)"),
            (25, "... at 25 %"),
        )
        for config, label in (
            ("best non-learned", f"{first}: best non-learned policy{{rest}}"),
            ("LLaPor prefetch", "... LLaPor prefetch"),
            ("LLaPor + PreSched", "... LLaPor + PreSched"),
        )
    ),
    ("casmoe", "EAM latency per prompt, int8 2 threads", "CasMoE EAM plan per prompt (CPU, int8, 2 threads)"),
    ("live", "live runtime overhead at full residency", "live runtime overhead, all experts resident"),
    ("live", "alpha=0.3 perplexity change", "SMoE substitution at alpha 0.3: perplexity change"),
    ("live", "alpha=0.3 greedy agreement", "SMoE substitution at alpha 0.3: greedy agreement"),
)


# (bench, start) of a row of RESULTS -> (bench, start) of the same figure in UNGROUPED: what it read
# on the ungrouped held-out split, where 19 of 200 prompts were copies of training prompts.
BEFORE = {
    ("splits", "LLaPor recall@6, grouped test"): ("predictors", "LLaPor DeepSeek held-out recall@6"),
    ("splits", "baseline cooccurrence recall@6, grouped test"): (
        "predictors",
        "baseline cooccurrence recall@6",
    ),
    **{
        ("prefetch", f"10 %, gh200-nvlink-c2c: hit rate, modeled TPOT, {config}"): (
            "prefetch",
            f"10 % hit, {config}",
            "gh200-nvlink-c2c",  # the A100 rows share the start
        )
        for config in ("best non-learned", "LLaPor prefetch", "LLaPor + PreSched")
    },
}


def _figure(benches: dict, bench: str, start: str, path: Path, contains: str = "") -> dict:
    figures = benches.get(bench, {}).get("figures", [])
    f = next((f for f in figures if f["name"].startswith(start) and contains in f["name"]), None)
    if f is None:
        raise SystemExit(f"readme_table: no {bench} figure starting {start!r} in {path}; update RESULTS")
    return f


def results_table(run_all: Path = RUN_ALL, ungrouped: Path = UNGROUPED) -> str:
    """The README's results table and the lines that say where each figure comes from."""
    from bench.figures import describe_machine

    benches = json.loads(run_all.read_text())["benches"]
    before = json.loads(ungrouped.read_text())["benches"] if ungrouped.is_file() else {}
    old_dates = sorted({b["date"] for b in before.values()})
    lines = [
        f"| measured | value | before: ungrouped split ({', '.join(old_dates)}) | goal | bench |",
        "|---|---|---|---|---|",
    ]
    used: dict[str, dict] = {}
    bases: dict[str, list[str]] = {}
    for bench, start, label in RESULTS:
        f = _figure(benches, bench, start, run_all)
        old = BEFORE.get((bench, start))
        was = _figure(before, old[0], old[1], ungrouped, *old[2:])["value"] if old and before else ""
        goal = f"{f['goal']} ({f['verdict']})" if f["goal"] and f["verdict"] else f["goal"]
        lines.append(
            f"| {label.format(rest=f['name'][len(start) :])} | {f['value']} | {was} | {goal} | {bench} |"
        )
        used[bench] = benches[bench]
        if f.get("tpot_basis") and bench not in bases.setdefault(f["tpot_basis"], []):
            bases[f["tpot_basis"]].append(bench)
    dates = sorted({b["date"] for b in used.values()})
    machines = sorted({describe_machine(b["machine"]) for b in used.values()})
    span = dates[0] if len(dates) == 1 else f"{dates[0]} to {dates[-1]}"
    notes = [
        f"Measured {span} on {' and '.join(machines)} "
        "(`bench/results/run_all.md` gives each row's command and inputs).",
        *(
            f"Modeled TPOT of the {', '.join(names)} rows: the mean over {basis}."
            for basis, names in bases.items()
        ),
    ]
    if before:
        notes.append(
            "The before column: the same figures on the ungrouped held-out split of earlier versions, "
            "whose held-out prompts included copies of training prompts "
            f"(`bench/results/{ungrouped.name}`, which says what else has changed since)."
        )
    # each note its own paragraph
    extra = [*gpu_lines(run_all.parent), *tiers_lines(run_all.parent)]
    return "\n".join(lines) + "\n\n" + "\n\n".join([*notes, *extra])


def gpu_lines(results: Path) -> list[str]:
    """One line per GPU run of bench/bench_gpu.py (RESULTS/gpu-DEVICE.json): the DeepSeek-shaped
    model's measured TPOT per configuration."""
    out = []
    for path in sorted(results.glob("gpu-*.json")):
        rows = [r for r in json.loads(path.read_text()) if r.get("model") == "deepseek-shaped"]
        tpot = [r for r in rows if r.get("kind") == "tpot" and r.get("status", "").startswith("ok")]
        if not tpot:
            continue
        # the layer count is in accelerate's row ("6 of 26" layers resident)
        layers = next(
            (r["resident_layers"].split(" of ")[-1] for r in rows if r.get("resident_layers")), None
        )
        shape = f"{layers} MoE layers" if layers else "its MoE layers"
        times = ", ".join(f"{r['config']} {r['measured_tpot_ms']:.1f}" for r in tpot)
        out.append(
            f"On a GPU ({path.stem[4:].replace('-', ' ')}, `bench/results/{path.with_suffix('.md').name}`): the "
            f"DeepSeek-V2-Lite-shaped model, {shape}, {tpot[0]['capacity'] * 100:g} % of experts resident, "
            f"measured TPOT in ms: {times}."
        )
    return out


def tiers_lines(results: Path, capacity: float = 0.25) -> list[str]:
    """One line per run of bench/bench_tiers.py (RESULTS/tiers-HOST.json): measured TPOT per
    configuration at ``capacity``, the experts on disk; the layer count from the run's .md."""
    out = []
    for path in sorted(results.glob("tiers-*.json")):
        rows = [r for r in json.loads(path.read_text()) if r.get("capacity") == capacity]
        # the noise floor repeats LRU: the host's spread, not a configuration
        ok = [r for r in rows if r.get("status", "").startswith("ok") and r.get("measured_tpot_ms")
              and not r.get("runs_tpot_ms")]  # fmt: skip
        if not ok:
            continue
        md = path.with_suffix(".md")
        found = re.search(r"(\d+) MoE layers", md.read_text()) if md.is_file() else None
        shape = f"{found.group(1)} MoE layers" if found else "its MoE layers"
        times = ", ".join(f"{r['config']} {r['measured_tpot_ms']:.0f}" for r in ok)
        out.append(
            f"Experts on disk, CPU only (`bench/results/{md.name}`): the DeepSeek-V2-Lite-shaped model, {shape}, "
            f"{capacity * 100:g} % of experts resident in RAM, measured TPOT in ms: {times}."
        )
    return out


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
