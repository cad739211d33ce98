"""LLaPor prefetch against every non-learned policy at 10 % and 25 % capacity on the held-out
DeepSeek requests.

    python bench/bench_prefetch.py --checkpoint runs/llapor_ds.safetensors [--traces traces/ds-puffin]

Per hardware profile, replays the test side of the checkpoint's own split (``TraceSet.splits``,
requests it never trained or selected on), cold per request, as ``moecast replay --holdout test
--cold`` does: the non-learned policies, LLaPor prefetch, PreSched with and without LLaPor, and PreSched
with the oracle (a bound). A miss computed on the CPU moves nothing but is not a hit, so PreSched
can cut the step time while its hit rate falls: every row gives both.

At 10 % DeepSeek-V2-Lite keeps 6 of 64 experts per layer, its top-k: every token's experts evict
the last token's, so LRU, LFU and Belady hit the same; 25 % is where the policies part. Belady is
the offline bound, so the best non-learned row is the best online one (LRU, LFU or the static
table). The imported traces are prefill only: the modeled TPOT averages every token replayed as a
decode step, and each row says so (``tpot_basis``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

HARDWARE = ("prescope-a100-pcie4", "gh200-nvlink-c2c")
ONLINE = ("lru", "lfu", "static")
NON_LEARNED = (*ONLINE, "belady")
HOLDOUT = "test"
CAPACITIES = (0.1, 0.25)


def configurations(checkpoint: Path) -> dict[str, tuple[str, str | None]]:
    """Row name -> (policy, predictor); None is the policy's own default."""
    return {
        **{p: (p, None) for p in NON_LEARNED},
        "LLaPor prefetch": ("prefetch", str(checkpoint)),
        "PreSched, no predictor": ("presched", "none"),
        "LLaPor + PreSched": ("presched", str(checkpoint)),
        "oracle + PreSched (bound)": ("presched", "oracle"),
    }


def measure(traces: Path, checkpoint: Path, hardware: str) -> dict[str, list]:
    """Row name -> one ReplayResult per capacity of :data:`CAPACITIES` on ``hardware``."""
    from moecast.collect.traceset import TraceSet
    from moecast.predictors.provenance import holdout
    from moecast.runtime.replay.engine import ReplayConfig, replay_capacities

    ts = TraceSet(traces)
    held_out = holdout(ts, HOLDOUT, [str(checkpoint)])[0]
    out = {}
    for name, (policy, predictor) in configurations(checkpoint).items():
        cfg = ReplayConfig(
            policy=policy,
            cold=True,
            predictor=predictor,
            hardware=hardware,
            requests=held_out,
            progress=False,
        )
        out[name] = replay_capacities(ts, cfg, list(CAPACITIES))
    return out


def capacity_rows(m: dict[str, list], c: int, hw: str) -> list[dict]:
    """The figures of one capacity (index ``c`` of :data:`CAPACITIES`) on one hardware profile: hit
    rate (the judged number) and modeled TPOT, with the replay's TPOT basis."""
    from bench.figures import row

    pct = f"{CAPACITIES[c]:.0%}".replace("%", " %")
    res = {name: m[name][c] for name in m}
    best = max(ONLINE, key=lambda p: res[p].hit_rate)
    q = f"the checkpoint's test requests ({res[best].requests}), cold, capacity {pct}; {hw}"

    def fig(label: str, name: str, goal: str = "", verdict: str = "", note: str = "") -> dict:
        r = res[name]
        value = f"{r.hit_rate:.3f}, {r.modeled_tpot_ms:.1f} ms"
        title = f"{pct}, {hw}: hit rate, modeled TPOT, {label}"
        return row("prefetch", title, value, goal, verdict, note, r.hit_rate, r.tpot_basis)

    out = [fig(f"best non-learned ({best})", best, note=q)]
    for name in ("LLaPor prefetch", "LLaPor + PreSched"):
        # judged on the exact rates, not the rounded print
        verdict = "ok" if res[name].hit_rate > res[best].hit_rate else "MISS"
        out.append(fig(name, name, f"> {best}", verdict, q))
    # the same scheduler without prefetch: what LLaPor adds under PreSched, in hit rate and time
    out.append(fig("PreSched without a predictor", "PreSched, no predictor"))
    out.append(fig("oracle + PreSched (bound)", "oracle + PreSched (bound)"))
    out.append(fig("Belady (bound)", "belady", note="offline: knows every future access"))
    return out


def rows(quick: bool, ds_traces: Path, ds_checkpoint: Path | None = None) -> list[dict]:
    """The same in ``quick`` and full runs (the held-out requests take a few minutes)."""
    from bench.figures import first_file, missing

    ckpt = first_file(ds_checkpoint)
    if ckpt is None or not Path(ds_traces).is_dir():
        return [missing("prefetch", "no DeepSeek LLaPor checkpoint or traces")]
    out: list[dict] = []
    for hw in HARDWARE:
        m = measure(Path(ds_traces), ckpt, hw)
        for c in range(len(CAPACITIES)):
            out += capacity_rows(m, c, hw)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--traces", default="traces/ds-puffin")
    ap.add_argument(
        "--checkpoint", default="runs/llapor_ds.safetensors", help="LLaPor checkpoint for --traces"
    )
    ap.add_argument("--hardware", default=",".join(HARDWARE), help="comma-separated hardware profiles")
    args = ap.parse_args()
    for hw in args.hardware.split(","):
        m = measure(Path(args.traces), Path(args.checkpoint), hw)
        for c, cap in enumerate(CAPACITIES):
            print(f"{hw}: the checkpoint's test requests of {args.traces}, cold, capacity {cap:g}")
            for name, res in m.items():
                r = res[c]
                print(f"  {name:<28} hit {r.hit_rate:.3f}  modeled TPOT {r.modeled_tpot_ms:6.1f} ms")
        print(f"TPOT basis: {next(iter(m.values()))[0].tpot_basis}")


if __name__ == "__main__":
    main()
