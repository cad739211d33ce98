"""LLaPor prefetch against every non-learned policy at 10 % capacity on the held-out DeepSeek requests.

    python bench/bench_prefetch.py --checkpoint runs/llapor_ds.safetensors [--traces traces/ds-puffin]

Per hardware profile, replays the test side of the checkpoint's own split (``TraceSet.splits``,
requests it never trained or selected on), cold per request, as ``moecast replay --holdout test
--cold`` does: the non-learned policies, LLaPor prefetch, PreSched with and without LLaPor, and PreSched
with the oracle (a bound). A miss computed on the CPU moves nothing but is not a hit, so PreSched
can cut the step time while its hit rate falls: every row gives both.
"""

from __future__ import annotations

import argparse
from pathlib import Path

HARDWARE = ("prescope-a100-pcie4", "gh200-nvlink-c2c")
NON_LEARNED = ("lru", "lfu", "static", "belady")
HOLDOUT = "test"
CAPACITY = "0.1"


def configurations(checkpoint: Path) -> dict[str, tuple[str, str | None]]:
    """Row name -> (policy, predictor); None is the policy's own default."""
    return {
        **{p: (p, None) for p in NON_LEARNED},
        "LLaPor prefetch": ("prefetch", str(checkpoint)),
        "PreSched, no predictor": ("presched", "none"),
        "LLaPor + PreSched": ("presched", str(checkpoint)),
        "oracle + PreSched (bound)": ("presched", "oracle"),
    }


def measure(traces: Path, checkpoint: Path, hardware: str) -> dict[str, tuple[float, float]]:
    """Row name -> (hit rate, modeled TPOT ms) on ``hardware``."""
    from moecast.collect.traceset import TraceSet
    from moecast.predictors.provenance import holdout
    from moecast.runtime.replay import ReplayConfig, replay

    ts = TraceSet(traces)
    held_out = holdout(ts, HOLDOUT, [str(checkpoint)])[0]
    out = {}
    for name, (policy, predictor) in configurations(checkpoint).items():
        cfg = ReplayConfig(
            policy=policy,
            capacity=CAPACITY,
            cold=True,
            predictor=predictor,
            hardware=hardware,
            requests=held_out,
            progress=False,
        )
        res = replay(ts, cfg)
        out[name] = (float(res.hit_rate), float(res.modeled_tpot_ms))
    return out


def rows(quick: bool, ds_traces: Path, ds_checkpoint: Path | None = None) -> list[dict]:
    """The same in ``quick`` and full runs (the held-out requests take about a minute)."""
    from bench.figures import fig, first_file, missing, row

    ckpt = first_file(ds_checkpoint)
    if ckpt is None or not Path(ds_traces).is_dir():
        return [missing("prefetch", "no DeepSeek LLaPor checkpoint or traces")]
    out: list[dict] = []
    for hw in HARDWARE:
        m = measure(Path(ds_traces), ckpt, hw)
        hits = {name: v[0] for name, v in m.items()}
        t = {name: f"modeled TPOT {v[1]:.1f} ms" for name, v in m.items()}
        best = max(NON_LEARNED, key=lambda p: hits[p])
        q = f"the checkpoint's test requests, cold, capacity 10 %; {hw}"
        out.append(
            fig("prefetch", f"10 % hit, best non-learned ({best}), {hw}", hits[best], note=f"{t[best]}; {q}")
        )
        for name in ("LLaPor prefetch", "LLaPor + PreSched"):
            # judged on the exact rates, not the rounded print
            verdict = "ok" if hits[name] > hits[best] else "MISS"
            out.append(
                row(
                    "prefetch",
                    f"10 % hit, {name}, {hw}",
                    f"{hits[name]:.3f}",
                    f"> {best}",
                    verdict,
                    f"{t[name]}; {q}",
                    hits[name],
                )
            )
        # the same scheduler without prefetch: what LLaPor adds under PreSched, in hit rate and time
        for name in ("PreSched, no predictor", "oracle + PreSched (bound)"):
            label = "PreSched without a predictor" if name.startswith("PreSched,") else name
            out.append(fig("prefetch", f"10 % hit, {label}, {hw}", hits[name], note=t[name]))
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
        print(f"{hw}: the checkpoint's test requests of {args.traces}, cold, capacity {CAPACITY}")
        for name, (hit, tpot) in measure(Path(args.traces), Path(args.checkpoint), hw).items():
            print(f"  {name:<28} hit {hit:.3f}  modeled TPOT {tpot:6.1f} ms")


if __name__ == "__main__":
    main()
