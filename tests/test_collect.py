"""Collection from real transformers MoE families: the recorded routing is the model's own.

Every family is a seeded, random-initialised tiny config (2 layers, 8 experts,
hidden 32) built with ``AutoConfig.for_model`` + ``AutoModelForCausalLM.from_config``.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import numpy as np
import pytest
import torch
from moecast.collect.commands import collect, merge_traces
from moecast.collect.fixtures import write_fixtures
from moecast.collect.models import ModelLoadError, find_moe_structure, model_info
from moecast.collect.recorder import RoutingRecorder
from moecast.collect.runner import Collector, GenerationSettings, default_shard, shard_requests
from moecast.collect.traceset import TraceSet, TraceSetError
from moecast.collect.workloads import WorkloadRequest

from moecast.errors import MoecastError

COMMON = dict(
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    eos_token_id=3,
    pad_token_id=0,
    bos_token_id=2,
)
MLA = dict(
    num_key_value_heads=4,
    kv_lora_rank=16,
    q_lora_rank=16,
    qk_rope_head_dim=8,
    v_head_dim=8,
    qk_nope_head_dim=8,
    first_k_dense_replace=0,
    n_shared_experts=1,
    n_routed_experts=8,
)
FAMILIES = {
    "qwen2_moe": dict(
        intermediate_size=64,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
    ),
    "qwen3_moe": dict(
        intermediate_size=64,
        moe_intermediate_size=16,
        num_experts=8,
        num_experts_per_tok=2,
        head_dim=8,
        norm_topk_prob=True,
    ),
    "mixtral": dict(intermediate_size=32, num_local_experts=8, num_experts_per_tok=2),
    "olmoe": dict(intermediate_size=32, num_experts=8, num_experts_per_tok=2),
    "deepseek_v3": dict(
        **MLA, intermediate_size=64, moe_intermediate_size=16, num_experts_per_tok=2, n_group=2, topk_group=1
    ),
    "deepseek_v2": dict(
        **MLA, intermediate_size=64, moe_intermediate_size=16, num_experts_per_tok=2, topk_method="greedy"
    ),
    "phimoe": dict(intermediate_size=32, num_local_experts=8, num_experts_per_tok=2),
}
SHARED = {"qwen2_moe": 1, "deepseek_v3": 1, "deepseek_v2": 1}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # tiny matrices: a second thread only adds synchronisation on a shared, loaded machine
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def char_tokenizer():
    """A character-level fast tokenizer (offline; ids fit the 128-token test vocabulary)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[PAD]": 0, "[UNK]": 1, "[BOS]": 2, "[EOS]": 3}
    for code in range(32, 127):
        vocab.setdefault(chr(code), len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", bos_token="[BOS]", eos_token="[EOS]"
    )


@cache
def build(family: str, seed: int = 0):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = AutoConfig.for_model(family, **{**COMMON, **FAMILIES[family]})
    model = AutoModelForCausalLM.from_config(config)
    # Routers initialised at zero tie every expert; spread them so top-k is well defined.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 1 and not name.endswith("bias") and p.abs().sum() == 0:
                p.normal_(0, 0.5)
    return model.eval()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Save a family's tiny model + tokenizer as a local HF directory (what --model PATH gets)."""
    root = tmp_path_factory.mktemp("models")

    def make(family: str) -> Path:
        path = root / family
        if not path.exists():
            build(family).save_pretrained(path)
            char_tokenizer().save_pretrained(path)
        return path

    return make


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    return write_fixtures(tmp_path_factory.mktemp("data"), rows=12)


def _router_outputs(structure):
    got: dict[int, tuple] = {}
    hooks = [
        e.router.register_forward_hook(lambda m, a, o, i=i: got.__setitem__(i, o))
        for i, e in enumerate(structure.layers)
    ]
    return got, hooks


@pytest.mark.parametrize("family", list(FAMILIES))
def test_recorded_routing_is_the_models_own(family):
    model = build(family)
    structure = find_moe_structure(model)
    info = model_info(model, structure, family)
    assert info.moe_layers == [0, 1] and info.num_experts == 8 and info.top_k == 2
    assert info.num_shared_experts == SHARED.get(family, 0)
    assert info.expert_bytes == sum(p.numel() * 4 for p in structure.layers[0].experts.parameters()) // 8
    x = torch.randint(4, 99, (2, 9), generator=torch.Generator().manual_seed(1))
    previous = model.config._experts_implementation
    with torch.no_grad():
        before = model(x).logits
    got, hooks = _router_outputs(structure)
    recorder = RoutingRecorder(structure, info.top_k, router_probs=True, gate_inputs=True).attach(model)
    try:
        with torch.no_grad():
            during = model(x).logits
        routing = recorder.take()
    finally:
        recorder.detach()
        for h in hooks:
            h.remove()
    with torch.no_grad():
        after = model(x).logits
    # the model computed exactly what the wrapped implementation computes, before and after
    assert model.config._experts_implementation == previous
    assert torch.equal(before, during) and torch.equal(before, after)
    # ids and weights are the router's own output (captured independently by a hook on the router)
    for pos in range(2):
        logits, weights, ids = got[pos]
        assert torch.equal(routing.topk_ids[:, pos], ids)
        assert torch.equal(routing.topk_weights[:, pos], weights.float())
        if structure.router_probs_kind == "softmax":
            expected = torch.softmax(logits.float(), -1)
        else:
            expected = torch.sigmoid(logits.float())
            expected = expected / expected.sum(-1, keepdim=True)
        torch.testing.assert_close(routing.router_probs[:, pos], expected)
    assert routing.gate_inputs.shape == (18, 2, 32)
    assert (structure.router_probs_kind == "sigmoid-normalised") == (family == "deepseek_v3")


def test_router_pattern_matches_experts_interface():
    model = build("qwen2_moe")
    x = torch.randint(4, 99, (1, 11), generator=torch.Generator().manual_seed(2))
    routed = {}
    for pattern in (None, r"mlp\.gate$"):
        structure = find_moe_structure(model, pattern)
        with RoutingRecorder(structure, 2, router_probs=True).attach(model) as rec, torch.no_grad():
            model(x)
            routed[pattern] = rec.take()
    a, b = routed[None], routed[r"mlp\.gate$"]
    assert torch.equal(a.topk_ids, b.topk_ids)
    torch.testing.assert_close(a.topk_weights, b.topk_weights)
    # the same model described the same way (same fingerprint) whichever way it is traced
    assert model_info(model, find_moe_structure(model, r"mlp\.gate$"), "m") == model_info(
        model, find_moe_structure(model), "m"
    )
    structure = find_moe_structure(model)
    with RoutingRecorder(structure, 2).attach(model):
        with pytest.raises(MoecastError, match="already being recorded"):
            RoutingRecorder(structure, 2).attach(model)
        with pytest.raises(MoecastError, match="did not route"):
            RoutingRecorder(structure, 2).take()
    assert model.config._experts_implementation != "moecast_record"
    with pytest.raises(ModelLoadError, match="matches no module"):
        find_moe_structure(model, r"no_such_router")


def test_dense_model_is_rejected():
    from transformers import AutoConfig, AutoModelForCausalLM

    dense = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen2", **COMMON, intermediate_size=64))
    with pytest.raises(ModelLoadError, match="not an MoE model"):
        find_moe_structure(dense)


def _collector(family="qwen2_moe", max_new_tokens=6, batch_size=4):
    model = build(family)
    structure = find_moe_structure(model)
    info = model_info(model, structure, family)
    rec = RoutingRecorder(structure, info.top_k, router_probs=True, gate_inputs=True).attach(model)
    return Collector(
        model, char_tokenizer(), rec, GenerationSettings(max_new_tokens=max_new_tokens, batch_size=batch_size)
    )


def test_batched_with_padding_equals_alone():
    col = _collector()
    try:
        reqs = [
            WorkloadRequest(f"r{i}", "w", "chat", p)
            for i, p in enumerate(
                ["a short one", "a considerably longer prompt than the others", "mid length text"]
            )
        ]
        batched = col.run_batch(reqs)
        alone = [col.run_batch([r])[0] for r in reqs]
    finally:
        col.recorder.detach()
    tok = char_tokenizer()
    for req, b, a in zip(reqs, batched, alone):
        prompt_len = len(tok(req.prompt)["input_ids"])
        # no padded position recorded: exactly the prompt's tokens, then the generated ones
        assert b.num_prompt_tokens == prompt_len
        assert list(b.token_ids[:prompt_len]) == tok(req.prompt)["input_ids"]
        assert 0 < b.num_generated_tokens <= 6
        assert b.topk_ids.shape == (len(b.token_ids), 2, 2) and b.gate_inputs.shape == (
            len(b.token_ids),
            2,
            32,
        )
        np.testing.assert_array_equal(b.token_ids, a.token_ids)
        np.testing.assert_array_equal(b.topk_ids, a.topk_ids)
        np.testing.assert_allclose(
            b.topk_weights.astype(np.float32), a.topk_weights.astype(np.float32), atol=2e-3
        )
        np.testing.assert_allclose(
            b.router_probs.astype(np.float32), a.router_probs.astype(np.float32), atol=2e-3
        )
        assert b.output_text == a.output_text


def test_decode_records_match_a_full_forward():
    """Routing recorded step by step with the KV cache equals one forward over the whole sequence."""
    col = _collector(max_new_tokens=5, batch_size=1)
    try:
        rec = col.run_batch([WorkloadRequest("r", "w", "chat", "hello there")])[0]
        with torch.no_grad():
            col.model(torch.tensor(rec.token_ids)[None])
        full = col.recorder.take()
    finally:
        col.recorder.detach()
    np.testing.assert_array_equal(rec.topk_ids, full.topk_ids.numpy().astype(np.int16))
    assert rec.phases.sum() == rec.num_generated_tokens == len(rec.token_ids) - len("hello there")


def test_chat_template_wraps_prompts():
    col = _collector(max_new_tokens=1, batch_size=1)
    try:
        col.settings.chat_template = True
        with pytest.raises(ValueError, match="no chat template"):
            col.encode(["hi"])
        col.tokenizer.chat_template = "{% for m in messages %}<{{ m['content'] }}>{% endfor %}"
        rec = col.run_batch([WorkloadRequest("r", "w", "chat", "hi")])[0]
    finally:
        col.recorder.detach()
    assert rec.token_texts[: rec.num_prompt_tokens] == ["<", "h", "i", ">"]


def test_collect_writes_resumes_and_scores(saved, data_dir, tmp_path):
    model = saved("qwen2_moe")
    out = tmp_path / "traces"
    collect(
        model=str(model),
        workloads="gsm8k",
        out=str(out),
        max_requests=4,
        max_new_tokens=4,
        batch_size=2,
        chunk_size=2,
        data_dir=str(data_dir),
        progress=False,
    )
    first = {p.name: p.read_bytes() for p in (out / "tokens").glob("part-*.arrow")}
    assert len(first) == 2  # two chunks of two requests
    collect(
        model=str(model),
        workloads="gsm8k",
        out=str(out),
        max_requests=8,
        max_new_tokens=4,
        batch_size=2,
        chunk_size=2,
        data_dir=str(data_dir),
        progress=False,
    )
    ts = TraceSet(out)
    assert sorted(ts.request_ids) == [f"gsm8k-{i:06d}" for i in range(8)]
    # the first four were not recomputed: their parts are untouched and no new part holds them
    for name, blob in first.items():
        assert (out / "tokens" / name).read_bytes() == blob
    assert len(list((out / "requests").glob("part-*.arrow"))) == 4
    meta = json.loads((out / "meta.json").read_text())
    assert meta["collection"]["workloads"] == ["gsm8k"]
    assert meta["collection"]["router_probs_kind"] == "softmax"
    assert meta["collection"]["generation"]["max_new_tokens"] == 4
    assert meta["fields"] == {"topk_weights": True, "router_probs": True, "gate_inputs": False}
    assert ts.model.family == "qwen2_moe" and ts.model.num_shared_experts == 1
    info = ts.request_info("gsm8k-000000")
    answer = json.loads((data_dir / "gsm8k.jsonl").read_text().splitlines()[0])["answer"]
    assert info["reference"] == answer.split("####")[1].strip()
    assert info["num_generated_tokens"] <= 4
    trace = ts.get("gsm8k-000003")
    assert trace.topk_ids.shape[1:] == (2, 2) and trace.router_probs.shape[1:] == (2, 8)
    np.testing.assert_allclose(trace.router_probs.astype(np.float32).sum(-1), 1.0, atol=1e-2)
    # resuming with other generation settings would mix two kinds of tokens under one meta.json
    with pytest.raises(TraceSetError, match=r"collected with other settings \(max_new_tokens 4 -> 2\)"):
        collect(model=str(model), workloads="gsm8k", out=str(out), max_requests=9, max_new_tokens=2,
                batch_size=2, chunk_size=2, data_dir=str(data_dir), progress=False)  # fmt: skip
    assert TraceSet(out).num_requests == 8
    # a damaged part: the error's advice (delete both files of the part, re-run) collects it again
    name = sorted(p.name for p in (out / "tokens").glob("part-*.arrow"))[1]
    blob = (out / "tokens" / name).read_bytes()
    (out / "tokens" / name).write_bytes(blob[: len(blob) // 2])
    with pytest.raises(TraceSetError, match=f"delete requests/{name} and tokens/{name}, then re-run") as exc:
        TraceSet(out)
    assert "\n" not in str(exc.value)
    (out / "tokens" / name).unlink()
    (out / "requests" / name).unlink()
    collect(model=str(model), workloads="gsm8k", out=str(out), max_requests=8, max_new_tokens=4,
            batch_size=2, chunk_size=2, data_dir=str(data_dir), progress=False)  # fmt: skip
    assert sorted(TraceSet(out).request_ids) == [f"gsm8k-{i:06d}" for i in range(8)]


def test_shards_and_merge_equal_one_run(saved, data_dir, tmp_path):
    model = saved("mixtral")
    kw = dict(
        model=str(model),
        workloads=["boolq", "wic"],
        max_requests=3,
        max_new_tokens=3,
        batch_size=2,
        data_dir=str(data_dir),
        progress=False,
    )
    collect(out=str(tmp_path / "one"), **kw)
    for i in range(2):
        collect(out=str(tmp_path / f"s{i}"), num_shards=2, shard_index=i, **kw)
    shard_ids = [set(TraceSet(tmp_path / f"s{i}").request_ids) for i in range(2)]
    assert shard_ids[0] and shard_ids[1] and not shard_ids[0] & shard_ids[1]
    from moecast.cli import main

    # `moecast traces merge A B --out C`, as users type it
    main(["traces", "merge", str(tmp_path / "s0"), str(tmp_path / "s1"), "--out", str(tmp_path / "merged")])
    one, merged = TraceSet(tmp_path / "one"), TraceSet(tmp_path / "merged")
    # Mixtral's config has no norm_topk_prob; its weights are renormalised top-k, found by probing
    assert one.model.norm_topk_prob is True and one.model.family == "mixtral"
    assert sorted(one.request_ids) == sorted(merged.request_ids) and one.num_requests == 6
    for rid in one.request_ids:
        np.testing.assert_array_equal(one.get(rid).topk_ids, merged.get(rid).topk_ids)
        np.testing.assert_array_equal(one.get(rid).token_ids, merged.get(rid).token_ids)
    # shards may also share one directory: shard 1 written beside shard 0 reads back as the whole set
    collect(out=str(tmp_path / "s0"), num_shards=2, shard_index=1, **kw)
    assert sorted(TraceSet(tmp_path / "s0").request_ids) == sorted(one.request_ids)
    assert {p.name[:9] for p in (tmp_path / "s0" / "requests").glob("part-*")} == {"part-s000", "part-s001"}


def test_shards_default_to_torchrun_env(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    assert default_shard() == (4, 3)
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.delenv("RANK")
    assert default_shard() == (1, 0)


def test_shard_split_is_a_partition():
    reqs = [WorkloadRequest(f"r{i}", "w", "chat", "p") for i in range(7)]
    parts = [shard_requests(reqs, 3, i) for i in range(3)]
    assert sorted(r.request_id for p in parts for r in p) == sorted(r.request_id for r in reqs)
    with pytest.raises(ValueError, match="shard-index"):
        shard_requests(reqs, 2, 2)


def _cli_error(args, capsys) -> str:
    from moecast.cli import main

    with pytest.raises(SystemExit) as exc:
        main(args)
    msg = str(exc.value.code)
    assert msg.startswith("moecast: error: ") and "\n" not in msg, msg
    assert "Traceback" not in capsys.readouterr().err
    return msg


def test_bad_inputs_are_one_line_errors(saved, data_dir, tmp_path, capsys):
    from transformers import AutoConfig, AutoModelForCausalLM

    model = str(saved("qwen2_moe"))
    out = tmp_path / "out"
    base = [
        "collect",
        "--model",
        model,
        "--data-dir",
        str(data_dir),
        "--max-new-tokens",
        "2",
        "--progress",
        "false",
    ]
    collect(
        model=model,
        workloads="boolq",
        out=str(out),
        max_requests=2,
        max_new_tokens=2,
        data_dir=str(data_dir),
        progress=False,
    )
    before = sorted(p.name for p in (out / "requests").iterdir())

    dense = tmp_path / "dense"
    AutoModelForCausalLM.from_config(
        AutoConfig.for_model("qwen2", **COMMON, intermediate_size=64)
    ).save_pretrained(dense)
    char_tokenizer().save_pretrained(dense)
    assert "not an MoE model" in _cli_error(
        [*base[:2], str(dense), *base[3:], "--workloads", "boolq", "--out", str(tmp_path / "d")], capsys
    )
    not_model = tmp_path / "empty_dir"
    not_model.mkdir()
    assert "not a Hugging Face model directory" in _cli_error(
        [*base[:2], str(not_model), *base[3:], "--workloads", "boolq", "--out", str(tmp_path / "e")], capsys
    )
    assert "--workloads is empty" in _cli_error([*base, "--workloads", " ", "--out", str(out)], capsys)
    msg = _cli_error(
        [*base, "--workloads", "triviaqa", "--data-dir", str(tmp_path), "--out", str(out)], capsys
    )
    assert "triviaqa" in msg and "--data-dir" in msg
    assert "--max-requests" in _cli_error(
        [*base, "--workloads", "boolq", "--max-requests", "0", "--out", str(out)], capsys
    )
    assert "unknown workload" in _cli_error([*base, "--workloads", "nosuch", "--out", str(out)], capsys)
    # another model into the existing --out is refused and what was there survives
    msg = _cli_error(
        [
            *base[:2],
            str(saved("olmoe")),
            *base[3:],
            "--workloads",
            "boolq",
            "--max-requests",
            "2",
            "--out",
            str(out),
        ],
        capsys,
    )
    assert "choose another --out" in msg
    assert sorted(p.name for p in (out / "requests").iterdir()) == before
    assert TraceSet(out).num_requests == 2
    with pytest.raises(ValueError, match="max-requests"):
        collect(model=model, workloads="boolq", out=str(out), max_requests=-1, data_dir=str(data_dir))


def test_merge_refuses_another_model(tmp_path):
    from conftest import make_synthetic_traceset

    make_synthetic_traceset(tmp_path / "a", num_experts=8)
    make_synthetic_traceset(tmp_path / "b", num_experts=16)
    with pytest.raises(TraceSetError, match="fingerprint"):
        merge_traces([str(tmp_path / "a"), str(tmp_path / "b")], out=str(tmp_path / "m"))
    with pytest.raises(TraceSetError, match="also a source"):
        merge_traces([str(tmp_path / "a")], out=str(tmp_path / "a"))
    from moecast.cli import main

    main(["traces", "merge", str(tmp_path / "a"), "--out", str(tmp_path / "m2")])
    with pytest.raises(TraceSetError, match="choose another --out"):
        merge_traces([str(tmp_path / "b")], out=str(tmp_path / "m2"))
    assert TraceSet(tmp_path / "m2").num_requests == TraceSet(tmp_path / "a").num_requests


def test_fingerprint_tells_models_apart():
    a, b = build("qwen2_moe"), build("qwen3_moe")
    fa = model_info(a, find_moe_structure(a), "a").fingerprint
    fb = model_info(b, find_moe_structure(b), "b").fingerprint
    assert fa != fb
    # the same model under another name/path keeps its fingerprint
    assert model_info(a, find_moe_structure(a), "elsewhere").fingerprint == fa
    # and in another dtype (traces collected in bfloat16 serve a float32 load), while the expert
    # size the cost model reads stays the loaded one
    import copy

    import torch

    a16, a32 = copy.deepcopy(a).to(torch.bfloat16), a  # build() is cached: convert a copy
    i16, i32 = model_info(a16, find_moe_structure(a16), "a"), model_info(a32, find_moe_structure(a32), "a")
    assert i16.fingerprint == i32.fingerprint == fa and i16.expert_bytes * 2 == i32.expert_bytes


def test_the_kv_cache_goes_by_the_name_the_models_forward_takes():
    """transformers 5.2x names the cache ``cache`` (the old name warns, then goes); earlier 5.x only
    ``past_key_values``: the keyword follows the forward's signature, the output's key what it holds."""
    import warnings

    from conftest import tiny_random
    from moecast.collect.models import kv_cache, with_cache
    from transformers.utils import ModelOutput

    class Old:
        def forward(self, input_ids=None, past_key_values=None, use_cache=None): ...

    class New:
        def forward(self, input_ids=None, cache=None, use_cache=None): ...

    assert with_cache(Old(), "c") == {"past_key_values": "c"} and with_cache(New(), "c") == {"cache": "c"}
    assert kv_cache(ModelOutput(past_key_values="kv")) == "kv" and kv_cache(ModelOutput(cache="kv")) == "kv"
    assert kv_cache(ModelOutput(logits=1)) is None
    model = tiny_random()
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # no deprecated keyword on this transformers
        out = model(input_ids=torch.tensor([[1, 2]]), use_cache=True)
        step = model(input_ids=torch.tensor([[3]]), **with_cache(model, kv_cache(out)), use_cache=True)
    assert kv_cache(step).get_seq_length() == 3  # the cache was taken: the step continued it
