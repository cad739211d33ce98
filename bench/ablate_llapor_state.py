"""Ablation: which hidden state of layer l-1 should LLaPor read? Trains LLaPor twice and prints val recall.

PreScope §4.2.1 feeds layer l's predictor the PCA of layer l-1's gate input a (Eq. 1: the
attention output that layer l-1's router reads), plus layer l-1's experts and weights; from
those the block output x' = sum_i w_i Expert_i(a) (+ residual) is determined, but the network
has to learn the experts to use it. This bench compares

- ``gate_input``: the paper's feature, as ``configs/llapor_tiny.yaml`` trains it;
- ``layer_output``: the same network and features, with layer l-1's gate input replaced by layer
  l's input hidden state (layer l-1's block output, per-token RMS-normalised, PCA as the data
  module does: same components per layer). It is known only once layer l-1's experts have run,
  so a runtime using it gets less lead time for the prefetch (layer l's attention only, instead
  of layer l-1's experts plus layer l's attention), and moecast's attach point (the experts
  interface) does not see it: hence an ablation, not a feature.

- ``speculative``: the paper's features plus one more dense block per layer: the PCA of layer l's
  state after layer l's own attention run early, at layer l-1's gate input
  (``bench_predictors.speculative_state``: earlier tokens' keys and values exact, as a decode
  step's KV cache holds them; the token's own from its residual before layer l-1's experts).
  Layer l's attention over the context is what LLaPor's inputs lack (the "how far layer l-1 can
  see" reference in ``bench_predictors.py``); this row measures what the model's own attention
  weights add. A runtime would have to run each layer's attention twice and attach to the
  attention modules, so it is an ablation, not a feature.

The hidden states are recomputed with the model that produced the traces (teacher-forced on each
request's tokens; the bench checks the recomputed routing matches the trace's). Same split,
seed, config and epochs for every row::

    python bench/ablate_llapor_state.py --traces traces/tiny-sg8192 --max-requests 1024 --epochs 8
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

VARIANTS = ("gate_input", "layer_output", "speculative")


def layer_states(model: Any, dm: Any, moe_layers: list[int], variant: str) -> tuple[np.ndarray, float]:
    """[N, L, H] float32 for the data module's token table, and the share of (token, layer) top-k
    sets the model's recomputed routing reproduces. ``layer_output``: row (t, l) is MoE layer
    l+1's input hidden state of token t (zeros at l = L-1). ``speculative``: row (t, l) is layer
    l's speculative state (zeros at l = 0)."""
    from bench_predictors import speculative_state
    from moecast.predictors.metrics import recall_per_row

    lens = dm.ts.request_lengths(dm.train_ids + dm.val_ids)
    L, layers = len(moe_layers), model.model.layers
    if variant == "speculative" and any(b != a + 1 for a, b in itertools.pairwise(moe_layers)):
        raise SystemExit("the speculative row needs MoE layers that follow each other")
    out = np.zeros((len(dm.topk), L, model.config.hidden_size), np.float32)
    mout: dict[int, torch.Tensor] = {}  # MoE layer -> its block output (what layer l-1's experts add)
    hooks = [
        layers[m].mlp.register_forward_hook(lambda mod, a, o, li=li: mout.__setitem__(li, o[0]))
        for li, m in enumerate(moe_layers)
    ]
    hits, start = [], 0
    try:
        with torch.no_grad():
            for n in lens:
                tok = torch.from_numpy(dm.token_ids[start : start + n])[None]
                res = model(input_ids=tok, output_hidden_states=True, output_router_logits=True)
                hs = res.hidden_states  # hs[m]: decoder layer m's input
                if variant == "speculative":
                    pe = model.model.rotary_emb(hs[0], torch.arange(n)[None])
                    for li in range(1, L):
                        m = moe_layers[li]
                        state = speculative_state(layers[m], hs[m][0], hs[m][0] - mout[li - 1], pe)
                        out[start : start + n, li] = state.float().numpy()
                else:
                    for li in range(L - 1):
                        x = hs[moe_layers[li + 1]][0].float()
                        x = x * x.pow(2).mean(-1, keepdim=True).add(1e-6).rsqrt()
                        out[start : start + n, li] = x.numpy()
                logits = torch.stack([r.reshape(n, -1) for r in res.router_logits], 1).float().numpy()
                hits.append(recall_per_row(logits, dm.topk[start : start + n]).ravel())
                start += n
    finally:
        for h in hooks:
            h.remove()
    return out, float(np.concatenate(hits).mean())


def _pca_states(dm: Any, states: np.ndarray, variant: str) -> np.ndarray:
    """[N, L, pca_max] the PCA of each layer row of ``states``, fit on the training rows with the
    data module's dims and seed."""
    from sklearn.decomposition import PCA

    n_train = len(dm.train_rows)
    fit = np.arange(0, n_train, max(1, n_train // dm.hparams.pca_fit_rows))
    state = np.zeros((len(states), dm.spec.num_layers, dm.spec.pca_max), np.float32)
    # layer_output: row l feeds layer l+1 (as the gate input's PCA does); speculative: row l is layer l's
    dims_by_row = dm.spec.pca_dims[:-1] if variant == "layer_output" else [0, *dm.spec.pca_dims[1:]]
    for li, dims in enumerate(dims_by_row):
        if dims:
            pca = PCA(n_components=dims, random_state=dm.hparams.seed).fit(states[fit, li])
            state[:, li, :dims] = pca.transform(states[:, li])
    return state


def _variant_state(dm: Any, variant: str, args: argparse.Namespace) -> np.ndarray:
    """The ``variant``'s states of ``dm``'s tokens, recomputed with ``--model`` (which must reproduce
    the traces' routing), as their PCA per layer."""
    from moecast.collect.models import load_model

    if not dm.spec.gate_pca:
        raise SystemExit(f"{args.traces}: no gate inputs; the ablation compares against them")
    states, agree = layer_states(load_model(args.model)[0], dm, list(dm.ts.meta.model.moe_layers), variant)
    if agree < 0.99:
        raise SystemExit(
            f"--model {args.model} reproduces only {agree:.1%} of the traces' routing; "
            "pass the model that collected them"
        )
    print(f"  {variant} {states.shape}: recomputed routing matches {agree:.4%} of the trace")
    return _pca_states(dm, states, variant)


def _data_module(variant: str, args: argparse.Namespace) -> type:
    """LLaPor's data module with the ``variant``'s state in the dense features (``gate_input``: as is)."""
    from moecast.train.data import LLaPorDataModule

    class DataModule(LLaPorDataModule):
        def setup(self, stage: str | None = None) -> None:
            if self._built:
                return
            super().setup(stage)
            self.state = None
            if variant == "gate_input":
                return
            self.state = _variant_state(self, variant, args)

        def batch(self, rows: np.ndarray) -> dict[str, torch.Tensor]:
            out = super().batch(rows)
            if self.state is None:
                return out
            if variant == "layer_output":
                # layer l reads row l-1: layer l's input instead of l-1's gate input
                out["dense"][:, 1:, : self.spec.pca_max] = torch.from_numpy(self.state[rows][:, :-1])
            else:  # the extra context block (the last dense block) holds layer l's speculative state
                out["dense"][:, :, -self.spec.pca_max :] = torch.from_numpy(self.state[rows])
            return out

    return DataModule


def run(variant: str, args: argparse.Namespace, cfg: dict[str, Any]) -> dict[str, Any]:
    import lightning.pytorch as pl

    sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_predictors
    from moecast.train.llapor import LLaPorModule

    DataModule = _data_module(variant, args)
    if variant not in VARIANTS:
        raise SystemExit(f"unknown variant {variant!r}; choose from {', '.join(VARIANTS)}")
    pl.seed_everything(cfg["train"].get("seed", 0))
    data = {**cfg["data"], "max_requests": args.max_requests}
    if variant == "speculative":
        data["context_gate"] = int(data.get("context_gate") or 0) + 1
    dm = DataModule(args.traces, **data)
    module = LLaPorModule(**cfg["model"])
    trainer = pl.Trainer(
        max_epochs=args.epochs,
        accelerator="cpu",
        devices=1,
        gradient_clip_val=cfg["train"].get("gradient_clip_val"),
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,
        num_sanity_val_steps=0,
    )
    t = time.perf_counter()
    trainer.fit(module, dm)
    res = module.last_val
    return {
        "variant": variant,
        "recall": res["recall_at_k"],
        "per_layer": res["per_layer"],
        "s": time.perf_counter() - t,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--traces", default="traces/tiny-sg8192", help="TraceSet with gate inputs")
    ap.add_argument(
        "--model",
        default="tiny",
        help="the model that collected the traces (as moecast collect --model takes it)",
    )
    ap.add_argument("--config", default="configs/llapor_tiny.yaml")
    ap.add_argument("--max-requests", type=int, default=1024)
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    args = ap.parse_args()
    with open(args.config) as f:
        cfg = yaml.safe_load(f)

    def line(r: dict[str, Any]) -> str:
        layers = " ".join(f"{x:.3f}" for x in r["per_layer"])
        return f"  {r['variant']:<13} {r['recall']:.4f}   per layer {layers}   {r['s']:.0f} s"

    rows = []
    for v in args.variants.split(","):
        rows.append(run(v, args, cfg))
        # each variant takes minutes: its figure survives a later kill
        print("done:" + line(rows[-1]), flush=True)
    print(
        f"\nLLaPor val recall@k, {args.traces}, {args.max_requests} requests, {args.epochs} epochs ({args.config}):"
    )
    for r in rows:
        print(line(r))


if __name__ == "__main__":
    main()
