"""Per-layer host cost of the live runtime: its decision, the predictor call and the bookkeeping (CPU).

    python bench/bench_layer_host.py [--tokens 48] [--requests 2] [--rounds 3] [--ds-layers 8] [--device-ops simulated]
        [--tiny-predictor CKPT] [--ds-predictor CKPT] [--traces NPZ] [--ref COMMIT] [--json PATH]

For each model and configuration at 25 % of the experts resident, decodes teacher-forced requests
under the live runtime and reads its own split of each decode step (``*_decode_ms`` of
:class:`moecast.runtime.live.runtime.LiveStats`), divided by the MoE layers: the median over decode steps
of the µs per layer of

- ``policy``: the experts calls' host work outside expert compute, transfer waits and predictor
  calls (the per-layer step's decision, reading the layer's ids, moving weights into slots, slot
  tables, the CPU split);
- ``predictor``: the layer-ahead predictor's calls (LLaPor's window and ``score_at``), and the
  online prefetcher's next-gate scores under smoe and presched;
- ``decision``: of ``policy``, the per-layer step's calls (:class:`moecast.runtime.core.step.LayerStep`'s
  route, layer and prefetch, and the ranking of the predicted experts), timed around each call.

Models: ``tiny`` (a built preset, default ``test``, float32, its own routing) and the DeepSeek-shaped
model of bench/ds_model.py at the test suite's sizes (64 experts, top-6, ``--ds-layers`` MoE layers,
float32), routed by held-out DeepSeek requests (``--traces``; without them its own random router).
Configurations: lru, lfu, smoe (tiny only: the recorded routing has no router probabilities),
presched (with the online prefetcher's next-gate scores, as the live runtime runs it without a
checkpoint) and LLaPor prefetch (``--tiny-predictor`` / ``--ds-predictor``; skipped without one).

``--ref COMMIT`` measures that commit's tree too, in the same run: a git worktree of it under a
temporary folder is imported instead of this tree (a package folder of links put first on
PYTHONPATH). Each round runs every tree once, in turn, each in a fresh process, so load from other
processes falls on both alike; the figures pool the decode steps of all rounds. Timings are host
wall clock under whatever else runs on the machine (the load average is printed).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "runs"
CAPACITY = 0.25
CONFIGS = ("lru", "lfu", "smoe", "presched", "LLaPor prefetch")
PARTS = ("policy", "decision", "predictor")
# moecast's subpackages, each a top-level folder (pyproject.toml [tool.setuptools.package-dir])
PACKAGES = ("collect", "predictors", "train", "runtime", "configs")


def _models(args: argparse.Namespace) -> list[tuple[str, object, object, list, int, object]]:
    """(name, model, routing, requests, prompt, predictor) for tiny and the DeepSeek-shaped model."""
    import torch

    sys.path.insert(0, str(ROOT / "bench"))
    import ds_model
    from moecast.collect.tiny import ensure_tiny
    from moecast.predictors.registry import load
    from transformers import AutoModelForCausalLM

    n = args.prompt + args.tokens
    out = []
    path = ensure_tiny(args.tiny_preset)
    tiny = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    gen = np.random.default_rng(0)
    reqs = [gen.integers(4, tiny.config.vocab_size, n) for _ in range(args.requests)]
    pred = load(args.tiny_predictor) if args.tiny_predictor and Path(args.tiny_predictor).is_file() else None
    out.append(("tiny", tiny, ds_model.Routing(), reqs, args.prompt, pred))
    from bench_gpu import DS_TEST_SHAPE

    cfg = ds_model.ds_config(args.ds_layers, **DS_TEST_SHAPE)
    ds = ds_model.build_ds_model(cfg, torch.float32, "cpu")
    traces = args.traces if args.traces and Path(args.traces).exists() else None
    routing = ds_model.load_routing(traces, args.requests, n, args.ds_layers, cfg.vocab_size)
    if routing.recorded:
        reqs = [r.tokens[:n] for r in routing.requests]
        for r in routing.requests:
            r.topk_ids = r.topk_ids[:n]
    else:
        reqs = [gen.integers(0, cfg.vocab_size, n) for _ in range(args.requests)]
    pred = None
    if routing.recorded and args.ds_predictor and Path(args.ds_predictor).is_file():
        pred = ds_model.ds_predictor(args.ds_predictor, routing, args.ds_layers)
    out.append(("deepseek-test", ds, routing, reqs, args.prompt, pred))
    return out


def _config(name: str, predictor: object, routing: object) -> dict | str:
    """attach() arguments of a configuration, or why it is skipped."""
    if name == "LLaPor prefetch":
        return dict(policy="prefetch", predictor=predictor) if predictor is not None else "no checkpoint"
    if name == "smoe" and getattr(routing, "recorded", False):
        return "the recorded routing has no router probabilities"
    if name == "presched":
        return dict(policy="presched", prefetch="online")
    return dict(policy=name)


def _time_decisions(acc: list[float]) -> None:
    """Add the wall time of every per-layer step call on the host's thread to ``acc[0]`` (LayerStep and
    the ranking)."""
    import threading
    import time

    from moecast.runtime.core import step
    from moecast.runtime.live import prefetch

    def timed(fn):
        def call(*a, **kw):
            if threading.current_thread() is not threading.main_thread():
                # the prediction thread's ranking (an accelerator's path): the predictor's, overlapped
                return fn(*a, **kw)
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                acc[0] += time.perf_counter() - t0

        return call

    for name in ("route", "layer", "prefetch"):
        setattr(step.LayerStep, name, timed(getattr(step.LayerStep, name)))
    prefetch.ranked_predictions = timed(prefetch.ranked_predictions)


def measure_tree(args: argparse.Namespace) -> dict:
    """Per (model, config): the decode steps' policy, decision and predictor µs per layer (this
    process's tree)."""
    import torch

    sys.path.insert(0, str(ROOT / "bench"))
    import ds_model
    from moecast.runtime.live import runtime as live
    from moecast.runtime.live.runtime import attach

    print(f"measuring the tree of {Path(live.__file__).parents[1]}", flush=True)
    torch.set_num_threads(1)
    acc = [0.0]
    _time_decisions(acc)
    res: dict[str, dict] = {}
    for name, model, routing, reqs, prompt, pred in _models(args):
        for cfg in CONFIGS:
            kw = _config(cfg, pred, routing)
            key = f"{name} | {cfg}"
            if isinstance(kw, str):
                res[key] = {"skipped": kw}
                continue
            ops = {"device_ops": "simulated"} if args.device_ops == "simulated" else {}
            rt = attach(model, capacity=CAPACITY, **ops, **kw)
            decided: list[float] = []

            def forward_done(decode: bool, rt=rt, decided=decided) -> None:
                if decode:
                    decided.append(acc[0] * 1e6 / rt.num_layers)
                acc[0] = 0.0

            try:
                with ds_model.routed(model, routing) as ov:
                    # a first request warms the caches and the compiled kernels: not counted
                    ds_model.decode_all(model, reqs[:1], prompt, torch.device("cpu"), routing, ov)
                    rt.reset_stats()
                    acc[0] = 0.0
                    ds_model.decode_all(
                        model, reqs, prompt, torch.device("cpu"), routing, ov, on_forward=forward_done
                    )
                st = rt.stats_
                res[key] = {
                    p: (np.array(getattr(st, f"{p}_decode_ms")) * 1e3 / rt.num_layers).tolist()
                    for p in ("policy", "predictor")
                }
                res[key]["decision"] = decided
            finally:
                rt.detach()
    return res


def ref_tree(commit: str, work: Path) -> Path:
    """A package folder importing ``commit``'s tree as moecast (put it first on PYTHONPATH)."""
    tree = work / "tree"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), commit],
                   check=True, capture_output=True)  # fmt: skip
    pkg = work / "pkg" / "moecast"
    pkg.mkdir(parents=True)
    for f in (tree / "moecast").iterdir():
        (pkg / f.name).symlink_to(f)
    for name in PACKAGES:
        (pkg / name).symlink_to(tree / name)
    return pkg.parent


def _child(args: argparse.Namespace, pythonpath: Path | None, out: Path) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(pythonpath), env.get("PYTHONPATH", "")]))
    argv = [a for a in sys.argv[1:] if a != "--child"]
    cmd = [sys.executable, __file__, *argv, "--child", "--child-out", str(out)]
    subprocess.run(cmd, env=env, check=True)
    return json.loads(out.read_text())


def run(args: argparse.Namespace) -> dict:
    """{tree: {(model | config): {part: [µs per layer per decode step]}}} over ``args.rounds`` rounds."""
    with tempfile.TemporaryDirectory(prefix="bench_layer_host-") as tmp:
        work = Path(tmp)
        trees: dict[str, Path | None] = {"this tree": None}
        if args.ref:
            trees = {f"ref {args.ref}": ref_tree(args.ref, work), **trees}
        pooled: dict[str, dict] = {t: {} for t in trees}
        try:
            for r in range(args.rounds):
                for tree, path in trees.items():
                    got = _child(args, path, work / f"{len(pooled[tree])}-{r}.json")
                    for key, v in got.items():
                        acc = pooled[tree].setdefault(key, {} if "skipped" not in v else v)
                        for p in PARTS:
                            if p in v:
                                acc.setdefault(p, []).extend(v[p])
        finally:
            if args.ref:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(work / "tree")],
                               capture_output=True)  # fmt: skip
    return pooled


def table(pooled: dict) -> str:
    trees = list(pooled)
    keys = list(next(iter(pooled.values())))
    head = "| model | config | " + " | ".join(f"{p} µs ({t})" for p in PARTS for t in trees) + " |"
    lines = [head, "|---|---|" + "---|" * (len(PARTS) * len(trees))]
    for key in keys:
        model, cfg = key.split(" | ")
        skipped = next((v["skipped"] for t in trees if "skipped" in (v := pooled[t].get(key, {}))), None)
        if skipped:
            lines.append(f"| {model} | {cfg} | skipped: {skipped} |" + " |" * (len(PARTS) * len(trees) - 1))
            continue
        cells = [f"{np.median(pooled[t][key][p]):.1f}" for p in PARTS for t in trees]
        lines.append(f"| {model} | {cfg} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=48, help="decode steps per request")
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--requests", type=int, default=2, help="timed requests (after one warm-up request)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ds-layers", type=int, default=8)
    ap.add_argument("--tiny-preset", default="test")
    ap.add_argument("--tiny-predictor", default=str(RUNS / "llapor_tiny_test.safetensors"))
    ap.add_argument("--ds-predictor", default=str(RUNS / "llapor_ds_nomem.safetensors"))
    ap.add_argument("--traces", default=str(RUNS / "ds_routing.npz"), help="ds_model.py --extract .npz")
    ap.add_argument("--ref", default=None, help="also measure this commit's tree, side by side")
    ap.add_argument(
        "--device-ops",
        default="cpu",
        choices=["cpu", "simulated"],
        help="simulated: the accelerator's path (copies on a transfer stream with events, the compute "
        "stream's waits, one device-to-host read a layer) on the simulated device",
    )
    ap.add_argument("--json", default=None, help="write the pooled per-step figures here")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        Path(args.child_out).write_text(json.dumps(measure_tree(args)))
        return
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}; cpus {os.cpu_count()}")
    pooled = run(args)
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"median µs per MoE layer over decode steps, capacity {CAPACITY:.0%}, {args.rounds} rounds, "
          f"device ops {args.device_ops}")  # fmt: skip
    print(table(pooled))
    if args.json:
        Path(args.json).write_text(json.dumps(pooled))


if __name__ == "__main__":
    main()
