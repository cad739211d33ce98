"""Lightning data modules over a TraceSet: request-level split, per-token inputs built batch by batch.

Every rank reads the same files and the seeded ``TraceSet.splits`` (so DDP needs no broadcast).
The narrow per-token fields (expert ids, router weights, positions, token ids) are held as numpy
arrays; the wide one, gate inputs, is read from the TraceSet's memory-mapped Arrow parts for each
batch (``TraceSet.rows``) and projected there, so memory does not grow with the hidden size times
the token count. A batch is assembled with vectorised numpy in ``__getitems__`` (one call per
batch, no per-row Python).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import lightning.pytorch as pl
import numpy as np
import torch
from moecast.collect.splits import Splits
from moecast.collect.traceset import ModelInfo, TraceSet, open_traces
from moecast.predictors.llapor_features import (
    FeatureSpec,
    context_votes,
    dense_rows,
    previous_occurrence,
    sparse_bags,
    token_context,
)
from moecast.predictors.llapor_groups import detect_groups, format_groups, gate_cosine, routing_correlation
from moecast.predictors.metrics import multi_hot
from moecast.train.config import SplitConfig, check_flag, check_range
from torch.utils.data import DataLoader, Dataset, Sampler

from moecast.errors import InputError

CHUNK = 65536  # rows of gate inputs checked at a time


def split_requests(ts: TraceSet, split: SplitConfig) -> tuple[list[str], list[str], Splits]:
    """(train, val, splits) for a trainer: it fits on train and selects on val; test stays apart."""
    val_fraction, max_requests = split.val_fraction, split.max_requests
    splits = ts.splits(val_fraction, split.test_fraction, split.seed)
    train_ids, val_ids = splits.train, splits.val
    if max_requests:
        # subsample both sides in proportion, keeping the split itself unchanged
        n_val = max(1, round(max_requests * val_fraction)) if val_ids else 0
        train_ids, val_ids = train_ids[: max_requests - n_val], val_ids[:n_val]
    if not train_ids:
        raise InputError(
            f"{ts.path}: the training split is empty ({ts.num_requests} requests); add requests or lower "
            "val_fraction / test_fraction"
        )
    if val_fraction > 0 and not val_ids:
        raise InputError(
            f"{ts.path}: the validation split is empty; use more requests or a larger val_fraction"
        )
    return train_ids, val_ids, splits


def split_metadata(dm: Any) -> dict[str, Any]:
    """The ``split`` a checkpoint records: spec, TraceSet id and the sizes actually trained on."""
    return {
        **dm.splits.metadata(),
        "train_requests": len(dm.train_ids),
        "val_requests": len(dm.val_ids),
    }


def positions_of(ts: TraceSet, ids: list[str]) -> np.ndarray:
    lengths = ts.request_lengths(ids)
    starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
    return np.arange(int(lengths.sum())) - starts


def eval_sampler(n: int) -> Sampler | None:
    """Validation under DDP: each rank takes every world-th item, unpadded. Lightning's default
    sampler evens the shards by repeating items, which ``log_validation`` would count twice.
    None (Lightning's choice) on one process, or with fewer items than ranks."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or not 1 < dist.get_world_size() <= n:
        return None
    from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSampler

    return UnrepeatedDistributedSampler(range(n), shuffle=False)


class Batches(Dataset):
    """Items (token rows, requests) whose ``__getitems__`` builds a whole batch at once with ``build``."""

    def __init__(self, build: Callable[[np.ndarray], dict[str, torch.Tensor]], items: np.ndarray) -> None:
        self.build, self.items = build, items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.__getitems__([i])

    def __getitems__(self, idx: list[int]) -> dict[str, torch.Tensor]:
        return self.build(self.items[np.asarray(idx)])


def batch_loader(
    build: Callable[[np.ndarray], dict[str, torch.Tensor]],
    items: np.ndarray,
    batch_size: int,
    train: bool,
    num_workers: int,
    what: str,
) -> DataLoader:
    """Shuffled training batches, or validation batches sharded over DDP ranks (``eval_sampler``)."""
    if len(items) == 0:
        raise InputError(f"{what}: the {'training' if train else 'validation'} split is empty")
    return DataLoader(
        Batches(build, items),
        batch_size=batch_size,
        shuffle=train,
        sampler=None if train else eval_sampler(len(items)),
        collate_fn=_identity,
        num_workers=num_workers,
    )


def _finite_rows(ts: TraceSet, name: str, requests: list[str]) -> Any:
    """``ts.rows(name, requests)``, checked for NaN / inf chunk by chunk (never all in memory)."""
    rows = ts.rows(name, requests)
    if not all(np.isfinite(rows[lo : lo + CHUNK]).all() for lo in range(0, len(rows), CHUNK)):
        raise InputError(f"{ts.path}: {name} contain NaN or inf; re-collect the traces")
    return rows


def _inverse_frequencies(topk: np.ndarray, L: int, E: int) -> np.ndarray:
    """[L, E] float32 inverse expert frequencies (add-one smoothed) of ``topk``'s rows, mean 1 per layer."""
    counts = np.zeros((L, E))
    for li in range(L):
        counts[li] = np.bincount(topk[:, li].ravel().astype(np.int64), minlength=E)
    freq = (counts + 1) / (counts + 1).sum(1, keepdims=True)
    inv = 1.0 / freq
    return (inv / inv.mean(1, keepdims=True)).astype(np.float32)


def _identity(batch: Any) -> Any:
    return batch


@dataclass(frozen=True)
class LLaPorData(SplitConfig):
    """LLaPor training data (PreScope §4.2): per-token inputs for every MoE layer of a TraceSet.

    Features follow the TraceSet's fields: ``gate_pca`` / ``weights`` ``"auto"`` use gate
    inputs / router weights when present (an ID-only import gets neither); ``True``
    demands them (a clear error when missing), ``False`` skips them. ``soft_targets``
    does the same for the router's probabilities, which only the model's distillation
    loss (``model.distill``) reads: batches then carry ``probs`` [B, L, E].

    The defaults are the paper's inputs (layer l-1's ids, weights and gate-input PCA). On traces
    without gate inputs (an ID-only import) ``token_buckets`` and ``history_tokens`` default to
    the features that exist instead: a learned embedding of the token and layer l's ids of the
    previous token (set them explicitly to override either way).

    Args:
        val_fraction: share of requests held out for validation: selects the best epoch
        test_fraction: share of requests held out for testing (``moecast predictors eval``
            reports it); never trained or selected on
        seed: split seed
        max_requests: train on at most this many requests (all when null)
        batch_size: token rows per batch
        prev_layers: this token's ids at layers l-1 .. l-prev_layers, one multi-hot block each
        deep_history: also every earlier layer's ids of this token (learned per-layer mix)
        history_tokens: layer l's ids of the previous history_tokens tokens (null: 1 on traces
            without gate inputs, else 0)
        history_layers: with history_tokens, also their ids at layers l-1 .. (this many layers)
        context_tokens: embeddings of the previous context_tokens tokens (needs token_buckets)
        dense_skip: a linear path from the dense features straight to the logits
        token_buckets: rows of the learned token embedding (ids hashed into them); 0 = no token
            (null: 4096 on traces without gate inputs, else 0)
        token_dim: width of the token embedding
        token_exact: the training split's token ids get their own rows (token_buckets then counts them)
        token_min_count: with token_exact, ids seen fewer times share one row
        repeat_token: layer l's ids of this token's latest earlier occurrence in the request
        context_vote: > 0: earlier tokens' layer-l ids pooled by path overlap over this many layers
        vote_power: sharpness of that overlap weighting
        context_gate: PCA of layer l's gate input of the previous context_gate tokens
        gate_pca: PCA of layer l-1's gate input: auto (when the traces have gate inputs) | true | false
        weights: layer l-1's router weights: auto | true | false
        pca_io: PCA components for the input and output groups (PreScope: 256), capped by the hidden size
        pca_middle: PCA components for the middle group (PreScope: 512), capped by the hidden size
        pca_fit_rows: training rows sampled to fit the PCA and detect the groups
        groups: null = detect from the traces (§3.1); or {input: [..], middle: [..], output: [..]}
            with MoE-layer positions 0..L-1
        soft_targets: read router_probs for model.distill: auto | true | false
        num_workers: DataLoader worker processes
    """

    batch_size: int = 512
    prev_layers: int = 1
    deep_history: bool = False
    history_tokens: int | None = None
    history_layers: int = 1
    context_tokens: int = 0
    dense_skip: bool = False
    token_buckets: int | None = None
    token_dim: int = 32
    token_exact: bool = False
    token_min_count: int = 1
    repeat_token: bool = False
    context_vote: int = 0
    vote_power: float = 4.0
    context_gate: int = 0
    gate_pca: bool | str = "auto"
    weights: bool | str = "auto"
    pca_io: int = 256
    pca_middle: int = 512
    pca_fit_rows: int = 20000
    groups: dict[str, list[int]] | None = None
    soft_targets: bool | str = "auto"
    num_workers: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        d = "data"
        for name, lo in (
            ("batch_size", 1),
            ("prev_layers", 0),
            ("history_layers", 0),
            ("context_tokens", 0),
            ("token_dim", 1),
            ("token_min_count", 1),
            ("context_vote", 0),
            ("context_gate", 0),
            ("pca_io", 1),
            ("pca_middle", 1),
            ("pca_fit_rows", 1),
            ("num_workers", 0),
        ):
            check_range(d, name, getattr(self, name), int, lo)
        check_range(d, "history_tokens", self.history_tokens, int, 0, optional=True)
        check_range(d, "token_buckets", self.token_buckets, int, 0, optional=True)
        check_range(d, "vote_power", self.vote_power, float, 0)
        for name in ("deep_history", "dense_skip", "token_exact", "repeat_token"):
            check_flag(d, name, getattr(self, name))
        for name in ("gate_pca", "weights", "soft_targets"):
            check_flag(d, name, getattr(self, name), ("auto",))
        groups = self.groups
        if groups is not None and not (
            isinstance(groups, dict)
            and all(isinstance(v, list) and all(isinstance(x, int) for x in v) for v in groups.values())
        ):
            raise InputError(f"data.groups must be null or {{group: [layer positions]}}, got {groups!r}")
        if groups is not None and set(groups) - {"input", "middle", "output"}:
            # a misspelt name would train every layer as no group: no middle body, rates or PCA width
            bad = ", ".join(sorted(set(groups) - {"input", "middle", "output"}))
            raise InputError(f"data.groups: unknown group {bad}; the groups are input, middle and output")


class TracesDataModule(pl.LightningDataModule):
    """Training data of one TraceSet: its settings (a :class:`SplitConfig`), given as one value or as
    keywords, and its train / val requests, read once by :meth:`_open`."""

    config_class: ClassVar[type[SplitConfig]] = SplitConfig

    def __init__(self, traces: str, config: SplitConfig | None = None, **settings: Any) -> None:
        super().__init__()
        config = config if config is not None else self.config_class(**settings)
        self.config = config
        self.save_hyperparameters(dataclasses.asdict(config))
        self.traces = traces
        self._built = False

    def _open(self) -> TraceSet:
        """The TraceSet (``self.ts``) and its split (``train_ids``, ``val_ids``, ``splits``)."""
        self.ts = open_traces(self.traces)
        self.train_ids, self.val_ids, self.splits = split_requests(self.ts, self.config)
        return self.ts


class LLaPorDataModule(TracesDataModule):
    """LLaPor training data (PreScope §4.2) of a TraceSet, as :class:`LLaPorData` says.

    ``LLaPorDataModule(traces, config)``, or the settings as keywords (``batch_size=64``).
    """

    config_class = LLaPorData
    config: LLaPorData

    # ------------------------------------------------------------------ build once
    def setup(self, stage: str | None = None) -> None:
        if self._built:
            return
        hp = self.hparams
        ts = self._open()
        m = ts.meta.model
        L, E = m.num_layers, m.num_experts
        ids_order = self.train_ids + self.val_ids
        n_train = self._read_routing(ts, ids_order, E)

        use_gate = self._want("gate_pca", "gate_inputs", ts)
        use_w = self._want("weights", "topk_weights", ts)
        # read lazily from the memory-mapped parts (the widest field by far); checked in chunks
        gate = _finite_rows(ts, "gate_inputs", ids_order) if use_gate else None

        sub = self.train_rows[:: max(1, n_train // hp.pca_fit_rows)]
        # the sampled training rows' gate inputs: group detection and the PCA fit both read them
        gate_sub = gate[sub].astype(np.float32) if gate is not None else None
        self._set_groups(sub, gate_sub, L, E)
        print(format_groups(self.groups, m.moe_layers))

        pca_dims = self._pca_dims(L, m.hidden_size, len(sub)) if use_gate else [0] * L
        self.spec = self._feature_spec(m, n_train, use_gate, use_w, pca_dims)
        self._set_dense_inputs(ts, ids_order, gate, gate_sub, pca_dims, use_gate, use_w)
        # the router's probabilities, for the model's distillation loss: read per batch like gate inputs
        want_probs = self._want("soft_targets", "router_probs", ts)
        self.probs = _finite_rows(ts, "router_probs", ids_order) if want_probs else None
        # expert frequencies f_i per layer on the training split, for the balancing loss
        self.inv_freq = _inverse_frequencies(self.topk[:n_train], L, E)
        self._built = True

    def _read_routing(self, ts: TraceSet, ids_order: list[str], E: int) -> int:
        """Reads the requests' expert ids, positions and token ids, and the train / val rows; returns
        the number of training rows (they come first)."""
        self.topk = np.ascontiguousarray(ts.array("topk_ids", ids_order))
        if (self.topk < 0).any() or (self.topk >= E).any():
            raise InputError(f"{ts.path}: topk_ids outside [0, {E}); the TraceSet is corrupt")
        self.pos = positions_of(ts, ids_order)
        self.token_ids = ts.column("token_id", ids_order).astype(np.int64)
        self.prev_same = previous_occurrence(self.token_ids, self.pos) if self.hparams.repeat_token else None
        n_train = int(ts.request_lengths(self.train_ids).sum())
        self.train_rows = np.arange(n_train)
        self.val_rows = np.arange(n_train, len(self.topk))
        return n_train

    def _pca_dims(self, L: int, hidden_size: int, n_sub: int) -> list[int]:
        """Each layer's gate-input PCA width (0: none), by the group of the layer it feeds."""
        hp = self.hparams
        pca_dims = [0] * L
        group_of = {li: g for g, ls in self.groups.items() for li in ls}
        # layer l's PCA feeds layer l+1 (and, with context_gate, layer l itself)
        for li in range(L if hp.context_gate else L - 1):
            want = hp.pca_middle if group_of[min(li + 1, L - 1)] == "middle" else hp.pca_io
            pca_dims[li] = int(min(want, hidden_size, n_sub))
        return pca_dims

    def _feature_spec(
        self, m: ModelInfo, n_train: int, use_gate: bool, use_w: bool, pca_dims: list[int]
    ) -> FeatureSpec:
        """The model's input features from the settings and the fields present; sets ``token_vocab``."""
        hp = self.hparams
        L = m.num_layers
        # token_exact: the training split's token ids seen >= token_min_count times get their own
        # embedding row (one more row for every other id); token_buckets then counts those rows
        self.token_vocab = None
        # null: the paper's inputs when the gate input exists, else the ID-only features (see above)
        buckets = hp.token_buckets if hp.token_buckets is not None else (0 if use_gate else 4096)
        history = hp.history_tokens if hp.history_tokens is not None else (0 if use_gate else 1)
        use_tok = bool(buckets)
        if use_tok and hp.token_exact:
            uniq, cnt = np.unique(self.token_ids[:n_train], return_counts=True)
            self.token_vocab = uniq[cnt >= hp.token_min_count]
            buckets = len(self.token_vocab) + 1
        return FeatureSpec(
            num_layers=L,
            num_experts=m.num_experts,
            top_k=m.top_k,
            prev_layers=hp.prev_layers,
            deep_history=hp.deep_history,
            history_tokens=history,
            history_layers=hp.history_layers,
            context_tokens=hp.context_tokens if use_tok else 0,
            token_buckets=buckets,
            token_dim=hp.token_dim,
            token_exact=bool(hp.token_exact and use_tok),
            repeat_token=hp.repeat_token,
            context_vote=hp.context_vote,
            vote_power=float(hp.vote_power),
            context_gate=hp.context_gate if use_gate else 0,
            gate_pca=use_gate,
            pca_dims=pca_dims,
            gate_hidden=m.hidden_size if use_gate else 0,
            weights=use_w,
            dense_skip=bool(hp.dense_skip and (use_gate or use_w or hp.context_vote)),
        )

    def _set_dense_inputs(
        self,
        ts: TraceSet,
        ids_order: list[str],
        gate: Any,
        gate_sub: np.ndarray | None,
        pca_dims: list[int],
        use_gate: bool,
        use_w: bool,
    ) -> None:
        """Sets what the dense features are built from: gate inputs and their PCA, router weights, votes."""
        m = ts.meta.model
        L = m.num_layers
        self.pca_components = np.zeros((L, self.spec.pca_max, m.hidden_size if use_gate else 0), np.float32)
        self.pca_mean = np.zeros((L, m.hidden_size if use_gate else 0), np.float32)
        # dense features are built batch by batch: the gate inputs stay in the memory-mapped parts
        self.gate = gate if self.spec.dense_dim else None
        self.weights = self.votes = None
        if self.spec.dense_dim:
            if use_gate:
                self._fit_pca(gate_sub, pca_dims)
            if use_w:
                self.weights = np.ascontiguousarray(ts.array("topk_weights", ids_order))
                if not np.isfinite(self.weights).all():
                    raise InputError(f"{ts.path}: topk_weights contain NaN or inf; re-collect the traces")
            if self.spec.context_vote:
                # pools over every earlier token of the request, so it is built once (float16)
                self.votes = context_votes(self.spec, self.topk, self.pos).astype(np.float16)

    def _set_groups(self, sub: np.ndarray, gate_sub: np.ndarray | None, L: int, E: int) -> None:
        """Layer groups (PreScope §3.1): as configured, or detected from the sampled training rows."""
        hp = self.hparams
        if hp.groups:
            self.groups = {g: list(v) for g, v in hp.groups.items()}
            covered = sorted(x for layers in self.groups.values() for x in layers)
            if covered != list(range(L)):
                raise InputError(
                    f"configured groups {self.groups} must cover layer positions 0..{L - 1} exactly once"
                )
        else:
            cos = gate_cosine(gate_sub) if gate_sub is not None else None
            self.groups, self.group_signal = detect_groups(cos, routing_correlation(self.topk[sub], E), L)

    def _fit_pca(self, gate_sub: np.ndarray, pca_dims: list[int]) -> None:
        """Each layer's gate-input PCA on the sampled training rows, and its projection as one
        batched multiply-add: (x - mean) @ C^T = x @ C^T + (-mean @ C^T)."""
        from sklearn.decomposition import PCA

        for li, dims in enumerate(pca_dims):
            if not dims:
                continue
            pca = PCA(n_components=dims, random_state=self.hparams.seed)
            pca.fit(gate_sub[:, li])
            self.pca_components[li, :dims] = pca.components_
            self.pca_mean[li] = pca.mean_
        self._proj_layers = torch.tensor([li for li, d in enumerate(pca_dims) if d], dtype=torch.long)
        comps = torch.from_numpy(self.pca_components[self._proj_layers])
        self._proj = comps.transpose(1, 2).contiguous()
        self._proj_bias = -torch.bmm(torch.from_numpy(self.pca_mean[self._proj_layers])[:, None], self._proj)

    def _want(self, name: str, field: str, ts: TraceSet) -> bool:
        value = self.hparams[name]
        if value == "auto":
            return ts.has(field)
        if value in (True, "true", "True"):
            ts.require(field, f"LLaPor with {name}=true")
            return True
        return False

    # ------------------------------------------------------------------ batches
    def batch(self, rows: np.ndarray) -> dict[str, torch.Tensor]:
        out = {
            "bags": torch.from_numpy(
                sparse_bags(
                    self.spec,
                    self.topk,
                    rows,
                    self.pos[rows],
                    None if self.prev_same is None else self.prev_same[rows],
                )
            ),
            "target": torch.from_numpy(multi_hot(self.topk[rows], self.spec.num_experts, np.float32)),
        }
        if self.probs is not None:
            out["probs"] = torch.from_numpy(self.probs[rows]).float()  # widened by torch, as in _project
        if self.spec.deep_history:
            out["route"] = torch.from_numpy(self.topk[rows].astype(np.int64))
        if self.spec.token_buckets:
            out["tokens"] = torch.from_numpy(
                token_context(self.spec, self.token_ids, rows, self.pos[rows], self.token_vocab)
            )
        if self.spec.dense_dim:
            out["dense"] = torch.from_numpy(self._dense(rows))
        return out

    def _project(self, rows: np.ndarray) -> np.ndarray:
        """[B, L, pca_max] float32 PCA projections of the rows' gate inputs (zeros in unused layers)."""
        if not len(self._proj_layers):  # one MoE layer: no gate input feeds a later layer
            return np.zeros((len(rows), self.spec.num_layers, self.spec.pca_max), np.float32)
        # torch widens float16 to float32 vectorised (numpy's astype is several times slower here)
        x = torch.from_numpy(self.gate[rows])[:, self._proj_layers].float().transpose(0, 1)
        y = torch.baddbmm(self._proj_bias, x, self._proj).transpose(0, 1)
        if len(self._proj_layers) == self.spec.num_layers:
            return y.numpy()
        out = torch.zeros(len(rows), self.spec.num_layers, self.spec.pca_max)
        out[:, self._proj_layers] = y
        return out.numpy()

    def _dense(self, rows: np.ndarray) -> np.ndarray:
        """The rows' dense features (``dense_rows``), gate inputs read from the TraceSet for this batch."""
        own, earlier = None, []
        if self.gate is not None:
            own = self._project(rows)
            pos = self.pos[rows]
            for n in range(1, self.spec.context_gate + 1):
                prev = np.zeros_like(own)
                has = np.nonzero(pos >= n)[0]
                if len(has):
                    prev[has] = self._project(rows[has] - n)
                earlier.append(prev)
        return dense_rows(
            self.spec,
            own,
            earlier,
            None if self.weights is None else self.weights[rows],
            self.topk[rows],
            None if self.votes is None else self.votes[rows],
        )

    def _loader(self, rows: np.ndarray, train: bool) -> DataLoader:
        hp = self.hparams
        return batch_loader(self.batch, rows, hp.batch_size, train, hp.num_workers, str(self.traces))

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_rows, True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_rows, False)
