"""A BERT sentence encoder (mean pooling + L2 norm) run by ONNX Runtime on the CPU.

The CasMoE planners (casmoe-eam-eap-cascade.md, EAM Eq. 4 and the EAP's encoder) spend
almost all of a query in the encoder. :class:`OrtBertEncoder` computes the same
function as :class:`~moecast.predictors.bert_encoder.FastBertEncoder` (Hugging Face's
``BertModel``, then sentence-transformers' mean ``Pooling`` and ``Normalize``), exported
once with ``torch.onnx`` and executed by ONNX Runtime, whose fused CPU kernels and int8
GEMMs are faster at batch 1 than torch's.

``int8``: ONNX Runtime's dynamic quantisation of the constant-weight MatMuls (the six
Linear layers of each block): per-output-channel int8 weights, activations quantised per
tensor at run time; attention's activation-activation products stay fp32.

Measured with ``python bench/bench_casmoe.py [--engine onnx|torch] [--int8] [--threads N]``: at one
thread ONNX Runtime takes about 0.7x torch's time per EAM query, int8 keeping plan recall (figures,
dated, in bench/results/experiments.md).

The exported graph is cached under ``$MOECAST_HOME/onnx/`` keyed by a hash of the weights
(so a fine-tuned EAP encoder gets its own), written atomically; a later load only reads it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import warnings
from pathlib import Path
from typing import Any

import numpy as np

# bump when the exported graph changes (inputs, pooling, quantisation recipe)
ORT_FORMAT = 1


def onnxruntime_available() -> bool:
    try:
        import onnxruntime  # noqa: F401
    except ImportError:
        return False
    return True


# config entries that do not change the encoder's arithmetic: sentence-transformers and a plain
# AutoModel load of the same MiniLM differ in use_cache, and must share one graph
_CONFIG_NOT_IN_GRAPH = frozenset(
    {
        "use_cache",
        "_name_or_path",
        "transformers_version",
        "architectures",
        "return_dict",
        "output_hidden_states",
    }
)


def weights_digest(model: Any) -> str:
    """Hash of a model's config and every tensor's bytes: one cached graph per set of weights."""
    import torch

    h = hashlib.blake2b(digest_size=12)
    cfg = {k: v for k, v in model.config.to_dict().items() if k not in _CONFIG_NOT_IN_GRAPH}
    h.update(json.dumps(cfg, sort_keys=True, default=str).encode())
    for name, t in model.state_dict().items():
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def cache_dir() -> Path:
    from moecast import home

    return home() / "onnx"


def _export_fp32(model: Any, path: Path) -> None:
    import torch

    class Pooled(torch.nn.Module):
        def __init__(self, enc: Any) -> None:
            super().__init__()
            self.enc = enc

        def forward(self, input_ids: Any, attention_mask: Any) -> Any:
            h = self.enc(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
            m = attention_mask.unsqueeze(-1).to(h.dtype)
            pooled = (h * m).sum(1) / m.sum(1).clamp(min=1e-9)
            return torch.nn.functional.normalize(pooled, dim=-1)

    was_training = model.training
    model.eval()
    ids = torch.ones(1, 8, dtype=torch.long)
    try:
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")  # tracer and exporter deprecation chatter
            torch.onnx.export(
                Pooled(model),
                (ids, torch.ones_like(ids)),
                str(path),
                input_names=["input_ids", "attention_mask"],
                output_names=["embedding"],
                dynamic_axes={
                    "input_ids": {0: "batch", 1: "tokens"},
                    "attention_mask": {0: "batch", 1: "tokens"},
                },
                opset_version=17,
                dynamo=False,
            )
    finally:
        model.train(was_training)


def export_onnx(model: Any, int8: bool = False, directory: Path | None = None) -> Path:
    """Path of the cached ONNX graph of ``model`` (+ pooling), exporting it first when missing."""
    directory = Path(directory) if directory is not None else cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    name = f"{type(model).__name__}-{weights_digest(model)}-v{ORT_FORMAT}"
    fp32 = directory / f"{name}-fp32.onnx"
    out = directory / f"{name}-int8.onnx" if int8 else fp32
    if out.is_file():
        return out
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        tmp_fp32 = Path(tmp) / "fp32.onnx"
        if fp32.is_file():
            tmp_fp32 = fp32
        else:
            _export_fp32(model, tmp_fp32)
        if int8:
            import onnx
            from onnxruntime.quantization import QuantType, quantize_dynamic

            tmp_q = Path(tmp) / "int8.onnx"
            root = logging.getLogger()
            level = root.level
            root.setLevel(logging.ERROR)  # the quantiser's advice on pre-processing goes to the root logger
            try:
                quantize_dynamic(
                    str(tmp_fp32),
                    str(tmp_q),
                    weight_type=QuantType.QInt8,
                    per_channel=True,
                    op_types_to_quantize=["MatMul"],
                    extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT, "MatMulConstBOnly": True},
                )
            finally:
                root.setLevel(level)
            os.replace(tmp_q, out)
        if tmp_fp32 != fp32:
            os.replace(tmp_fp32, fp32)
    return out


_RUNNERS: dict[tuple[str, int | None], Any] = {}


def _runner(path: Path, threads: int | None) -> Any:
    """One ONNX Runtime ``InferenceSession`` per (graph file, threads) in a process.

    An EAM and a frozen-encoder EAP embed with the same graph: one runner serves both.
    Intra-op threads do not spin between runs: a second runner's spinning pool on a 2-core
    machine takes the cores from the first (EAP 27 -> 52 ms per prompt).
    """
    key = (str(path), threads)
    if key not in _RUNNERS:
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        opts.inter_op_num_threads = 1
        if threads:
            opts.intra_op_num_threads = int(threads)
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        opts.log_severity_level = 3  # the quantised graph's shape-inference notes are not the user's business
        _RUNNERS[key] = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    return _RUNNERS[key]


class OrtBertEncoder:
    """[N, T] token ids -> [N, D] unit-norm sentence embeddings, by ONNX Runtime (CPU).

    Same call as :class:`~moecast.predictors.bert_encoder.FastBertEncoder`; returns a torch
    tensor so the EAP's heads take it as they are. ``threads``: ONNX Runtime's intra-op
    threads for one prompt (None: its default, every core); batches use every core. The graph reflects the weights when built;
    build it again if the model is trained further.
    """

    def __init__(
        self, model: Any, int8: bool = False, threads: int | None = 1, directory: Path | None = None
    ):
        self.int8 = bool(int8)
        self.path = export_onnx(model, self.int8, directory)
        try:
            self.runner = _runner(self.path, threads)
        except Exception as exc:  # a truncated or foreign cache file: rebuild once
            self.path.unlink(missing_ok=True)
            warnings.warn(
                f"ONNX cache {self.path} unreadable ({exc}); exporting again", UserWarning, stacklevel=2
            )
            self.path = export_onnx(model, self.int8, directory)
            self.runner = _runner(self.path, threads)

    def __call__(self, input_ids: Any, attention_mask: Any = None, token_type_ids: Any = None) -> Any:
        import torch

        ids = np.ascontiguousarray(input_ids.cpu().numpy(), dtype=np.int64)
        mask = np.ones_like(ids) if attention_mask is None else attention_mask.cpu().numpy().astype(np.int64)
        # batches (building an index, embedding a training set) take every core, as torch does
        runner = self.runner if len(ids) == 1 else _runner(self.path, None)
        (out,) = runner.run(None, {"input_ids": ids, "attention_mask": mask})
        return torch.from_numpy(out)
