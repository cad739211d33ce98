"""The benches' figures as data, and the table they are printed in.

A figure is a dict with the keys of :data:`KEYS`: the bench, the figure's name, its value as
printed, the goal, a verdict (``ok`` | ``MISS`` | ``""`` when there is no goal to judge |
``FAILED`` | ``MISSING`` | ``SKIPPED``), the value as a number (None when it is not one) and a
note. A figure that shows a modeled TPOT also carries the replay's ``tpot_basis`` (decode steps, or
every token of a prefill-only trace replayed as a step), so the tables say what the TPOT averages.
Every bench module returns a list of them from its ``rows`` function; bench/run_all.py prints,
stores and renders them.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Where the benches find their inputs unless told otherwise: where the README's commands put them.
PUFFIN = ROOT.parent / "shared" / "traces" / "deepseek-v2-lite-puffin"
DS_TRACES = ROOT / "traces" / "ds-puffin"
RUNS = ROOT / "runs"

KEYS = ("bench", "name", "value", "goal", "verdict", "number", "note")


def row(
    bench: str,
    name: str,
    value: str,
    goal: str = "",
    verdict: str = "",
    note: str = "",
    number=None,
    tpot_basis: str = "",
) -> dict:
    return {
        "bench": bench,
        "name": name,
        "value": value,
        "goal": goal,
        "verdict": verdict,
        "number": number,
        "note": note,
        "tpot_basis": tpot_basis,
    }


def judge(number: float | None, goal: str) -> str:
    """'ok' / 'MISS' for goals of the form '<= 10 %', '< 60 s', '>= 0.85', '>= 3 x'; '' otherwise."""
    if number is None or not goal:
        return ""
    m = re.match(r"\s*(<=|<|>=|>)\s*([-+\d.eE]+)", goal)
    if not m:
        return ""
    op, bound = m.group(1), float(m.group(2))
    ok = {"<=": number <= bound, "<": number < bound, ">=": number >= bound, ">": number > bound}[op]
    return "ok" if ok else "MISS"


def fig(
    bench: str,
    name: str,
    number: float | None,
    fmt: str = "{:.3f}",
    goal: str = "",
    note: str = "",
    judged: bool = True,
    tpot_basis: str = "",
) -> dict:
    """A numeric figure: ``fmt`` prints it, ``goal`` judges it (unless ``judged`` is False)."""
    if number is None:
        return row(bench, name, "see its log", goal, note=note, tpot_basis=tpot_basis)
    number = float(number)
    verdict = judge(number, goal) if judged else ""
    return row(bench, name, fmt.format(number), goal, verdict, note, number, tpot_basis)


def missing(bench: str, why: str, name: str = "(bench)", goal: str = "") -> dict:
    """An input the bench needs is absent (a checkpoint, a TraceSet, the built ``tiny``)."""
    return row(bench, name, why, goal, "MISSING")


def failed(bench: str, why: str) -> dict:
    return row(bench, "(bench)", why, verdict="FAILED")


def skipped(bench: str, why: str, name: str = "(bench)") -> dict:
    return row(bench, name, why, verdict="SKIPPED")


def shown(path: Path | str) -> str:
    """A path as a note shows it: relative to the repository when it lies inside it."""
    p = Path(path).resolve()
    try:
        return str(p.relative_to(ROOT))
    except ValueError:
        return str(path)


def first_file(*paths: Path | None) -> Path | None:
    return next((p for p in paths if p is not None and Path(p).is_file()), None)


def checkpoint_meta(path: Path) -> dict:
    """moecast's metadata from a .safetensors header, read without torch."""
    with open(path, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        header = json.loads(fh.read(n))
    return json.loads(header.get("__metadata__", {}).get("moecast", "{}"))


def tiny_built(preset: str = "default") -> bool:
    from moecast import home

    p = home() / "tiny" / preset
    return (p / "build_info.json").is_file() and (p / "config.json").is_file()


def loadavg() -> str:
    try:
        return "/".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "?"


def machine() -> dict:
    """CPU, cores, GPU and versions: what a timing in the table was measured on."""
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


def describe_machine(info: dict) -> str:
    return (
        f"{info.get('cpu', '?')}, {info.get('cores')} cores"
        + (f", GPU {info['cuda']}" if info.get("cuda") else ", no GPU")
        + f"; torch {info.get('torch')}, python {info.get('python')}"
    )


WIDTHS = (11, 56, 46, 24, 8)


def basis_note(f: dict) -> str:
    """A figure's note with its TPOT basis appended where it has one."""
    basis = f.get("tpot_basis") or ""  # figures stored before the key existed lack it
    return "; ".join(filter(None, [f["note"], f"TPOT over {basis}" if basis else ""]))


def format_table(figures: list[dict]) -> str:
    """The fixed-width table run_all prints: bench, figure, value, goal, verdict, note."""
    head = ["bench", "figure", "value", "goal", "verdict"]
    lines = ["  ".join(h.ljust(n) for h, n in zip(head, WIDTHS)) + "  note"]
    lines.append("-" * (sum(WIDTHS) + 2 * len(WIDTHS) + 30))
    for f in figures:
        cells = [f["bench"], f["name"], f["value"], f["goal"], f["verdict"]]
        lines.append("  ".join(str(c).ljust(n) for c, n in zip(cells, WIDTHS)) + "  " + basis_note(f))
    return "\n".join(lines)


def markdown_table(figures: list[dict]) -> str:
    """run_all.md's figures: a TPOT's basis gets a column of its own, so a reader sees which TPOTs
    average decode steps and which replay a prefill-only trace's tokens as steps."""

    def cell(s: object) -> str:
        return str(s).replace("|", "\\|")

    lines = [
        "| bench | figure | value | goal | verdict | TPOT over | note |",
        "|---|---|---|---|---|---|---|",
    ]
    for f in figures:
        cells = [f[k] for k in ("bench", "name", "value", "goal", "verdict")]
        cells += [f.get("tpot_basis") or "", f["note"]]
        lines.append("| " + " | ".join(cell(c) for c in cells) + " |")
    return "\n".join(lines)
