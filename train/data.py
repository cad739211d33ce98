"""Lightning data modules over a TraceSet: request-level split, per-token inputs built batch by batch.

Every rank reads the same files and the seeded ``TraceSet.splits`` (so DDP needs no broadcast).
The narrow per-token fields (expert ids, router weights, positions, token ids) are held as numpy
arrays; the wide one, gate inputs, is read from the TraceSet's memory-mapped Arrow parts for each
batch (``TraceSet.rows``) and projected there, so memory does not grow with the hidden size times
the token count. A batch is assembled with vectorised numpy in ``__getitems__`` (one call per
batch, no per-row Python).
"""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from moecast.collect.splits import Splits
from moecast.collect.traceset import TraceSet, open_traces
from moecast.predictors.llapor_features import (
    FeatureSpec,
    context_votes,
    dense_rows,
    previous_occurrence,
    sparse_bags,
    token_context,
)
from moecast.predictors.llapor_groups import detect_groups, format_groups, gate_cosine, routing_correlation
from moecast.predictors.metrics import MetricAccumulator, multi_hot
from torch.utils.data import DataLoader, Dataset, Sampler

from moecast.errors import InputError

CHUNK = 65536  # rows of gate inputs checked at a time


def split_requests(
    ts: TraceSet, val_fraction: float, test_fraction: float, seed: int, max_requests: int | None
) -> tuple[list[str], list[str], Splits]:
    """(train, val, splits) for a trainer: it fits on train and selects on val; test stays apart."""
    splits = ts.splits(val_fraction, test_fraction, seed)
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


def check_range(
    section: str,
    name: str,
    value: Any,
    kind: type = float,
    lo: float | None = None,
    hi: float | None = None,
    open_lo: bool = False,
    open_hi: bool = False,
    optional: bool = False,
) -> None:
    """One clear ``ValueError`` when a hyper-parameter has the wrong type or lies outside its range."""
    if value is None and optional:
        return
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    ok = number and math.isfinite(value) and (kind is float or float(value).is_integer())
    if ok and lo is not None:
        ok = value > lo if open_lo else value >= lo
    if ok and hi is not None:
        ok = value < hi if open_hi else value <= hi
    if not ok:
        rng = ""
        if lo is not None or hi is not None:
            left = ("(" if open_lo else "[") + (f"{lo:g}" if lo is not None else "-inf")
            right = (f"{hi:g}" if hi is not None else "inf") + (")" if open_hi else "]")
            rng = f" in {left}, {right}"
        raise InputError(
            f"{section}.{name} must be {'an integer' if kind is int else 'a number'}{rng}, got {value!r}"
        )


def check_split(section: str, val_fraction: Any, test_fraction: Any, seed: Any) -> None:
    # an empty validation split has nothing to select the best epoch by
    check_range(section, "val_fraction", val_fraction, float, 0, 1, open_lo=True, open_hi=True)
    check_range(section, "test_fraction", test_fraction, float, 0, 1, open_hi=True)
    check_range(section, "seed", seed, int)
    if val_fraction + test_fraction >= 1:
        raise InputError(
            f"{section}.val_fraction + {section}.test_fraction = {val_fraction + test_fraction:g} leaves no "
            "training requests; keep the sum below 1"
        )


def check_flag(section: str, name: str, value: Any, also: tuple[str, ...] = ()) -> None:
    if not isinstance(value, bool) and value not in also:
        allowed = " or ".join(["true", "false", *(repr(a) for a in also)])
        raise InputError(f"{section}.{name} must be {allowed}, got {value!r}")


def planned_epochs(trainer: Any, what: str) -> int:
    """``trainer.max_epochs`` as the length ``what`` (a warm-up and cosine schedule) is laid out
    over: one clear ``ValueError`` when the run has no epoch count (-1: bounded by max_time or
    max_steps only), which would squeeze the whole schedule into the first epoch."""
    total = trainer.max_epochs
    if total is None or int(total) < 1:
        raise InputError(
            f"trainer.max_epochs must be a positive number of epochs, got {total!r}: {what} is laid out "
            "over it (bound the wall time with trainer.max_time as well)"
        )
    return int(total)


def log_validation(
    module: pl.LightningModule,
    acc: MetricAccumulator,
    moe_layers: list[int],
    groups: dict[str, list[int]] | None = None,
) -> dict[str, Any] | None:
    """Log the held-out metrics (predictors.metrics: recall@k, precision, micro and macro F1)
    overall, per MoE layer and per layer group; returns them, or None when there were no rows.

    Under DDP each rank validated a shard (``eval_sampler``): the ranks' counts are summed first,
    so every rank logs the whole split's figures. ``val/recall`` is recall@k, the monitored value.
    """
    if module.trainer.world_size > 1:
        vec = torch.from_numpy(acc.counts()).to(module.device)
        acc.set_counts(module.all_gather(vec).reshape(-1, len(vec)).sum(0).cpu().numpy())
    if not acc.rows.sum():
        return None
    parts = {f"layer/{layer}": [i] for i, layer in enumerate(moe_layers)}
    parts.update({f"group/{g}": list(ls) for g, ls in (groups or {}).items() if ls})
    res = acc.result(parts)
    names = {
        "recall_at_k": "recall",
        "precision": "precision",
        "f1_micro": "f1_micro",
        "f1_macro": "f1_macro",
    }
    for key, name in names.items():
        module.log(f"val/{name}", res[key], prog_bar=name == "recall")
        for part, summary in res["per_group"].items():
            kind, label = part.split("/", 1)
            module.log(f"val/{name}_{kind}/{label}", summary[key])
    return res


def eval_sampler(n: int) -> Sampler | None:
    """Validation under DDP: each rank takes every world-th item, unpadded. Lightning's default
    sampler evens the shards by repeating items, which ``log_validation`` would count twice.
    None (Lightning's choice) on one process, or with fewer items than ranks."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or not 1 < dist.get_world_size() <= n:
        return None
    from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSampler

    return UnrepeatedDistributedSampler(range(n), shuffle=False)


class RowBatches(Dataset):
    """Rows of a token table; ``__getitems__`` builds a whole batch of LLaPor inputs at once."""

    def __init__(self, dm: LLaPorDataModule, rows: np.ndarray) -> None:
        self.dm, self.rows = dm, rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.__getitems__([i])

    def __getitems__(self, idx: list[int]) -> dict[str, torch.Tensor]:
        return self.dm.batch(self.rows[np.asarray(idx)])


def _finite_rows(ts: TraceSet, name: str, requests: list[str]) -> Any:
    """``ts.rows(name, requests)``, checked for NaN / inf chunk by chunk (never all in memory)."""
    rows = ts.rows(name, requests)
    if not all(np.isfinite(rows[lo : lo + CHUNK]).all() for lo in range(0, len(rows), CHUNK)):
        raise InputError(f"{ts.path}: {name} contain NaN or inf; re-collect the traces")
    return rows


def _identity(batch: Any) -> Any:
    return batch


class LLaPorDataModule(pl.LightningDataModule):
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
        traces: TraceSet directory (``--traces``)
        val_fraction: share of requests held out for validation: selects the best epoch
        test_fraction: share of requests held out for testing (``moecast predictors eval``
            reports it); never trained or selected on
        seed: split seed
        batch_size: token rows per batch
        max_requests: train on at most this many requests (all when null)
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

    def __init__(
        self,
        traces: str,
        val_fraction: float = 0.1,
        test_fraction: float = 0.1,
        seed: int = 0,
        batch_size: int = 512,
        max_requests: int | None = None,
        prev_layers: int = 1,
        deep_history: bool = False,
        history_tokens: int | None = None,
        history_layers: int = 1,
        context_tokens: int = 0,
        dense_skip: bool = False,
        token_buckets: int | None = None,
        token_dim: int = 32,
        token_exact: bool = False,
        token_min_count: int = 1,
        repeat_token: bool = False,
        context_vote: int = 0,
        vote_power: float = 4.0,
        context_gate: int = 0,
        gate_pca: bool | str = "auto",
        weights: bool | str = "auto",
        pca_io: int = 256,
        pca_middle: int = 512,
        pca_fit_rows: int = 20000,
        groups: dict[str, list[int]] | None = None,
        soft_targets: bool | str = "auto",
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        d = "data"
        check_split(d, val_fraction, test_fraction, seed)
        check_range(d, "max_requests", max_requests, int, 1, optional=True)
        for name, value, lo in (
            ("batch_size", batch_size, 1),
            ("prev_layers", prev_layers, 0),
            ("history_layers", history_layers, 0),
            ("context_tokens", context_tokens, 0),
            ("token_dim", token_dim, 1),
            ("token_min_count", token_min_count, 1),
            ("context_vote", context_vote, 0),
            ("context_gate", context_gate, 0),
            ("pca_io", pca_io, 1),
            ("pca_middle", pca_middle, 1),
            ("pca_fit_rows", pca_fit_rows, 1),
            ("num_workers", num_workers, 0),
        ):
            check_range(d, name, value, int, lo)
        check_range(d, "history_tokens", history_tokens, int, 0, optional=True)
        check_range(d, "token_buckets", token_buckets, int, 0, optional=True)
        check_flag(d, "deep_history", deep_history)
        check_flag(d, "dense_skip", dense_skip)
        check_flag(d, "token_exact", token_exact)
        check_range(d, "vote_power", vote_power, float, 0)
        check_flag(d, "repeat_token", repeat_token)
        check_flag(d, "gate_pca", gate_pca, ("auto",))
        check_flag(d, "weights", weights, ("auto",))
        check_flag(d, "soft_targets", soft_targets, ("auto",))
        if groups is not None and not (
            isinstance(groups, dict)
            and all(isinstance(v, list) and all(isinstance(x, int) for x in v) for v in groups.values())
        ):
            raise InputError(f"data.groups must be null or {{group: [layer positions]}}, got {groups!r}")
        if groups is not None and set(groups) - {"input", "middle", "output"}:
            # a misspelt name would train every layer as no group: no middle body, rates or PCA width
            bad = ", ".join(sorted(set(groups) - {"input", "middle", "output"}))
            raise InputError(f"data.groups: unknown group {bad}; the groups are input, middle and output")
        self.save_hyperparameters()
        self.traces = traces
        self._built = False

    # ------------------------------------------------------------------ build once
    def setup(self, stage: str | None = None) -> None:
        if self._built:
            return
        hp = self.hparams
        ts = open_traces(self.traces)
        self.ts = ts
        m = ts.meta.model
        L, E, k = m.num_layers, m.num_experts, m.top_k
        self.train_ids, self.val_ids, self.splits = split_requests(
            ts, hp.val_fraction, hp.test_fraction, hp.seed, hp.max_requests
        )
        ids_order = self.train_ids + self.val_ids
        self.topk = np.ascontiguousarray(ts.array("topk_ids", ids_order))
        if (self.topk < 0).any() or (self.topk >= E).any():
            raise InputError(f"{ts.path}: topk_ids outside [0, {E}); the TraceSet is corrupt")
        self.pos = positions_of(ts, ids_order)
        self.token_ids = ts.column("token_id", ids_order).astype(np.int64)
        self.prev_same = previous_occurrence(self.token_ids, self.pos) if hp.repeat_token else None
        n_train = int(ts.request_lengths(self.train_ids).sum())
        self.train_rows = np.arange(n_train)
        self.val_rows = np.arange(n_train, len(self.topk))

        use_gate = self._want("gate_pca", "gate_inputs", ts)
        use_w = self._want("weights", "topk_weights", ts)
        # read lazily from the memory-mapped parts (the widest field by far); checked in chunks
        gate = _finite_rows(ts, "gate_inputs", ids_order) if use_gate else None

        # layer groups (§3.1): from config, or from the training split's statistics
        sub = self.train_rows[:: max(1, n_train // hp.pca_fit_rows)]
        # the sampled training rows' gate inputs: group detection and the PCA fit both read them
        gate_sub = gate[sub].astype(np.float32) if gate is not None else None
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
        print(format_groups(self.groups, m.moe_layers))

        pca_dims = [0] * L
        if use_gate:
            group_of = {li: g for g, ls in self.groups.items() for li in ls}
            # layer l's PCA feeds layer l+1 (and, with context_gate, layer l itself)
            for li in range(L if hp.context_gate else L - 1):
                want = hp.pca_middle if group_of[min(li + 1, L - 1)] == "middle" else hp.pca_io
                pca_dims[li] = int(min(want, m.hidden_size, len(sub)))
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
        self.spec = FeatureSpec(
            num_layers=L,
            num_experts=E,
            top_k=k,
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
        self.pca_components = np.zeros((L, self.spec.pca_max, m.hidden_size if use_gate else 0), np.float32)
        self.pca_mean = np.zeros((L, m.hidden_size if use_gate else 0), np.float32)
        # dense features are built batch by batch: the gate inputs stay in the memory-mapped parts
        self.gate = gate if self.spec.dense_dim else None
        self.weights = self.votes = None
        if self.spec.dense_dim:
            if use_gate:
                from sklearn.decomposition import PCA

                for li in range(L):
                    if not pca_dims[li]:
                        continue
                    pca = PCA(n_components=pca_dims[li], random_state=hp.seed)
                    pca.fit(gate_sub[:, li])
                    self.pca_components[li, : pca_dims[li]] = pca.components_
                    self.pca_mean[li] = pca.mean_
                # (x - mean) @ C^T as one batched multiply-add: x @ C^T + (-mean @ C^T)
                self._proj_layers = torch.tensor([li for li in range(L) if pca_dims[li]], dtype=torch.long)
                comps = torch.from_numpy(self.pca_components[self._proj_layers])
                self._proj = comps.transpose(1, 2).contiguous()
                self._proj_bias = -torch.bmm(
                    torch.from_numpy(self.pca_mean[self._proj_layers])[:, None], self._proj
                )
            if use_w:
                self.weights = np.ascontiguousarray(ts.array("topk_weights", ids_order))
                if not np.isfinite(self.weights).all():
                    raise InputError(f"{ts.path}: topk_weights contain NaN or inf; re-collect the traces")
            if self.spec.context_vote:
                # pools over every earlier token of the request, so it is built once (float16)
                self.votes = context_votes(self.spec, self.topk, self.pos).astype(np.float16)
        # the router's probabilities, for the model's distillation loss: read per batch like gate inputs
        want_probs = self._want("soft_targets", "router_probs", ts)
        self.probs = _finite_rows(ts, "router_probs", ids_order) if want_probs else None
        # expert frequencies f_i per layer on the training split, for the balancing loss
        counts = np.zeros((L, E))
        for li in range(L):
            counts[li] = np.bincount(self.topk[:n_train, li].ravel().astype(np.int64), minlength=E)
        freq = (counts + 1) / (counts + 1).sum(1, keepdims=True)
        inv = 1.0 / freq
        self.inv_freq = (inv / inv.mean(1, keepdims=True)).astype(np.float32)
        self._built = True

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

    def _loader(self, rows: np.ndarray, shuffle: bool) -> DataLoader:
        if len(rows) == 0:
            raise InputError(
                f"{self.traces}: the {'training' if shuffle else 'validation'} split has no tokens"
            )
        return DataLoader(
            RowBatches(self, rows),
            batch_size=self.hparams.batch_size,
            shuffle=shuffle,
            sampler=None if shuffle else eval_sampler(len(rows)),
            collate_fn=_identity,
            num_workers=self.hparams.num_workers,
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_rows, True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_rows, False)
