"""LLaPor: Learnable Layer-aware Predictor (PreScope §4.2, Fig. 9), layer-ahead.

One small predictor per MoE layer l scores layer l's experts from what is known
when layer l-1 finishes for the current token (PreScope §4.2.1): layer l-1's gate input
(PCA-compressed), top-k ids and router weights, and for ID-only traces the token and the
earlier tokens' routes (:mod:`.llapor_features`). Each layer's network has a body chosen
by its layer group (§3.1, :mod:`.llapor_groups`; :mod:`.llapor_net`); the runtime runs it
as one compiled call per layer (:mod:`.llapor_weights`, :mod:`.llapor_kernel`).

``update(features, truth)`` does online gradient steps (§4.2.2, last sentence);
it is off unless called.

A checkpoint may carry a context memory (:mod:`.context_memory`, not from PreScope): the
routes that training tokens took after the same text. Its votes are added to the network's
softmax in :meth:`LLaPor.score_request` and :meth:`LLaPor.score_at`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from moecast.collect.traceset import RequestTrace
from moecast.predictors import llapor_kernel
from moecast.predictors.base import LayerAhead
from moecast.predictors.context_memory import ContextMemory
from moecast.predictors.llapor_features import (
    FeatureSpec,
    context_votes,
    dense_features,
    previous_occurrence,
    sparse_bags,
    token_buckets_of,
    token_context,
)
from moecast.predictors.llapor_net import LLaPorNet, NetConfig, group_lambda, llapor_loss
from moecast.predictors.llapor_weights import fold, layer_weights

from moecast.errors import InputError


@dataclass(frozen=True)
class _RowConstants:
    """Shapes and numpy weights :meth:`LLaPor.features_at` needs, derived once per spec."""

    spec: FeatureSpec
    nbag: int
    route_layers: int
    ntok: int
    buckets: int
    dense_dim: int
    pca_max: int
    vote_dim: int
    mean: np.ndarray  # [L, H] PCA means
    comps: np.ndarray  # [L, H, C] components, transposed; layer l reads its first pca_dims[l] columns
    pca_dims: np.ndarray


_NO_GATE = np.zeros((1, 1, 1), np.float32)  # feature_row's gate and weight rows when the features read none
_NO_W = np.zeros(1, np.float32)
_NO_RAW = np.zeros((1, 0, 1), np.float32)  # score_layer: no raw gate inputs (its dense rows hold the PCA)
_NO_RAW_OK = np.zeros((1, 0), np.bool_)


class LLaPor(LayerAhead):
    """Layer-ahead predictor (PreScope §4.2); see the module docstring for its inputs."""

    name = "llapor"
    horizon = "layer-ahead"
    learns_online = True

    def __init__(
        self,
        net: LLaPorNet,
        moe_layers: list[int],
        fingerprint: str | None = None,
        meta: dict[str, Any] | None = None,
        int8_kernel: bool = True,
        memory: ContextMemory | None = None,
    ) -> None:
        self.net = net.eval()
        self.memory = memory
        # score_layer's matrices as int8 (llapor_kernel.quantize): about 2x faster at batch 1;
        # False keeps float32, equal to the torch network up to rounding
        self.int8_kernel = int8_kernel
        self.spec = net.spec
        self.groups = net.groups
        self.moe_layers = list(moe_layers)
        self.num_layers = self.spec.num_layers
        self.num_experts = self.spec.num_experts
        self.top_k = self.spec.top_k
        self.fingerprint = fingerprint
        self.meta = dict(meta or {})
        self.needs = tuple(f for f in self.spec.fields() if f != "token_id")
        self._opt: torch.optim.Optimizer | None = None

    # ------------------------------------------------------------------ features
    def features(self, trace: RequestTrace) -> dict[str, torch.Tensor]:
        """Model inputs for every (token, layer) of one request (causal: see module docstring)."""
        spec = self.spec
        ids = np.asarray(trace.topk_ids)
        T = ids.shape[0]
        missing = [
            f for f in ("gate_inputs", "topk_weights") if f in spec.fields() and getattr(trace, f) is None
        ]
        if missing:
            raise InputError(
                f"this LLaPor checkpoint was trained with {', '.join(missing)}, which request {trace.request_id} lacks; "
                "evaluate it on traces collected with those fields"
            )
        pos = np.arange(T)
        tok_ids = np.asarray(trace.token_ids) if (spec.token_buckets or spec.repeat_token) else None
        prev_same = previous_occurrence(tok_ids, pos) if spec.repeat_token else None
        feats = {"bags": torch.from_numpy(sparse_bags(spec, ids, pos, pos, prev_same))}
        if spec.deep_history:
            feats["route"] = torch.from_numpy(ids.astype(np.int64))
        if spec.token_buckets:
            vocab = self.net.tok_vocab.numpy() if spec.token_exact else None
            feats["tokens"] = torch.from_numpy(token_context(spec, tok_ids, pos, pos, vocab))
        if spec.dense_dim:
            pca_in = None
            if spec.gate_pca:
                g = np.asarray(trace.gate_inputs, np.float32)
                if not np.isfinite(g).all():
                    raise InputError(
                        f"request {trace.request_id}: gate_inputs contain NaN or inf; re-collect it"
                    )
                pca_in = self.net.pca.project(g) * self._pca_mask()
            w = trace.topk_weights if spec.weights else None
            if w is not None and not np.isfinite(np.asarray(w, np.float32)).all():
                raise InputError(
                    f"request {trace.request_id}: topk_weights contain NaN or inf; re-collect it"
                )
            feats["dense"] = torch.from_numpy(dense_features(spec, pca_in, w, ids))
        return feats

    def features_at(self, trace: RequestTrace, layer: int) -> dict[str, np.ndarray]:
        """The last token's inputs to layer ``layer``'s predictor, as :meth:`score_layer` reads them.

        The runtime's per-layer path: :meth:`features` builds every (token, layer) of the window,
        ~0.8 ms on tiny and O(L) gate-input projections per call; this builds one row, and
        projects only the gate inputs that layer reads (layer-1's of this token, and layer's of
        the ``context_gate`` previous tokens). Other layers' dense entries are left zero. Equal to
        ``features(trace)[-1:]`` at ``layer`` (tested).
        """
        return self._row(trace, layer, project=True)

    def _row(self, trace: RequestTrace, layer: int, project: bool) -> dict[str, np.ndarray]:
        """:meth:`features_at`; with ``project`` False the gate inputs' PCA blocks stay zero
        (:meth:`score_at` feeds the raw gate inputs to the folded matrices instead)."""
        spec = self.spec
        project = project and spec.gate_pca
        ids = np.asarray(trace.topk_ids)
        T, L, k = ids.shape[0], spec.num_layers, spec.top_k
        t = T - 1
        i64, f32 = np.int64, np.float32
        c = self._row_constants()
        bags = np.full((1, L, c.nbag), spec.vocab, i64)
        route = np.empty((1, c.route_layers, k), i64)
        tokens = np.empty((1, c.ntok), i64)
        dense = np.zeros((1, L, c.dense_dim), f32)
        gate = _NO_GATE
        if project:  # the rows the projections read: token t and its context_gate predecessors
            gate = np.asarray(trace.gate_inputs[max(0, t - spec.context_gate) :], f32)
        wrow = _NO_W
        if spec.weights and layer > 0:
            wrow = np.asarray(trace.topk_weights[t, layer - 1], f32)
        ok = llapor_kernel.feature_row(
            ids, np.asarray(trace.token_ids, i64), gate, wrow, t, layer,
            spec.prev_layers, spec.history_tokens, spec.history_layers, spec.repeat_token, spec.num_experts,
            spec.vocab, c.buckets, spec.context_tokens, project, c.mean, c.comps,
            c.pca_dims, c.pca_max, spec.weights, c.vote_dim,
            spec.context_gate, bags[0, layer], route[0], tokens[0], dense[0, layer],
        )  # fmt: skip
        if not ok:
            raise self._bad_row_error(trace, layer, wrow)
        feats: dict[str, np.ndarray] = {"bags": bags}
        if spec.deep_history:
            feats["route"] = route
        if spec.token_buckets:
            if spec.token_exact:  # sorted-vocabulary lookup: rare, so left to numpy
                tokens = self._exact_tokens(trace, t)
            feats["tokens"] = tokens if spec.context_tokens else tokens[0]
        if spec.context_vote:
            off = spec.pca_max + (spec.num_experts if spec.weights else 0)
            dense[0, layer, off : off + spec.num_experts] = context_votes(spec, ids)[t, layer]
        if c.dense_dim:
            feats["dense"] = dense
        return feats

    def _bad_row_error(self, trace: RequestTrace, layer: int, wrow: np.ndarray) -> InputError:
        """Why ``feature_row`` refused the row: the weights it read, else the gate inputs, are not finite."""
        bad_w = self.spec.weights and layer > 0 and not np.isfinite(wrow).all()
        field = "topk_weights" if bad_w else "gate_inputs"
        return InputError(f"request {trace.request_id}: {field} contain NaN or inf; re-collect it")

    def _exact_tokens(self, trace: RequestTrace, t: int) -> np.ndarray:
        """[1, 1 + context_tokens] vocabulary ids of token ``t`` and its predecessors, newest first."""
        spec = self.spec
        window = np.asarray(trace.token_ids[max(0, t - spec.context_tokens) :], np.int64)[::-1]
        tok = np.full(1 + spec.context_tokens, spec.token_buckets, np.int64)
        tok[: len(window)] = token_buckets_of(spec, window, self.net.tok_vocab.numpy())
        return tok[None, :]

    def _row_constants(self) -> _RowConstants:
        """What :meth:`features_at` derives from the spec and the PCA, once per spec: the spec's
        properties and torch-to-numpy copies cost microseconds on the runtime's per-layer call."""
        c = self.__dict__.get("_row_consts")
        spec = self.spec
        if c is None or c.spec is not spec:
            if spec.gate_pca:
                pca = self.net.pca
                mean = np.ascontiguousarray(pca.mean.numpy(), np.float32)
                comps = np.ascontiguousarray(pca.components.numpy().transpose(0, 2, 1), np.float32)
            else:
                mean, comps = np.zeros((0, 0), np.float32), np.zeros((0, 0, 0), np.float32)
            c = _RowConstants(
                spec=spec,
                nbag=max(1, spec.sparse_blocks * spec.top_k),
                route_layers=spec.num_layers if spec.deep_history else 0,
                ntok=1 + spec.context_tokens if spec.token_buckets and not spec.token_exact else 0,
                buckets=max(spec.token_buckets, 1),
                dense_dim=spec.dense_dim,
                pca_max=spec.pca_max,
                vote_dim=spec.num_experts if spec.context_vote else 0,
                mean=mean,
                comps=comps,
                pca_dims=np.array(spec.pca_dims or [0] * spec.num_layers, np.int64),
            )
            self.__dict__["_row_consts"] = c
        return c

    def _pca_mask(self) -> np.ndarray:
        m = np.zeros((self.num_layers, self.spec.pca_max), np.float32)
        for li, c in enumerate(self.spec.pca_dims):
            m[li, :c] = 1
        return m

    @torch.no_grad()
    def score_request(self, trace: RequestTrace) -> np.ndarray:
        scores = self.score_features(self.features(trace))
        if self.memory is None:
            return scores
        return self.with_memory(scores, self.memory.votes(trace.token_ids))

    def with_memory(self, scores: np.ndarray, votes: np.ndarray) -> np.ndarray:
        """The network's scores (sigmoids, [..., E]) with the context memory's votes added
        (:func:`.llapor_kernel.blend_rows`).

        A softmax-trained network's rows become its softmax times k (from the sigmoids: a
        softmax is the odds p / (1 - p) normalised), so that both terms sum to k per row; a
        focal- or BCE-trained network's sigmoids already estimate each expert's chance.
        """
        assert self.memory is not None
        E = scores.shape[-1]
        p = np.ascontiguousarray(scores, np.float32).reshape(-1, E)
        v = np.ascontiguousarray(votes, np.float32).reshape(-1, E)
        out = np.empty_like(p)
        softmax = self.meta.get("hyper_parameters", {}).get("loss") == "softmax"
        llapor_kernel.blend_rows(p, v, float(self.top_k), self.memory.config.weight, softmax, out)
        return out.reshape(scores.shape)

    def score_features(self, feats: dict[str, torch.Tensor]) -> np.ndarray:
        """[T, L, E] scores of ``features()`` rows (what ``update`` also takes)."""
        self.net.eval()
        with torch.no_grad():  # after an online update the weights require grad
            return torch.sigmoid(self.net(**feats)).numpy().astype(np.float32)

    def score_layer(self, layer: int, feats: dict[str, torch.Tensor | np.ndarray]) -> np.ndarray:
        """[B, E] scores of one layer for a batch of tokens: the runtime's per-layer call.

        Runs only that layer's predictor, as one compiled loop (:mod:`.llapor_kernel`) on
        weights packed once per layer (int8 matrices unless ``int8_kernel`` is False): no torch
        dispatch, no per-operation numpy calls.
        ``feats`` are rows of ``features()`` (all layers' inputs; only this layer's are read) or
        the one row of ``features_at(trace, layer)``.
        """
        w = self._layer_weights(layer)
        return self._forward(layer, w, w["packed"], feats, _NO_RAW, _NO_RAW_OK)[0]

    def _forward(
        self,
        layer: int,
        w: dict[str, Any],
        packed: tuple,
        feats: dict[str, torch.Tensor | np.ndarray],
        raw: np.ndarray,
        present: np.ndarray,
    ) -> tuple[np.ndarray, bool]:
        """(scores [B, E], whether the raw gate inputs were finite): layer ``layer``'s slice of
        ``feats`` through :func:`.llapor_kernel.forward` with ``packed`` weights."""
        bags = np.asarray(feats["bags"])[:, layer]  # [B, n]; the pad id indexes a zero row
        B = len(bags)
        none_i = np.zeros((B, 0), np.int64)
        route = np.asarray(feats["route"])[:, :layer].reshape(B, -1) if "deep_off" in w else none_i
        tokens = np.asarray(feats["tokens"]).reshape(B, -1) if "tok" in w else none_i
        dense = (
            np.asarray(feats["dense"], np.float32)[:, layer]
            if "dense_proj" in w
            else np.zeros((B, 0), np.float32)
        )
        out = np.empty((B, self.num_experts), np.float32)
        ok = llapor_kernel.forward(bags, route, tokens, dense, *packed, raw, present, out)
        return out, ok

    def warm(self) -> None:
        """A two-token prefill and a decode step through a throwaway stream, scoring every layer from
        the live runtime's dtypes: each layer's folded matrices are built (:meth:`_row_args`, on first
        use) and :meth:`score_at`'s compiled kernels load now (the stream's arrays keep their types
        past its window: a test runs one there)."""
        stream, k = self.stream(), self.top_k
        stream.reset([0, 0])
        for n in (2, 1):  # the prefill's rows, then one decode step's
            rows = min(n, stream.gate_rows)
            gate = np.zeros((rows, self.gate_width), np.float32) if rows else None
            for layer in range(self.num_layers - 1):
                stream.observe(layer, np.zeros((n, k), np.int64), np.full((n, k), 1.0 / k, np.float32), gate)
                stream.predict_next(layer + 1)
            stream.end_token(0)

    def score_at(self, trace: RequestTrace, layer: int) -> np.ndarray:
        """[E] scores of layer ``layer`` for the last token of ``trace``: the runtime's per-layer
        call, ``score_layer(layer, features_at(trace, layer))[0]`` with the gate inputs' PCA
        folded into the layer's first matrices (:func:`.llapor_kernel.fold_pca`), the feature
        row and the network in one compiled call (:func:`.llapor_kernel.score_row`).

        At a real model's width the projection dominates the call: at Hg 2048 and 512
        components it reads a 4 MB matrix per gate input; folded, each gate input meets one
        [Hg, hidden + E] int8 matrix (~0.4 MB at hidden 128). Equal to the unfolded call up to
        the int8 rounding (tested). Once :meth:`update` has run, or with features built in
        numpy (``token_exact``, ``context_vote``), it is that call.
        """
        spec = self.spec
        if self._opt is not None or spec.token_exact or spec.context_vote:
            # online updates (update()) change the weights every token: folding them again
            # each time would cost more than it saves
            row = self.score_layer(layer, self.features_at(trace, layer))[0]
            return row if self.memory is None else self._blend_row(row, trace, layer)
        w = self._layer_weights(layer)
        args = w.get("row_args")
        if args is None:  # built on first use: only the runtime's path reads it
            args = w["row_args"] = self._row_args(layer, w)
        blocks, consts, packed = args
        ids = np.asarray(trace.topk_ids)
        t = len(ids) - 1
        gate = _NO_GATE
        if len(blocks):
            gate = trace.gate_inputs
            if not (isinstance(gate, np.ndarray) and gate.dtype == np.float32):
                gate = np.asarray(gate[max(0, t - int(blocks[:, 0].max())) :], np.float32)
        wrow = _NO_W
        if spec.weights and layer > 0:
            wrow = np.asarray(trace.topk_weights[t, layer - 1], np.float32)
        out = np.empty((1, self.num_experts), np.float32)
        bad = llapor_kernel.score_row(
            ids, np.asarray(trace.token_ids, np.int64), wrow, gate, t, layer, blocks, *consts, packed, out
        )
        if bad:
            field = "topk_weights" if bad == 1 else "gate_inputs"
            raise InputError(f"request {trace.request_id}: {field} contain NaN or inf; re-collect it")
        if self.memory is not None:
            return self._blend_row(out[0], trace, layer)
        return out[0]

    def _blend_row(self, row: np.ndarray, trace: RequestTrace, layer: int) -> np.ndarray:
        """:meth:`with_memory` for the last token's row of ``layer``: one lookup per token."""
        assert self.memory is not None
        return self.with_memory(row, self.memory.votes_last(trace.token_ids)[layer])

    def _layer_weights(self, layer: int) -> dict[str, Any]:
        # one cache per precision: packed int8 and float32 weights can both be kept
        cache = self.__dict__.setdefault("_layer_cache", {}).setdefault(self.int8_kernel, {})
        return layer_weights(self.net, layer, self.int8_kernel, cache)

    def _row_args(self, layer: int, w: dict[str, Any]) -> tuple[np.ndarray, tuple, tuple]:
        """:meth:`score_at`'s constant arguments of :func:`.llapor_kernel.score_row` for ``layer``:
        the folded blocks, the spec's sizes and the packed weights (the PCA folded in)."""
        spec, c = self.spec, self._row_constants()
        blocks = np.array(w["fold_blocks"], np.int64).reshape(-1, 2)
        packed = w["packed"]
        if len(blocks):
            mean, folded = fold(self.net, w)
            packed = (*packed[:-3], mean, *llapor_kernel.quantize(folded, self.int8_kernel))
        consts = (
            spec.prev_layers, spec.history_tokens, spec.history_layers, spec.repeat_token,
            spec.num_experts, spec.vocab, c.buckets, spec.weights, spec.context_gate, c.pca_max, c.nbag,
            c.ntok if "tok" in w else 0, c.dense_dim if "dense_proj" in w else 0, "deep_off" in w,
        )  # fmt: skip
        return blocks, consts, packed

    @property
    def gate_width(self) -> int:
        """Width of the gate inputs the features read (0: none)."""
        return self.spec.gate_hidden if self.spec.gate_pca else 0

    @property
    def gate_tokens(self) -> int:
        """Finished tokens whose gate inputs the features read (``context_gate``)."""
        return self.spec.context_gate

    # ------------------------------------------------------------------ online learning
    def learn_last(self, trace: RequestTrace, lr: float) -> float:
        """:meth:`update` on the last token of ``trace``, whose routing is now known (PreScope §4.2.2)."""
        row = {k: v[-1:] for k, v in self.features(trace).items()}
        with torch.enable_grad():  # a model's generate() runs under no_grad; the step needs gradients
            return self.update(row, np.asarray(trace.topk_ids[-1:], np.int64), lr=lr)

    def update(
        self,
        feats: dict[str, torch.Tensor],
        truth: np.ndarray,
        lr: float = 1e-3,
        steps: int = 1,
        gamma: float | None = None,
        lam: float | None = None,
    ) -> float:
        """Online continual learning (PreScope §4.2.2): a few AdamW steps on newly observed routing.

        ``truth`` [B, L, k] are the true ids of the tokens whose features are ``feats``.
        The loss is the one the checkpoint was trained with (its ``loss``, ``gamma``,
        ``lam_io`` / ``lam_middle``; the paper's focal loss for a checkpoint that records
        none): a softmax-trained DeepSeek LLaPor updated with the focal loss fell from 0.709 to
        0.676 held-out recall@6. The expert-balancing weights 1/f_i are not in the checkpoint,
        so the balancing term weighs every expert 1. ``gamma`` / ``lam`` override the recorded
        values. Returns the loss before the last step. Off unless the runtime calls it.
        """
        from moecast.predictors.metrics import multi_hot

        hp = self.meta.get("hyper_parameters", {})
        kind = hp.get("loss", "focal")
        gamma = float(hp.get("gamma", 2.0) if gamma is None else gamma)
        if lam is None:
            lam_t = group_lambda(
                self.num_layers, self.groups, hp.get("lam_io", 0.5), hp.get("lam_middle", 0.0)
            )
        else:
            lam_t = torch.full((self.num_layers,), float(lam))
        target = torch.from_numpy(multi_hot(np.asarray(truth), self.num_experts, np.float32))
        if self._opt is None or self._opt.param_groups[0]["lr"] != lr:
            self._opt = torch.optim.AdamW(self.net.parameters(), lr=lr, weight_decay=0.0)
        inv = torch.ones(self.num_layers, self.num_experts)
        self.__dict__.pop("_layer_cache", None)  # weights change: per-layer numpy copies are stale
        self.net.train()
        loss_val = float("nan")
        for _ in range(steps):
            loss = llapor_loss(kind, self.net(**feats), target, inv, lam_t, gamma)
            self._opt.zero_grad()
            loss.backward()
            self._opt.step()
            loss_val = float(loss.detach())
        self.net.eval()
        return loss_val

    # ------------------------------------------------------------------ checkpoint
    def metadata(self) -> dict[str, Any]:
        return {
            **self.meta,
            **super().metadata(),
            "moe_layers": self.moe_layers,
            "num_experts": self.num_experts,
            "top_k": self.top_k,
            "features": asdict(self.spec),
            "net": asdict(self.net.net),
            "groups": self.groups,
            "needs": list(self.spec.fields()),
            "memory": None if self.memory is None else self.memory.metadata(),
        }

    def save(self, path: str | Path, extra: dict[str, Any] | None = None) -> Path:
        from moecast.predictors.checkpoint import save

        tensors: dict[str, Any] = dict(self.net.state_dict())
        if self.memory is not None:
            tensors.update(self.memory.tensors())
        return save(path, tensors, {**self.metadata(), **(extra or {})})

    @classmethod
    def from_checkpoint(cls, tensors: dict[str, Any], meta: dict[str, Any], path: Path) -> LLaPor:
        try:
            spec = FeatureSpec(**meta["features"])
            net = LLaPorNet(spec, {g: list(v) for g, v in meta["groups"].items()}, NetConfig(**meta["net"]))
            weights = {k: v for k, v in tensors.items() if not k.startswith("memory.")}
            net.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in weights.items()})
            memory = None
            if meta.get("memory"):
                memory = ContextMemory.from_tensors(tensors, meta["memory"], spec.num_experts)
        except (KeyError, TypeError, RuntimeError, ValueError) as exc:
            raise InputError(
                f"{path}: LLaPor checkpoint does not match this moecast ({exc}); retrain it"
            ) from exc
        return cls(net, meta["moe_layers"], meta.get("fingerprint"), meta, memory=memory)


def describe(pred: LLaPor) -> str:
    memory = None if pred.memory is None else pred.memory.metadata()
    return json.dumps({"features": asdict(pred.spec), "groups": pred.groups, "memory": memory})
