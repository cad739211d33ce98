"""A DeepSeek-V2-Lite-shaped MoE with random weights, routed by recorded DeepSeek traces (a benchmark mode).

The expert shape is DeepSeek-V2-Lite's (hidden 2048, expert intermediate 1408, 64 routed + 2 shared
experts, top-6, MLA attention, bf16); the weights are random and ``--layers N`` MoE layers are built
(the real model has 26, after one dense layer that is left out). No model that runs here can
produce DeepSeek's routing, so the routers' decisions are replaced by the ids recorded from the
real model (``../shared/traces/deepseek-v2-lite-puffin``), on prompts that no DeepSeek checkpoint
trained on: held out both by the earlier ungrouped split (``TraceSet.split(0.1, seed=0)``) and
as the test side of the prompt-grouped one (``TraceSet.splits()``).
Without the traces, the model's own random router decides, and the benches say so.

The replacement goes through the model's standard path: each router module's forward returns the
recorded ids, weights from logits whose top-k are those ids (so hooks that read router
probabilities see a distribution consistent with the routing), and the experts interface is
called with them as usual.

    python bench/ds_model.py [--extract runs/ds_routing.npz] [--requests 8]

writes the held-out routing of a few requests to a small file that ``--traces`` also accepts
(for a machine that does not have the 185 MB of CSV files; the benches find it at its default
path when no CSV folder is there).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import mmap
import time
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from moecast.collect.models import kv_cache, with_cache
from moecast.predictors.base import LayerAhead

ROOT = Path(__file__).resolve().parents[1]
PUFFIN_NAME = "deepseek-v2-lite-puffin"
# where a checkout finds ../shared (worktrees), or a copy of it inside the repository (device machines)
PUFFIN_DIRS = (ROOT.parent / "shared" / "traces" / PUFFIN_NAME, ROOT / "shared" / "traces" / PUFFIN_NAME)
# the default --extract output (runs/ is ignored by git): found when no CSV folder is
DEFAULT_EXTRACT = ROOT / "runs" / "ds_routing.npz"
# DeepSeek-V2-Lite's shape (config.json of deepseek-ai/DeepSeek-V2-Lite-Chat)
DS_LITE = dict(
    hidden_size=2048,
    moe_intermediate_size=1408,
    n_routed_experts=64,
    n_shared_experts=2,
    num_experts_per_tok=6,
    num_attention_heads=16,
    num_key_value_heads=16,
    kv_lora_rank=512,
    q_lora_rank=None,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    vocab_size=102400,
    intermediate_size=10944,
)
#: the DeepSeek traces' MoE layer count (model layers 1..26)
DS_MOE_LAYERS = 26


def ds_config(layers: int, **overrides: Any) -> Any:
    """A DeepseekV2Config of DeepSeek-V2-Lite's shape with ``layers`` MoE layers (sizes overridable, for tests)."""
    from transformers import DeepseekV2Config

    shape = {**DS_LITE, **overrides}
    return DeepseekV2Config(
        num_hidden_layers=layers,
        first_k_dense_replace=0,
        n_group=1,
        topk_group=1,
        topk_method="greedy",
        norm_topk_prob=False,
        routed_scaling_factor=1.0,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        **shape,
    )


def build_ds_model(cfg: Any, dtype: torch.dtype = torch.bfloat16, device: str = "cpu", seed: int = 0) -> Any:
    """Random weights (the family's own initialisation, seeded), built directly on ``device`` in ``dtype``."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return model.eval()


# ----------------------------------------------------------------------------- experts on disk


def _dense_init(model: Any, expert_names: set[str], seed: int) -> None:
    """Random non-expert weights in place of the meta ones (norms 1, the rest N(0, 0.02) as the family's init)."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in list(model.named_parameters()):
        if name in expert_names or p.device.type != "meta":
            continue
        mod_name, _, attr = name.rpartition(".")
        mod = model.get_submodule(mod_name)
        t = torch.ones(p.shape) if "norm" in name else torch.randn(p.shape, generator=gen) * 0.02
        mod._parameters[attr] = torch.nn.Parameter(t.to(p.dtype), requires_grad=False)


def ensure_offload(cfg: Any, directory: str | Path, seed: int = 0) -> Path:
    """The model's experts in an offload directory (runtime/tiers/offload.py's format), generated once: one
    MoE layer at a time (random, seeded per layer), so no more than one layer's experts is ever in
    memory; the non-expert weights go to its dense file. A re-run keeps the complete files."""
    from moecast.collect.models import find_moe_structure
    from moecast.runtime.tiers import offload as O
    from safetensors.torch import save

    d = O.prepare_dir(directory)
    model = _meta_model(cfg)
    st = find_moe_structure(model)
    meta = O.offload_meta(model, st)
    todo = O.missing_layers(d, meta)
    if not todo and (d / O.DENSE).is_file():
        return d
    O._write_atomic(d / "meta.json", lambda f: f.write(json.dumps(meta, indent=1).encode()))
    layouts = O._layouts(meta)
    for pos in todo:
        gen = torch.Generator().manual_seed(seed * 1000 + pos + 1)
        shapes = {n: t.shape for n, t in O.expert_params(st.layers[pos].experts).items()}
        params = {n: (torch.randn(s, generator=gen) * 0.02).to(torch.bfloat16) for n, s in shapes.items()}
        O._write_atomic(
            d / meta["files"][pos],
            lambda f, p=params, pos=pos: O._write_layer(f, p, layouts[pos], meta["num_experts"]),
        )
        del params
    if not (d / O.DENSE).is_file():
        names = O._expert_names(model, st)
        _dense_init(model, names, seed)
        state = O._dense_state(model, names)
        O._write_atomic(
            d / O.DENSE, lambda f: f.write(save(state, metadata={"format": "pt", "moecast": O.FORMAT}))
        )
    return d


def _meta_model(cfg: Any) -> Any:
    from moecast.runtime.tiers.offload import _params_on_meta
    from transformers import AutoModelForCausalLM

    with _params_on_meta():
        return AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)


def load_dense(cfg: Any, directory: str | Path) -> Any:
    """The model with its non-expert weights from the offload directory and its experts on the meta
    device (the live runtime's disk tier reads them; they are never materialised)."""
    from moecast.runtime.tiers.offload import DENSE
    from safetensors.torch import load_file

    model = _meta_model(cfg)
    model.load_state_dict(load_file(Path(directory) / DENSE), strict=False, assign=True)
    _fault_in(model)
    return model.eval()


def _fault_in(model: Any) -> None:
    """Touch one byte of every page of the non-expert weights. safetensors maps the file, so they would
    otherwise become resident only where a forward first reads them (most of the embedding never):
    resident now, they are all in the RSS measured before a row, as a regular load would have them."""
    for t in [*model.parameters(), *model.buffers()]:
        if t.device.type == "meta" or t.numel() == 0:
            continue
        flat = t.detach().reshape(-1).view(torch.uint8)
        flat[::4096].sum() + flat[-1]  # the last byte: a page the stride can step over


def expert_views(directory: str | Path) -> list[dict[str, torch.Tensor]]:
    """Per MoE layer, its experts' stacked tensors as views of the memory-mapped layer files (no read
    happens until a page is touched: llama.cpp's way of holding weights)."""
    from moecast.runtime.tiers.offload import _header, _layouts, _read_meta

    d = Path(directory)
    meta = _read_meta(d)
    out = []
    for name, layout in zip(meta["files"], _layouts(meta)):
        with open(d / name, "rb") as f:
            mm = mmap.mmap(
                f.fileno(), 0, access=mmap.ACCESS_COPY
            )  # private: pages stay the file's until written
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # frombuffer warns that the buffer is writable
            base = torch.frombuffer(mm, dtype=torch.uint8)
        out.append(layout.views(base[_header(layout, meta["num_experts"])[1] :], meta["num_experts"]))
    return out


def _set_experts(model: Any, layer_tensors: list[dict[str, torch.Tensor] | None]) -> None:
    from moecast.collect.models import find_moe_structure

    for entry, tensors in zip(find_moe_structure(model).layers, layer_tensors):
        for name, t in (tensors or {}).items():
            entry.experts._parameters[name] = torch.nn.Parameter(t, requires_grad=False)


def mmap_experts(model: Any, directory: str | Path) -> None:
    """The page-cache baseline: the model's experts are the memory-mapped files themselves."""
    _set_experts(model, expert_views(directory))


def accelerate_folder(model: Any, directory: str | Path, folder: str | Path) -> Path:
    """Every expert tensor in accelerate's offload format (one .dat per tensor and index.json), written
    once from the offload directory, one layer at a time."""
    from accelerate.utils import offload_weight, save_offload_index
    from moecast.collect.models import find_moe_structure

    folder = Path(folder)
    if (folder / "index.json").is_file():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    index: dict[str, Any] = {}
    for entry, tensors in zip(find_moe_structure(model).layers, expert_views(directory)):
        for name, t in tensors.items():
            offload_weight(t, f"{entry.experts_name}.{name}", str(folder), index)
    save_offload_index(index, str(folder))  # last: a folder without it is written again
    return folder


def accelerate_disk(model: Any, directory: str | Path, folder: str | Path, capacity: float) -> int:
    """accelerate's disk offload of the experts at ``capacity``: the first layers' experts in RAM within the
    budget, the others read from ``folder`` by its hooks at each use. Returns the layers kept in RAM."""
    from accelerate import dispatch_model

    folder = accelerate_folder(model, directory, folder)
    dm, keep = accelerate_map(model, capacity, main="cpu", offload="disk")
    views = expert_views(directory)
    _set_experts(
        model, [{n: t.clone() for n, t in v.items()} if i < keep else None for i, v in enumerate(views)]
    )
    dispatch_model(model, device_map=dm, main_device="cpu", offload_dir=str(folder))
    return keep


# ----------------------------------------------------------------------------- recorded routing


@dataclass
class RoutedRequest:
    """One recorded request: its token ids (model vocabulary), hashed ids (the traces') and routes [T, L, k]."""

    request_id: str
    tokens: np.ndarray  # [T] ids in the model's vocabulary
    token_hashes: np.ndarray  # [T] the TraceSet's token ids (hash of the token text)
    topk_ids: np.ndarray  # [T, L, k]


@dataclass
class Routing:
    """Held-out requests of the DeepSeek traces, or nothing (``source`` says which)."""

    requests: list[RoutedRequest] = field(default_factory=list)
    source: str = ""

    @property
    def recorded(self) -> bool:
        return bool(self.requests)


def find_puffin(path: str | None = None) -> Path | None:
    """The DeepSeek traces (a CSV directory or an ``--extract`` file): ``path``, else the shared copy."""
    if path:
        p = Path(path)
        if not p.exists():
            raise FileNotFoundError(
                f"{p}: no such DeepSeek traces (a CSV directory or a .npz from --extract)"
            )
        return p
    return next(
        (p for p in PUFFIN_DIRS if p.is_dir()), DEFAULT_EXTRACT if DEFAULT_EXTRACT.is_file() else None
    )


def held_out_requests(
    source: Path, n: int, min_tokens: int, layers: int
) -> list[tuple[str, list[str], np.ndarray]]:
    """(request id, token texts, ids [T, layers, k]) of the first ``n`` held-out prompts with >= ``min_tokens``
    tokens: held out by the earlier ungrouped split and in the test side of the prompt-grouped one, so
    that a checkpoint trained under either rule has not seen them. A prompt's grouped side depends on
    its own prompt key only (collect/splits.py), so it is found without reading the other files."""
    from moecast.collect.moe_beyond import detokenize, list_files, parse_file
    from moecast.collect.splits import SplitSpec, assign, prompt_key
    from moecast.collect.traceset import split_request_ids

    files = {f"puffin-{k}": p for k, p in list_files(source)}
    _, held = split_request_ids(sorted(files), 0.1, 0)
    spec = SplitSpec()  # the defaults TraceSet.splits() and the trainers use
    out = []
    for rid in sorted(held, key=lambda r: int(r.split("-")[1])):
        _, texts, ids = parse_file(files[rid])
        if assign({rid: prompt_key(detokenize(texts))}, spec)[rid] != "test":
            continue
        if len(texts) >= min_tokens:
            out.append((rid, texts, ids[:, :layers]))
        if len(out) >= n:
            break
    return out


def load_routing(path: str | None, n: int, min_tokens: int, layers: int, vocab: int) -> Routing:
    """Routing for ``n`` requests of at least ``min_tokens`` tokens; empty when no traces are found."""
    from moecast.collect.moe_beyond import token_hash

    src = find_puffin(path)
    if src is None:
        where = ", ".join(map(str, (*PUFFIN_DIRS, DEFAULT_EXTRACT)))
        return Routing(source=f"no DeepSeek traces (looked in {where})")
    if src.suffix == ".npz":
        z = np.load(src)
        rows = [(str(r), None, z[f"ids_{i}"], z[f"hash_{i}"]) for i, r in enumerate(z["request_ids"])]
        rows = [r for r in rows if len(r[2]) >= min_tokens][:n]
    else:
        raw = held_out_requests(src, n, min_tokens, layers)
        rows = [(r, t, ids, np.array([token_hash(x) for x in t], np.int64)) for r, t, ids in raw]
    if any(r[2].shape[1] < layers for r in rows):
        raise ValueError(f"{src}: the recorded routing has fewer than {layers} MoE layers; lower --layers")
    # the model's vocabulary: each distinct token of these requests gets its own id
    uniq = np.unique(np.concatenate([r[3] for r in rows])) if rows else np.zeros(0, np.int64)
    reqs = [
        RoutedRequest(rid, np.searchsorted(uniq, h) % vocab, h, ids[:, :layers].astype(np.int64))
        for rid, _t, ids, h in rows
    ]
    return Routing(reqs, f"recorded routing of {len(reqs)} held-out DeepSeek-V2-Lite requests ({src})")


class RoutingOverride:
    """Replace every router's decision by the recorded ids of the request being run.

    ``install(model, structure)`` wraps each router module's forward; a forward pre-hook on the model
    takes the next ``seq`` rows of the request (``start(request)`` resets to its first token), so a
    prefill followed by one-token decode steps walks the request in order.
    """

    def __init__(self) -> None:
        self.ids: torch.Tensor | None = None  # [T, L, k]
        self.pos = 0
        self.rows = slice(0, 0)
        self._undo: list[Any] = []

    def start(self, request: RoutedRequest, device: torch.device | str = "cpu") -> None:
        """Walk ``request`` from its first token; its ids go to ``device`` here, once, so that no layer's
        router makes a blocking host-to-device copy (a stream sync in every layer of every row)."""
        self.ids = torch.from_numpy(request.topk_ids).to(device)
        self.pos = 0

    def install(self, model: Any, structure: Any) -> RoutingOverride:
        for layer, entry in enumerate(structure.layers):
            router = entry.router
            router.forward = self._forward(router, layer)
            self._undo.append(lambda r=router: r.__dict__.pop("forward", None))
        # prepended: the request's row is known to every pre-hook of the forward, the runtime's too
        # (its first layer's prefetch, predicted at the step's start, asks the oracle for it)
        self._undo.append(
            model.register_forward_pre_hook(self._advance, with_kwargs=True, prepend=True).remove
        )
        return self

    def remove(self) -> None:
        for undo in self._undo:
            undo()
        self._undo = []

    def _advance(self, module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        n = int(ids.shape[-1])
        self.rows = slice(self.pos, self.pos + n)
        self.pos += n

    def _forward(self, router: Any, layer: int):
        original = router.forward

        def forward(hidden_states: torch.Tensor):
            logits, _w, _i = original(hidden_states)
            if self.ids is None:
                raise RuntimeError("RoutingOverride.start(request) was not called before the forward")
            ids = self.ids[self.rows, layer]
            # lift the recorded experts above every other logit: the softmax's top-k is then the recording
            lifted = logits.scatter(1, ids, logits.max(1, keepdim=True).values + 4.0 + logits.gather(1, ids))
            weights = lifted.softmax(-1).gather(1, ids) * router.routed_scaling_factor
            return lifted, weights, ids

        return forward


@contextlib.contextmanager
def routed(model: Any, routing: Routing):
    """The model with its routers replaced by ``routing`` (no change when it holds no requests)."""
    if not routing.recorded:
        yield None
        return
    from moecast.collect.models import find_moe_structure

    ov = RoutingOverride().install(model, find_moe_structure(model))
    try:
        yield ov
    finally:
        ov.remove()


# ----------------------------------------------------------------------------- running tokens


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def decode(
    model: Any,
    tokens: np.ndarray,
    prompt: int,
    device: torch.device,
    keep_logits: bool = False,
    on_forward: Any = None,
) -> tuple[list[float], torch.Tensor | None]:
    """Prefill ``tokens[:prompt]``, then decode the rest one by one (teacher-forced, the same tokens in
    every configuration). Returns (ms of each decode step, logits [steps + 1, V] when kept);
    ``on_forward(is_decode)`` runs after each forward."""
    toks = torch.as_tensor(tokens, device=device)[None]
    out = model(input_ids=toks[:, :prompt], use_cache=True)
    if on_forward:
        on_forward(False)
    logits = [out.logits[0, -1].float().cpu()] if keep_logits else []
    cache = kv_cache(out)
    times = []
    for t in range(prompt, toks.shape[1]):
        _sync(device)
        t0 = time.perf_counter()
        out = model(input_ids=toks[:, t : t + 1], **with_cache(model, cache), use_cache=True)
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
        if on_forward:
            on_forward(True)
        if keep_logits:
            logits.append(out.logits[0, -1].float().cpu())
    return times, (torch.stack(logits) if keep_logits else None)


def decode_all(
    model: Any,
    requests: list[np.ndarray],
    prompt: int,
    device: torch.device,
    routing: Routing,
    override: RoutingOverride | None,
    keep_logits: bool = False,
    on_forward: Any = None,
    warmup: int = 2,
) -> tuple[list[float], list[torch.Tensor | None]]:
    """Every request in order (the override walks each one's recorded routing); the decode steps'
    ms without the first ``warmup`` of the run, and the logits per request."""
    times, logits = [], []
    for i, tokens in enumerate(requests):
        if override is not None:
            override.start(routing.requests[i], device)
        t, lg = decode(model, tokens, prompt, device, keep_logits, on_forward)
        times += t
        logits.append(lg)
    return times[warmup:] if len(times) > warmup else times, logits


# ----------------------------------------------------------------------------- accelerate baseline


def accelerate_map(model: Any, budget_fraction: float, main: Any, offload: str) -> tuple[dict[str, Any], int]:
    """accelerate device map: every module on ``main`` except the experts modules past the budget
    (mapped to ``offload``: "cpu" or "disk"). accelerate's unit is the module, so a layer's experts are
    resident or offloaded together: the first ``int(budget_fraction * layers)`` layers keep theirs
    (never over the budget). Built by hand because ``infer_auto_device_map`` offloads attention too."""
    from moecast.collect.models import find_moe_structure

    layers = find_moe_structure(model).layers
    keep = int(budget_fraction * len(layers))
    offloaded = {e.experts_name for e in layers[keep:]}
    dm: dict[str, Any] = {}

    def walk(prefix: str, module: Any) -> None:
        for name, child in module.named_children():
            full = f"{prefix}{name}"
            if full in offloaded:
                dm[full] = offload
            elif any(o.startswith(full + ".") for o in offloaded):
                for pname, _ in child.named_parameters(recurse=False):
                    dm[f"{full}.{pname}"] = main
                walk(full + ".", child)
            else:
                dm[full] = main

    walk("", model)
    return dm, keep


# ----------------------------------------------------------------------------- the DeepSeek predictor


class LayerSubsetPredictor(LayerAhead):
    """A layer-ahead checkpoint of the full 26-layer DeepSeek model used on the first ``layers`` MoE layers.

    The bench model has fewer layers, other token ids and another fingerprint than the model the
    checkpoint was trained on; this adapter maps them back: the window is padded to the checkpoint's
    layer count (the layers the bench model lacks are never known before they are predicted), and the
    token ids are replaced by the traces' ones. Its ``stream()`` reads no gate inputs (the DeepSeek
    traces have none) and scores through :meth:`score_at`.
    """

    fingerprint = None

    def __init__(self, inner: Any, token_hashes: dict[int, int], layers: int) -> None:
        self.inner = inner
        self.name = inner.name
        self.needs = tuple(n for n in inner.needs if n != "gate_inputs")
        self.num_layers, self.num_experts, self.top_k = layers, inner.num_experts, inner.top_k
        self.hashes = token_hashes
        # token id -> the traces' id as one lookup table; its last entry (0) answers every other id
        self.lut = np.zeros(max(token_hashes, default=-1) + 2, np.int64)
        self.lut[list(token_hashes)] = list(token_hashes.values())
        self.layers = layers
        self.full = len(inner.moe_layers) if hasattr(inner, "moe_layers") else DS_MOE_LAYERS
        self._window: Any = None  # score_at's padded window, reused while its shape holds
        # the checkpoint's gate calibration (moecast predictors calibrate), on the layers the bench runs
        cal = getattr(inner, "calibration", None)
        self.calibration = (
            None if cal is None else replace(cal, edges=cal.edges[:layers], prob=cal.prob[:layers])
        )
        self.checkpoint_meta = getattr(inner, "checkpoint_meta", None)

    def _full(self, trace: Any, reuse: bool = False) -> Any:
        """``trace`` padded to the checkpoint's layers, with the traces' token ids. ``reuse``: into
        the window of the last call when the shapes allow (the live runtime's per-layer call, whose
        window is read at once)."""
        from dataclasses import replace

        T, L, k = trace.topk_ids.shape
        toks = self.lut[np.minimum(np.asarray(trace.token_ids, np.int64), len(self.lut) - 1)]
        out = self._window if reuse else None
        if self.full == L:  # nothing to pad: the window's own arrays, with the traces' token ids
            if (
                out is None
                or out.topk_ids is not trace.topk_ids
                or out.topk_weights is not trace.topk_weights
            ):
                out = replace(trace, token_ids=toks, gate_inputs=None)
                if reuse:
                    self._window = out
            out.token_ids = toks
            return out
        shape = (T, self.full, k)
        # a replayed trace may carry no router weights (the recorded routing's ids only)
        w_dtype = None if trace.topk_weights is None else trace.topk_weights.dtype
        if (
            out is None
            or out.topk_ids.shape != shape
            or out.topk_ids.dtype != trace.topk_ids.dtype
            or (None if out.topk_weights is None else out.topk_weights.dtype) != w_dtype
        ):
            ids = np.zeros(shape, trace.topk_ids.dtype)
            w = None if w_dtype is None else np.zeros(shape, w_dtype)
            out = replace(trace, topk_ids=ids, topk_weights=w, token_ids=toks, gate_inputs=None)
            if reuse:
                self._window = out
        out.token_ids = toks
        out.topk_ids[:, :L] = trace.topk_ids
        if w_dtype is not None:
            out.topk_weights[:, :L] = trace.topk_weights
        return out

    def warm(self) -> None:
        """The checkpoint's own :meth:`~moecast.predictors.base.LayerAhead.warm` (all its layers)."""
        if isinstance(self.inner, LayerAhead):
            self.inner.warm()

    def score_at(self, trace: Any, layer: int) -> np.ndarray:
        t = self._full(trace, reuse=True)
        if isinstance(self.inner, LayerAhead):
            return np.asarray(self.inner.score_at(t, layer))
        return self.inner.score_request(t)[-1, layer]

    def score_request(self, trace: Any) -> np.ndarray:
        return self.inner.score_request(self._full(trace))[:, : self.layers]


def ds_predictor(path: str, routing: Routing, layers: int) -> LayerSubsetPredictor:
    """The DeepSeek checkpoint at ``path`` for the bench model (token ids mapped back to the traces')."""
    from moecast.predictors.registry import load

    hashes = {int(t): int(h) for r in routing.requests for t, h in zip(r.tokens, r.token_hashes)}
    return LayerSubsetPredictor(load(path), hashes, layers)


def main() -> None:
    ap = argparse.ArgumentParser(
        description="Extract held-out DeepSeek routing into a small .npz for --traces."
    )
    ap.add_argument("--extract", default=str(DEFAULT_EXTRACT), help="the .npz to write")
    ap.add_argument("--traces", default=None, help="the CSV directory (default: the shared copy)")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--min-tokens", type=int, default=96)
    args = ap.parse_args()
    src = find_puffin(args.traces)
    if src is None:
        raise SystemExit("no DeepSeek traces found; pass --traces DIR")
    rows = held_out_requests(src, args.requests, args.min_tokens, DS_MOE_LAYERS)
    from moecast.collect.moe_beyond import token_hash

    arrays: dict[str, np.ndarray] = {"request_ids": np.array([r for r, _, _ in rows])}
    for i, (_r, texts, ids) in enumerate(rows):
        arrays[f"ids_{i}"] = ids.astype(np.int16)
        arrays[f"hash_{i}"] = np.array([token_hash(t) for t in texts], np.int64)
    out = Path(args.extract)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp.npz")
    np.savez_compressed(tmp, **arrays)
    tmp.replace(out)
    print(f"wrote {out}: {len(rows)} held-out requests")


if __name__ == "__main__":
    main()
