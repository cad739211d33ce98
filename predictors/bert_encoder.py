"""A fast, checked BERT sentence encoder for CasMoE's planners (casmoe-eam-eap-cascade.md, EAM Eq. 4).

The EAM's embedding (Eq. 4) and the EAP's encoder (Eq. 6) spend almost all of a query in
a BERT encoder. :class:`FastBertEncoder` computes Hugging Face's ``BertModel`` followed by
sentence-transformers' mean ``Pooling`` and ``Normalize`` for a batch-1 query without the
library overhead; :func:`checked_fast_encoder` picks the fastest execution
(:class:`~moecast.predictors.onnx_encoder.OrtBertEncoder` or :class:`FastBertEncoder`, fp32
or int8) and checks it against the reference forward before using it.
"""

from __future__ import annotations

import warnings
from typing import Any

from moecast.errors import InputError


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
            raise InputError(f"FastBertEncoder: {why}")
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
        raise InputError(f"{owner}: engine {engine!r} is not one of {', '.join(ENGINES)}")
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
    args = {k: v.to(model.device) for k, v in feats.items() if k in ENCODER_INPUTS}
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
        ort_enc = _checked_ort_encoder(model, args, ref, int8, owner, engine, threads)
        if ort_enc is not None:
            return ort_enc
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


def _checked_ort_encoder(
    model: Any,
    args: dict[str, Any],
    ref: Any,
    int8: bool,
    owner: str,
    engine: str,
    threads: int | None,
) -> Any:
    """The ONNX Runtime encoder when onnxruntime is installed and it matches ``ref`` on the probes,
    else None after a warning (no warning when ``engine`` is auto and onnxruntime is absent)."""
    from moecast.predictors.onnx_encoder import OrtBertEncoder, onnxruntime_available

    # stacklevel 4: the warnings point, as before, at checked_fast_encoder's caller's caller
    if not onnxruntime_available():
        if engine == "onnx":
            warnings.warn(
                f"{owner}: engine 'onnx' needs onnxruntime (`pip install onnxruntime onnx`); using torch",
                UserWarning,
                stacklevel=4,
            )
        return None
    try:
        ort_enc = OrtBertEncoder(model, int8=int8, threads=threads)
        got = ort_enc(**args)
    except Exception as exc:  # exporter or runtime gaps for this model: torch still works
        warnings.warn(
            f"{owner}: ONNX Runtime path unavailable ({exc}); using torch", UserWarning, stacklevel=4
        )
        return None
    cos = float((got * ref).sum(-1).min())
    err = float((got - ref).abs().max())
    if (cos >= 0.95) if int8 else (err <= 1e-4):
        return ort_enc
    warnings.warn(
        f"{owner}: the ONNX Runtime path is off the reference (max diff {err:.2g}, min cosine "
        f"{cos:.4f}); using torch",
        UserWarning,
        stacklevel=4,
    )
    return None


ENCODER_INPUTS = ("input_ids", "attention_mask", "token_type_ids")
