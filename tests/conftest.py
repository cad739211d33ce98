"""Shared fixtures: small synthetic TraceSets and the real DeepSeek traces from ../shared when present."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

SHARED = Path(__file__).resolve().parents[2] / "shared"
PUFFIN = SHARED / "traces" / "deepseek-v2-lite-puffin"


@pytest.fixture(scope="session", autouse=True)
def _isolated_outputs(tmp_path_factory):
    # wandb, Lightning and the tiny-model cache must never write into the checkout or $HOME;
    # the widest pytest scope, so that module- and run-wide fixtures (which run before any
    # function-scoped one) see the isolated folders too
    root = tmp_path_factory.getbasetemp()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WANDB_DIR", str(root / "wandb"))
        mp.setenv("WANDB_MODE", "offline")
        # wandb parses every installed package's metadata into each run's requirements (0.15-0.3 s a
        # run; the demo alone makes dozens); no test reads that list
        mp.setenv("WANDB__SAVE_REQUIREMENTS", "false")
        mp.setenv("MOECAST_HOME", os.environ.get("MOECAST_TEST_HOME", str(root / "moecast_home")))
        yield


@pytest.fixture
def puffin_dir() -> Path:
    if not PUFFIN.is_dir():
        pytest.skip("../shared/traces (real DeepSeek traces) not present in this checkout")
    return PUFFIN


def synthetic_writer(
    path: Path,
    *,
    num_layers: int,
    num_experts: int,
    top_k: int,
    hidden: int = 16,
    with_optional: bool = True,
    name: str = "synthetic",
):
    """A TraceWriter for a synthetic model (the optional per-layer fields present or not)."""
    from moecast.collect.traceset import ModelInfo, TraceMeta, TraceWriter

    info = ModelInfo(
        name_or_path=name,
        family="synthetic",
        moe_layers=list(range(1, num_layers + 1)),
        num_experts=num_experts,
        top_k=top_k,
        num_shared_experts=0,
        hidden_size=hidden,
        expert_bytes=3 * hidden * 32 * 2,
        norm_topk_prob=True,
    )
    fields = {"topk_weights": with_optional, "router_probs": with_optional, "gate_inputs": with_optional}
    return TraceWriter(path, TraceMeta(model=info, collection={"source": "synthetic"}, fields=fields))


def synthetic_record(
    r: int, token_ids: np.ndarray, topk_ids: np.ndarray, phases: np.ndarray | None = None, **optional
):
    """Request ``r`` of a synthetic TraceSet: its token ids and [T, L, k] routes (prefill unless
    ``phases`` says otherwise), plus any optional per-layer field (topk_weights, ...)."""
    from moecast.collect.traceset import RequestRecord

    T = len(token_ids)
    return RequestRecord(
        request_id=f"req-{r}",
        workload="synthetic",
        category="chat",
        prompt=f"prompt {r}",
        token_ids=token_ids,
        token_texts=[f"t{i}" for i in range(T)],
        phases=np.zeros(T, bool) if phases is None else phases,
        topk_ids=topk_ids.astype(np.int16),
        **optional,
    )


def make_synthetic_traceset(
    path: Path,
    *,
    num_requests: int = 6,
    num_layers: int = 3,
    num_experts: int = 8,
    top_k: int = 2,
    hidden: int = 16,
    tokens: int = 12,
    seed: int = 0,
    with_optional: bool = True,
    decode_from: int | None = None,
):
    """A small TraceSet with structured routing (each layer's choice depends on the previous layer);
    each request's tokens from ``decode_from`` on (default: its second half) are decode steps."""
    rng = np.random.default_rng(seed)
    writer = synthetic_writer(
        path,
        num_layers=num_layers,
        num_experts=num_experts,
        top_k=top_k,
        hidden=hidden,
        with_optional=with_optional,
    )
    W = rng.normal(size=(num_layers, hidden, num_experts))
    records = []
    for r in range(num_requests):
        T = tokens
        x = rng.normal(size=(T, hidden))
        logits = np.einsum("th,lhe->tle", x, W) + rng.normal(scale=0.1, size=(T, num_layers, num_experts))
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        ids = np.argsort(-probs, axis=-1)[..., :top_k]
        w = np.take_along_axis(probs, ids, -1)
        w /= w.sum(-1, keepdims=True)
        phases = np.zeros(T, dtype=bool)
        phases[T // 2 if decode_from is None else decode_from :] = True
        records.append(
            synthetic_record(
                r,
                rng.integers(0, 100, size=T),
                ids,
                phases,
                topk_weights=w.astype(np.float16) if with_optional else None,
                router_probs=probs.astype(np.float16) if with_optional else None,
                gate_inputs=np.repeat(x[:, None, :], num_layers, 1).astype(np.float16)
                if with_optional
                else None,
            )
        )
    half = len(records) // 2
    writer.write(records[:half])
    writer.write(records[half:])
    return path


@pytest.fixture
def synthetic_traces(tmp_path) -> Path:
    return make_synthetic_traceset(tmp_path / "synthetic")


@pytest.fixture(scope="session")
def tiny_encoder(tmp_path_factory) -> Path:
    """A 2-layer, 32-wide BERT with MiniLM's tokenizer: trains in seconds."""
    from moecast.predictors.sentence_encoder import resolve_encoder_path
    from transformers import AutoTokenizer, BertConfig, BertModel

    out = tmp_path_factory.mktemp("tiny-encoder")
    tok = AutoTokenizer.from_pretrained(str(resolve_encoder_path("minilm")))
    cfg = BertConfig(
        vocab_size=tok.vocab_size,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=512,
    )
    import torch

    torch.manual_seed(0)
    BertModel(cfg).save_pretrained(str(out))
    tok.save_pretrained(str(out))
    return out


def collect_gate_traces(model_dir: Path, root: Path, requests: int, max_new_tokens: int) -> Path:
    """A TraceSet with gate inputs of ``model_dir`` on ``requests`` small local gsm8k-style prompts
    (offline: the workload file is written under ``root``)."""
    import json

    from moecast.collect.commands import collect

    data = root / "data"
    data.mkdir(parents=True, exist_ok=True)
    rows = [
        {"question": f"question {i}: how many apples are {i} plus {i + 3}?", "answer": "#### 1"}
        for i in range(requests)
    ]
    (data / "gsm8k.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return collect(
        model=str(model_dir),
        workloads="gsm8k",
        data_dir=str(data),
        out=str(root / "ts"),
        max_new_tokens=max_new_tokens,
        gate_inputs=True,
        progress=False,
    )


def quiet_trainer(max_epochs: int, **kw):
    """A CPU Lightning trainer for tests: no logger, checkpoints, progress bar or model summary."""
    import lightning.pytorch as pl

    quiet = dict(
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False
    )
    return pl.Trainer(max_epochs=max_epochs, accelerator="cpu", **{**quiet, **kw})


class _Vocab:
    """What collect.tiny.model_config reads of a tokenizer: its size and special ids."""

    bos_token_id = eos_token_id = pad_token_id = None

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size


def tiny_random():
    """``tiny``'s architecture (configs/tiny.yaml, default preset) with random weights."""
    import torch
    from moecast.collect.tiny import get_preset, model_config
    from transformers import Qwen2MoeForCausalLM

    preset = get_preset("default")
    torch.manual_seed(0)
    return Qwen2MoeForCausalLM(model_config(preset, _Vocab(preset.vocab_size))).eval()


# --------------------------------------------------------- the live == replay tests' model and windows
# (here, not in their module, so that a new tier's or policy's copy of those tests finds them)


def _written(tmp_path_factory, prof) -> Path:
    """The profile as a YAML file named after it (the runtimes take a profile's path)."""
    path = tmp_path_factory.mktemp("hw") / f"{prof.name}.yaml"
    path.write_text(prof.to_yaml())
    return path


@pytest.fixture(scope="module")
def tiny():
    """configs/tiny.yaml's architecture with random weights (float32)."""
    return tiny_random()


@pytest.fixture(scope="module")
def profile(tiny, tmp_path_factory):
    """A profile whose prefetch windows are tight: one transfer 0.3 ms, attention 0.35 ms, the predictor
    0.2 ms, so some prefetches land and some do not."""
    from moecast.collect.models import find_moe_structure, model_info
    from moecast.runtime.core.cost_model import HardwareProfile

    expert_bytes = model_info(tiny, find_moe_structure(tiny), "tiny").expert_bytes
    prof = HardwareProfile(
        name="tight-window",
        transfer_gbps=expert_bytes / 0.3e6,  # one expert in 0.3 ms
        ref_expert_bytes=expert_bytes,
        gpu_expert_ms=0.05,
        cpu_beta_ms=0.05,
        cpu_c_ms=0.3,
        attn_ms=0.35,
        predictor_ms=0.2,
    )
    return _written(tmp_path_factory, prof)


@pytest.fixture(scope="module")
def cpu_disk_profile(profile, tmp_path_factory):
    """The same window on a machine without an accelerator, its experts on a disk: every read takes
    0.1 ms from the cores (the prefetches' from the attention, the demand loads' from the experts),
    and 0.4 ms after the last layer of each step."""
    import dataclasses

    from moecast.runtime.core.cost_model import load_profile

    prof = dataclasses.replace(
        load_profile(profile),
        name="cpu-disk",
        fast_tier="cpu",
        slow_tier="disk",
        read_cpu_ms=0.1,
        step_ms=0.4,
    )
    return _written(tmp_path_factory, prof)


@pytest.fixture(scope="module")
def issuing_profile(profile, tmp_path_factory):
    """The same window on an accelerator whose host takes 0.08 ms to issue each copy (load_host_ms)."""
    import dataclasses

    from moecast.runtime.core.cost_model import load_profile

    prof = dataclasses.replace(load_profile(profile), name="tight-window-issue", load_host_ms=0.08)
    return _written(tmp_path_factory, prof)


@pytest.fixture(scope="module")
def cheap_cpu_profile(profile, tmp_path_factory):
    """The same window with a CPU expert (0.2 + 0.05 ms a token) cheaper than a load (0.3 ms), for
    PreSched: it then runs misses on the CPU and asks for more prefetches than land. On the window
    above (0.35 ms a CPU expert) its Eq. 5 split loads nearly every miss and every prefetch lands."""
    import dataclasses

    from moecast.runtime.core.cost_model import load_profile

    prof = dataclasses.replace(load_profile(profile), name="tight-window-cheap-cpu", cpu_c_ms=0.2)
    return _written(tmp_path_factory, prof)
