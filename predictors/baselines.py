"""Baseline predictors: frequency tables, gate reuse, and MoE-Infinity activation-matrix matching.

- ``HotTablePlanner``: the same global table as a prompt-ahead plan, the trivial baseline that
  ``--planner hot`` puts beside every planner in replay and compare.
- ``FrequencyPredictor`` (statistical; PreScope's hot-expert table, §4.1): ``mode="global"``
  scores every token with the training split's per-layer expert counts;
  ``mode="request"`` adds the counts of the request's own earlier tokens (prefix only),
  with the global table as a prior that breaks ties and covers the first token.
- ``PublishedPredictions``: MoE-Beyond's published per-token predictions read from their CSVs,
  so its model is compared on its own test prompts without being rerun.
- ``GateReusePredictor`` (layer-ahead; the gate-based strategy of PreScope §3.2 / Fate):
  applies layer l's own router weights to layer l-1's gate input, relying on the high
  cosine similarity of adjacent gate inputs. Layer 0 uses the previous token's layer-0
  gate input (that token has finished). Needs ``gate_inputs`` and the router weights,
  taken from a model directory (``from_model_dir``) and stored in the checkpoint.
- ``CooccurrencePredictor`` (layer-ahead, counts only): layer l's experts scored by how often
  each co-occurred, on the training split, with the current token's layer l-1 experts
  (summed over those k ids); layer 0 falls back to the global frequency table. The
  count-based reference for LLaPor on ID-only traces.
- ``ActivationMatrixPredictor`` (prompt-ahead; MoE-Infinity, as compared in MoE-Beyond §4):
  a collection of up to 1,000 request-level [L, E] expert-activation matrices from the
  training split; for token t the matrix of the prefix seen so far (tokens < t) is matched
  by cosine similarity and the best stored matrix's rows are the scores. Before any token
  is seen the collection's mean matrix is used.
"""

from __future__ import annotations

from abc import abstractmethod
from pathlib import Path
from typing import Any

import numpy as np
from moecast.collect.traceset import ModelInfo, RequestTrace, TraceSet
from moecast.predictors.base import LayerAhead, Predictor
from moecast.predictors.metrics import multi_hot
from moecast.predictors.provenance import split_record

from moecast.errors import InputError


def _model_meta(model: ModelInfo) -> dict[str, Any]:
    return {
        "fingerprint": model.fingerprint,
        "model_name": model.name_or_path,
        "moe_layers": list(model.moe_layers),
        "num_experts": model.num_experts,
        "top_k": model.top_k,
    }


def fitted_meta(ts: TraceSet, requests: list[str]) -> dict[str, Any]:
    """The header of a predictor fitted on ``requests`` of ``ts``: the model, the traces' path, and the
    ``split`` they were taken from (:func:`moecast.predictors.provenance.split_record`), so that
    `predictors eval` and `replay --holdout` never score a request it was fitted on as held out."""
    return {**_model_meta(ts.meta.model), "trained_on": str(ts.path), "split": split_record(ts, requests)}


class _Base(Predictor):
    def __init__(self, meta: dict[str, Any]) -> None:
        self.meta = dict(meta)
        self.moe_layers = list(meta["moe_layers"])
        self.num_layers = len(self.moe_layers)
        self.num_experts = int(meta["num_experts"])
        self.top_k = int(meta["top_k"])
        self.fingerprint = meta.get("fingerprint")

    def metadata(self) -> dict[str, Any]:
        return {**self.meta, **super().metadata()}

    @abstractmethod
    def tensors(self) -> dict[str, Any]:
        """Arrays stored in the checkpoint."""

    def save(self, path: str | Path) -> Path:
        """Write the checkpoint; its metadata must say what it was fitted on (``split``, None for nothing)."""
        from moecast.predictors.checkpoint import CheckpointError, save

        meta = self.metadata()
        # without it `predictors eval` cannot tell held-out requests from the ones it was fitted on
        if "split" not in meta:
            raise CheckpointError(
                f"the {self.name} predictor records no `split` (the requests it was fitted on); build its "
                "metadata with baselines.fitted_meta(ts, train_ids), or set meta['split'] = None when it "
                "was fitted on no request"
            )
        return save(path, self.tensors(), meta)


def expert_counts(topk: np.ndarray, num_experts: int) -> np.ndarray:
    """[L, E] counts of a [N, L, k] id array."""
    L = topk.shape[1]
    flat = (np.arange(L)[None, :, None] * num_experts + topk.astype(np.int64)).ravel()
    return np.bincount(flat, minlength=L * num_experts).reshape(L, num_experts).astype(np.float64)


def _check_model_dir(model_dir: Path, ts: TraceSet) -> None:
    """Refuse router weights from a model other than the one the traces came from (fingerprint)."""
    cfg = model_dir / "config.json"
    if not cfg.is_file():
        return  # not a Hugging Face folder; the weight-shape check below still applies
    import torch
    from moecast.collect.models import config_hash, fingerprint_of
    from transformers import AutoConfig

    m = ts.meta.model
    # the traces' expert size is in the dtype they were collected in; the fingerprint counts float32
    dtype = getattr(torch, str(ts.meta.collection.get("dtype", "float32")), torch.float32)
    numel = m.expert_bytes // max(torch.empty(0, dtype=dtype).element_size(), 1)
    try:
        got = fingerprint_of(m, config_hash(AutoConfig.from_pretrained(model_dir)), numel)
    except (OSError, ValueError):
        return
    if m.fingerprint and got != m.fingerprint:
        raise InputError(
            f"{model_dir} (fingerprint {got}) is not the model {ts.path} was collected from "
            f"(fingerprint {m.fingerprint}); re-collect the traces or point at that model"
        )


class FrequencyPredictor(_Base):
    """Global or per-request expert frequency (hot-expert table)."""

    name = "frequency"
    horizon = "statistical"

    def __init__(self, table: np.ndarray, meta: dict[str, Any]) -> None:
        super().__init__(meta)
        self.table = np.asarray(table, np.float64)
        self.mode = meta.get("mode", "global")
        if self.mode not in ("global", "request"):
            raise InputError(f"frequency mode must be global or request, got {self.mode!r}")

    @classmethod
    def fit(cls, ts: TraceSet, requests: list[str], mode: str = "global") -> FrequencyPredictor:
        if not requests:
            raise InputError(f"{ts.path}: no training requests to count experts on")
        counts = expert_counts(ts.array("topk_ids", requests), ts.num_experts)
        table = counts / counts.sum(1, keepdims=True)
        return cls(table, {**fitted_meta(ts, requests), "mode": mode, "train_requests": len(requests)})

    def score_request(self, trace: RequestTrace) -> np.ndarray:
        T = len(trace.topk_ids)
        prior = np.broadcast_to(self.table, (T, self.num_layers, self.num_experts)).astype(np.float32)
        if self.mode == "global":
            return prior.copy()
        hot = multi_hot(trace.topk_ids, self.num_experts, np.float32)
        before = np.cumsum(hot, 0) - hot  # counts of tokens < t only
        # the prior (< 1 per expert) only breaks ties among equal prefix counts
        return (before + prior).astype(np.float32)

    @property
    def label(self) -> str:
        return "frequency-request" if self.mode == "request" else "frequency"

    def tensors(self) -> dict[str, Any]:
        return {"table": self.table.astype(np.float32)}

    @classmethod
    def from_checkpoint(cls, tensors: dict[str, Any], meta: dict[str, Any], path: Path) -> FrequencyPredictor:
        return cls(tensors["table"].double().numpy(), meta)


class HotTablePlanner(FrequencyPredictor):
    """The global hot-expert table as a prompt-ahead plan (``--planner hot``): every prompt gets
    the training requests' per-layer expert frequencies. What a planner costs nothing to beat."""

    name = "hot"
    horizon = "prompt-ahead"

    @classmethod
    def fit(cls, ts: TraceSet, requests: list[str], mode: str = "global") -> HotTablePlanner:
        pred = super().fit(ts, requests, "global")
        return cls(pred.table, pred.meta)

    def plan(self, prompt: str) -> tuple[np.ndarray, str]:
        return self.table.astype(np.float32), "hot"

    def observe(self, prompt: str, ep: np.ndarray) -> bool:
        return False  # a fixed table: nothing learns from new prompts

    @property
    def label(self) -> str:
        return "hot"


class PublishedPredictions(_Base):
    """MoE-Beyond's published predictions (``test_datasets/predicted_csvs``), scored as published:
    request ``<workload>-<N>`` takes ``prompt_<N>``'s Predicted Expert IDs, after a check that the
    file's Activated Expert IDs are that request's routing (the predictions are for those tokens).
    ``moecast predictors eval moe-beyond:DIR --traces T``, T imported from the same DIR."""

    name = "moe-beyond"
    horizon = "token-ahead"

    def __init__(self, folder: Path, meta: dict[str, Any]) -> None:
        from moecast.collect.moe_beyond import PREDICTED_COLUMNS, list_files

        super().__init__(meta)
        self.folder = Path(folder)
        self.files = dict(list_files(self.folder, PREDICTED_COLUMNS))

    @classmethod
    def from_folder(cls, folder: str | Path, ts: TraceSet) -> PublishedPredictions:
        return cls(Path(folder), {**_model_meta(ts.meta.model), "source": str(folder)})

    def score_request(self, trace: RequestTrace) -> np.ndarray:
        from moecast.collect.moe_beyond import parse_predicted

        tail = trace.request_id.rsplit("-", 1)[-1]
        path = self.files.get(int(tail)) if tail.isdigit() else None
        if path is None:
            raise InputError(
                f"{self.folder}: no predictions for request {trace.request_id} (prompt number {tail}); "
                "evaluate on a TraceSet imported from this folder (moecast import moe-beyond DIR)"
            )
        layers, activated, predicted = parse_predicted(path, self.num_experts)
        same = activated.shape[:2] == trace.topk_ids.shape[:2] and np.array_equal(
            np.sort(activated, -1), np.sort(np.asarray(trace.topk_ids), -1)
        )
        if layers != self.moe_layers or not same:
            raise InputError(
                f"{path}: its Activated Expert IDs are not request {trace.request_id}'s routing "
                f"({activated.shape[0]} tokens against {len(trace)}): the predictions are for other "
                "tokens; import this folder itself (moecast import moe-beyond DIR --out T) and evaluate on T"
            )
        return multi_hot(predicted, self.num_experts, np.float32)

    def tensors(self) -> dict[str, Any]:
        raise InputError(
            "MoE-Beyond's predictions stay in their CSV folder; evaluate moe-beyond:DIR directly"
        )


class GateReusePredictor(_Base, LayerAhead):
    """Layer l's router applied to layer l-1's gate input (layer-ahead)."""

    name = "gate-reuse"
    horizon = "layer-ahead"
    needs = ("topk_ids", "gate_inputs")

    def __init__(self, router: np.ndarray, meta: dict[str, Any]) -> None:
        super().__init__(meta)
        self.router = np.asarray(router, np.float32)  # [L, E, H]
        if self.router.shape[:2] != (self.num_layers, self.num_experts):
            raise InputError(
                f"router weights have shape {self.router.shape}, expected [{self.num_layers}, {self.num_experts}, H]"
            )

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, ts: TraceSet) -> GateReusePredictor:
        """Read each MoE layer's router weight [E, H] from a model directory's safetensors files."""
        from safetensors import safe_open

        model_dir = Path(model_dir)
        _check_model_dir(model_dir, ts)
        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(
                f"{model_dir}: no *.safetensors weights; name a Hugging Face model folder, as in gate-reuse:MODEL_DIR"
            )
        m = ts.meta.model
        found: dict[int, np.ndarray] = {}
        for f in files:
            with safe_open(str(f), framework="pt") as fh:
                for key in fh.keys():  # noqa: SIM118
                    parts = key.split(".")
                    if "layers" not in parts or not key.endswith("gate.weight") or "gate_proj" in key:
                        continue
                    try:
                        layer = int(parts[parts.index("layers") + 1])
                    except (ValueError, IndexError):
                        continue
                    w = fh.get_tensor(key)
                    if layer in m.moe_layers and tuple(w.shape) == (m.num_experts, m.hidden_size):
                        found[layer] = w.float().numpy()
        missing = [layer for layer in m.moe_layers if layer not in found]
        if missing:
            raise InputError(
                f"{model_dir}: no router weight [{m.num_experts}, {m.hidden_size}] for MoE layers {missing}; "
                "is this the model the traces came from?"
            )
        router = np.stack([found[layer] for layer in m.moe_layers])
        # read from a model, fitted on no request: every request of any TraceSet is held out
        return cls(router, {**_model_meta(m), "model_dir": str(model_dir), "split": None})

    def score_request(self, trace: RequestTrace) -> np.ndarray:
        if trace.gate_inputs is None:
            raise InputError(
                "gate-reuse needs gate_inputs, which these traces lack (imported traces have none); "
                "re-collect with `moecast collect --gate-inputs`"
            )
        g = np.asarray(trace.gate_inputs, np.float32)
        if not np.isfinite(g).all():
            raise InputError(f"request {trace.request_id}: gate_inputs contain NaN or inf; re-collect it")
        src = np.zeros_like(g)
        src[:, 1:] = g[:, :-1]  # layer l scored from layer l-1's gate input
        src[1:, 0] = g[:-1, 0]  # layer 0: the previous token's layer-0 gate input
        logits = np.einsum("tlh,leh->tle", src, self.router)
        return logits.astype(np.float32)

    @property
    def gate_width(self) -> int:
        return int(self.router.shape[2])

    def tensors(self) -> dict[str, Any]:
        return {"router": self.router}

    @classmethod
    def from_checkpoint(cls, tensors: dict[str, Any], meta: dict[str, Any], path: Path) -> GateReusePredictor:
        return cls(tensors["router"].float().numpy(), meta)


class CooccurrencePredictor(_Base, LayerAhead):
    """Layer-ahead counts: P(expert e at layer l | expert j at layer l-1) from the training split."""

    name = "cooccurrence"
    horizon = "layer-ahead"

    def __init__(self, table: np.ndarray, prior: np.ndarray, meta: dict[str, Any]) -> None:
        super().__init__(meta)
        self.table = np.asarray(table, np.float32)  # [L, E, E]: row j of layer l = counts given j at l-1
        self.prior = np.asarray(prior, np.float32)  # [L, E] global frequency

    @classmethod
    def fit(cls, ts: TraceSet, requests: list[str]) -> CooccurrencePredictor:
        if not requests:
            raise InputError(f"{ts.path}: no training requests to count co-occurrences on")
        topk = ts.array("topk_ids", requests).astype(np.int64)
        _, L, k = topk.shape
        E = ts.num_experts
        table = np.zeros((L, E, E), np.float64)
        for li in range(1, L):
            src = np.repeat(topk[:, li - 1], k, axis=1).ravel()
            dst = np.tile(topk[:, li], (1, k)).ravel()
            table[li] = np.bincount(src * E + dst, minlength=E * E).reshape(E, E)
        table /= np.maximum(table.sum(-1, keepdims=True), 1)
        counts = expert_counts(topk, E)
        prior = counts / counts.sum(1, keepdims=True)
        return cls(table, prior, fitted_meta(ts, requests))

    def score_request(self, trace: RequestTrace) -> np.ndarray:
        ids = np.asarray(trace.topk_ids).astype(np.int64)  # [T, L, k]
        T, L, _ = ids.shape
        out = np.empty((T, L, self.num_experts), np.float32)
        out[:, 0] = self.prior[0]
        for li in range(1, L):
            # sum of the rows of layer l-1's experts, the prior only breaking ties
            out[:, li] = self.table[li][ids[:, li - 1]].sum(1) + 1e-3 * self.prior[li]
        return out

    def tensors(self) -> dict[str, Any]:
        return {"table": self.table, "prior": self.prior}

    @classmethod
    def from_checkpoint(
        cls, tensors: dict[str, Any], meta: dict[str, Any], path: Path
    ) -> CooccurrencePredictor:
        return cls(tensors["table"].float().numpy(), tensors["prior"].float().numpy(), meta)


class ActivationMatrixPredictor(_Base):
    """MoE-Infinity's request-level expert activation matrices matched by cosine similarity."""

    name = "moe-infinity"
    horizon = "prompt-ahead"

    def __init__(self, matrices: np.ndarray, meta: dict[str, Any]) -> None:
        super().__init__(meta)
        self.matrices = np.asarray(matrices, np.float32)  # [M, L, E], rows sum to 1 per layer
        flat = self.matrices.reshape(len(self.matrices), -1)
        self._unit = flat / np.maximum(np.linalg.norm(flat, axis=1, keepdims=True), 1e-12)
        self._mean = self.matrices.mean(0)

    @classmethod
    def fit(
        cls, ts: TraceSet, requests: list[str], capacity: int = 1000, seed: int = 0
    ) -> ActivationMatrixPredictor:
        if not requests:
            raise InputError(f"{ts.path}: no training requests to build activation matrices from")
        rng = np.random.default_rng(seed)
        chosen = (
            list(requests)
            if len(requests) <= capacity
            else [requests[i] for i in sorted(rng.choice(len(requests), capacity, replace=False))]
        )
        mats = []
        for rid in chosen:
            c = expert_counts(ts.get(rid).topk_ids, ts.num_experts)
            mats.append(c / np.maximum(c.sum(1, keepdims=True), 1))
        return cls(np.stack(mats), {**fitted_meta(ts, requests), "capacity": capacity})

    def score_request(self, trace: RequestTrace) -> np.ndarray:
        T = len(trace.topk_ids)
        hot = multi_hot(trace.topk_ids, self.num_experts, np.float32)
        prefix = (np.cumsum(hot, 0) - hot).reshape(T, -1)  # tokens < t
        norms = np.linalg.norm(prefix, axis=1, keepdims=True)
        sims = (prefix / np.maximum(norms, 1e-12)) @ self._unit.T  # [T, M]
        best = sims.argmax(1)
        out = self.matrices[best].copy()
        out[norms[:, 0] == 0] = self._mean
        return out.astype(np.float32)

    def tensors(self) -> dict[str, Any]:
        return {"matrices": self.matrices}

    @classmethod
    def from_checkpoint(
        cls, tensors: dict[str, Any], meta: dict[str, Any], path: Path
    ) -> ActivationMatrixPredictor:
        return cls(tensors["matrices"].float().numpy(), meta)
