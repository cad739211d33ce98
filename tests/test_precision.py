"""Expert precision: the int8 / int4 formats by hand, the int4 packing read back, the kernels against the
formats' own arithmetic, and the disk tier computing on quantized experts as a model with those weights."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
import torch
from conftest import make_synthetic_traceset
from moecast.collect.models import find_moe_structure
from moecast.runtime.live.runtime import attach
from moecast.runtime.tiers import offload
from moecast.runtime.tiers import precision as P
from moecast.runtime.tiers.expert_store import expert_params
from test_live import decode_logits, make_model

from moecast.errors import InputError

torch.set_num_threads(1)


def test_int8_is_per_row_absmax_over_127_rounded_to_nearest():
    w = torch.tensor([[1.0, -2.0, 0.5, 0.0], [0.0, 0.0, 0.0, 0.0], [0.3, 0.1, -0.1, 0.0]])
    parts = P.quantize_int8(w)
    # row 0: s = 2 / 127; w / s = 63.5, -127, 31.75, 0 -> round half to even 64 (63.5 -> 64), -127, 32, 0
    assert parts["s"][0].item() == pytest.approx(2 / 127)
    assert parts["q"][0].tolist() == [64, -127, 32, 0]
    # an all-zero row keeps q = 0 (its scale is a placeholder 1, never a division by 0)
    assert parts["q"][1].tolist() == [0, 0, 0, 0] and parts["s"][1].item() == 1.0
    # row 2: s = 0.3 / 127; 0.1 / s = 42.33 -> 42
    assert parts["q"][2].tolist() == [127, 42, -42, 0]
    back = P.dequantize_matrix(P.Precision("int8"), parts, 4)
    assert back[0].tolist() == pytest.approx([64 * 2 / 127, -2.0, 32 * 2 / 127, 0.0])


def test_int4_is_groupwise_min_max_over_15():
    # one row of 64: group 0 holds 0..31 (min 0, max 31), group 1 a constant 5
    w = torch.cat([torch.arange(32.0), torch.full((32,), 5.0)])[None].repeat(16, 1)
    q, s, lo = P.int4_codes(w, 32)
    assert s[0].tolist() == pytest.approx([31 / 15, 1.0]) and lo[0].tolist() == [0.0, 5.0]
    # 16 / (31 / 15) = 7.74 -> 8; 31 -> 15; a constant group codes 0 and comes back exactly
    assert q[0, 16].item() == 8 and q[0, 31].item() == 15 and q[0, 0].item() == 0
    assert (q[0, 32:] == 0).all()
    prec = P.Precision("int4", 32)
    back = P.dequantize_matrix(prec, P.quantize_matrix(prec, w), 64)
    assert back[0, 16].item() == pytest.approx(8 * 31 / 15, rel=1e-6)
    assert (back[:, 32:] == 5.0).all()
    # round to nearest: no weight moves by more than half a step
    assert ((back[:, :32] - w[:, :32]).abs() <= 31 / 15 / 2 + 1e-5).all()


@pytest.mark.parametrize("shape", [(16, 32), (32, 64), (48, 256)])
def test_int4_packing_is_read_back_from_the_kernels_own_layout(shape):
    codes = torch.randint(0, 16, shape, dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    packed = P.pack_int4(codes)
    assert packed.dtype == torch.uint8 and packed.shape == (shape[0], shape[1] // 2)
    assert torch.equal(P.unpack_int4(packed, shape[1]), codes)


@pytest.mark.parametrize("prec", [P.Precision("int8"), P.Precision("int4", 32), P.Precision("int4", 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_weight_only_kernels_compute_the_formats_arithmetic(prec, dtype):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(32, 128, generator=g).to(dtype)
    x = torch.randn(3, 128, generator=g).to(dtype)
    parts = P.quantize_matrix(prec, w)
    assert P.kernel_ok(prec, x, 32, 128)
    got = P.qlinear(prec, x, parts, 128).float()
    ref = x.float() @ P.dequantize_matrix(prec, parts, 128).float().t()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert ((got - ref).norm() / ref.norm()).item() < tol


def test_a_shape_no_kernel_takes_is_dequantized_and_says_so():
    prec = P.Precision("int4", 128)
    w = torch.randn(32, 16)  # 16 inputs: one group of 16, which the int4 kernel refuses
    parts = P.quantize_matrix(prec, w)
    assert P.kernel_ok(prec, torch.zeros(1, 16), 32, 16) is False
    x = torch.randn(2, 16)
    P._NOTED.clear()
    with pytest.warns(P.PrecisionWarning, match=r"int4-g128 experts of shape \[32, 16\].*dequantizes"):
        got = P.qlinear(prec, x, parts, 16)
    assert torch.allclose(got, x @ P.dequantize_matrix(prec, parts, 16).t(), atol=1e-6)


@pytest.mark.parametrize("prec", [P.Precision("int8"), P.Precision("int4", 32)])
def test_a_float64_model_is_dequantized_and_says_so(tmp_path, prec):
    """The weight-only kernels take float32, bfloat16 and float16 activations only: a float64 model's
    quantized experts are dequantized per call, with one line (they raised mid-generate), and the
    run is still the quantized model's."""
    x = torch.randn(2, 128, dtype=torch.float64)
    assert not P.kernel_ok(prec, x, 32, 128) and P.kernel_ok(prec, x.float(), 32, 128)

    def float64_model():  # transformers' grouped_mm takes no float64: its class's own loop does
        model = make_model("qwen2_moe").double()
        model.set_experts_implementation("eager")
        return model

    model = float64_model()
    ids = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(3))
    exact = decode_logits(model, ids)
    with P.experts_at(float64_model(), prec) as ref_model:
        ref = decode_logits(ref_model, ids)
    P._NOTED.clear()
    rt = attach(model, policy="lru", capacity=0.25, prefetch="none", offload="disk", offload_dir=str(tmp_path),
                expert_dtype=prec.dtype, group_size=prec.group_size)  # fmt: skip
    try:
        with pytest.warns(
            P.PrecisionWarning, match=rf"{prec.tag} experts of shape .* in float64: no weight-only"
        ):
            got = decode_logits(model, ids)
    finally:
        rt.detach()
    # the quantized model's logits (the weights dequantized through float32), not the exact one's
    to_ref, to_exact = (got - ref).abs().max().item(), (got - exact).abs().max().item()
    assert to_ref < to_exact / 20, (to_ref, to_exact)


def test_group_size_per_channel_where_it_does_not_divide_and_refused_where_no_kernel_has_it():
    assert P.Precision("int4", 128).group_for(256) == 128
    P._GROUP_NOTED.clear()
    with pytest.warns(
        P.PrecisionWarning, match="group size 128 does not divide a matrix of 96 inputs.*per output"
    ):
        assert P.Precision("int4", 128).group_for(96) == 96  # per output channel, and said
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert P.Precision("int4", 128).group_for(96) == 96  # said once per shape
    with pytest.raises(InputError, match="int4 group size 48 is not one of 32, 64, 128, 256"):
        P.Precision("int4", 48)
    with pytest.raises(InputError, match="unknown expert dtype 'int3'"):
        P.Precision("int3")


def test_an_expert_dtype_by_its_tag_and_every_form_named_when_it_is_unknown():
    assert P.expert_setting("int4-g64") == P.Precision("int4", 64)  # a results row's tag, typed back in
    assert P.expert_setting("int4-g64", 32) == P.Precision("int4", 64)  # the tag's group wins
    assert P.expert_setting("int4", 32) == P.Precision("int4", 32)
    assert isinstance(P.expert_setting("mixed"), P.TwoCopies)
    with pytest.raises(InputError, match=r"unknown expert dtype 'fp8'.*int4-gN.*mixed or high\+low"):
        P.expert_setting("fp8")
    with pytest.raises(InputError, match="int4 group size 48"):
        P.expert_setting("int4-g48")


def test_run_and_compare_refuse_a_bad_precision_before_loading_or_writing_anything(tmp_path):
    from moecast.cli import run

    od = tmp_path / "od"
    with pytest.raises(InputError, match="unknown expert dtype 'fp8'"):  # not the missing model
        run(["run", "--model", str(tmp_path / "no-model"), "--offload", "disk", "--offload-dir", str(od),
             "--expert-dtype", "fp8"])  # fmt: skip
    assert not od.exists()
    traces = make_synthetic_traceset(tmp_path / "s", num_experts=8, top_k=2)
    out = tmp_path / "cmp"
    with pytest.raises(InputError, match="unknown expert dtype 'bogus'"):  # before the first replay
        run(["compare", "--traces", str(traces), "--expert-dtypes", "model", "int4", "bogus", "--out", str(out),
             "--wandb", "false", "--capacities", "4"])  # fmt: skip
    assert not out.exists()


def test_relative_error_orders_the_precisions():
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(2))
    e8, e4 = P.relative_error(w, P.Precision("int8")), P.relative_error(w, P.Precision("int4", 32))
    assert P.relative_error(w, P.Precision()) == 0.0
    # int8's step is max|w| / 127 per row, int4's (max - min) / 15 per group of 32: about 8x coarser
    assert 0 < e8 < 0.01 < e4 < 0.1


def test_relative_error_by_hand():
    """w = [[3, 4]] at int8: scale 4 / 127, q = round(3 * 127 / 4) = 95 and 127, so w' = [380 / 127, 4];
    ||w - w'|| / ||w|| = (3 - 380 / 127) / 5 (a max-abs or unnormalised figure differs)."""
    w = torch.tensor([[3.0, 4.0]])
    assert P.relative_error(w, P.Precision("int8")) == pytest.approx((3 - 380 / 127) / 5, rel=1e-5)


def test_the_stored_parts_of_a_transposed_matrix_by_hand():
    """A down projection stored [in 32, out 128] (``is_transposed``) at int4-g32: codes [out 128, in / 2 16],
    (scale, zero) [in / 32 = 1, out 128, 2]; int8: q [128, 32], a scale per output row; stored [out, in]
    it reads the other way round."""
    f32, i4, i8 = torch.float32, P.Precision("int4", 32), P.Precision("int8")
    assert P.part_shapes(i4, "down", (32, 128), f32, True) == {
        "down.q": ((128, 16), torch.uint8), "down.sz": ((1, 128, 2), f32),
    }  # fmt: skip
    assert P.part_shapes(i8, "down", (32, 128), f32, True) == {
        "down.q": ((128, 32), torch.int8),
        "down.s": ((128,), f32),
    }
    assert P.part_shapes(i4, "down", (32, 128), f32, False) == {
        "down.q": ((32, 64), torch.uint8), "down.sz": ((4, 32, 2), f32),
    }  # fmt: skip


def test_expert_bytes_of_each_precision_by_hand():
    model = make_model("qwen2_moe")  # gate_up [32, 32] and down [32, 16] per expert, fp32
    params = expert_params(model.model.layers[0].mlp.experts)
    assert P.expert_nbytes(P.Precision(), params, False) == (32 * 32 + 32 * 16) * 4
    # int8: q bytes + an fp32 scale per row
    assert P.expert_nbytes(P.Precision("int8"), params, False) == 32 * 32 + 32 * 4 + 32 * 16 + 32 * 4
    # int4 (per channel here): half a byte a weight + (scale, zero) fp32 per row and group
    assert P.expert_nbytes(P.Precision("int4"), params, False) == 32 * 16 + 32 * 2 * 4 + 32 * 8 + 32 * 2 * 4


@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral"])
@pytest.mark.parametrize("prec", [P.Precision("int8"), P.Precision("int4", 32)])
def test_disk_tier_at_a_precision_computes_as_the_model_with_those_weights(tmp_path, family, prec):
    """The live runtime reading int8 / int4 experts gives the logits of the model whose expert weights
    are the quantized ones (the kernels compute the formats exactly, up to float rounding)."""
    model = make_model(family)
    ids = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(3))
    exact = decode_logits(model, ids)
    with P.experts_at(make_model(family), prec) as ref_model:
        ref = decode_logits(ref_model, ids)
    rt = attach(
        model, policy="lru", capacity=0.25, prefetch="none", alpha=0.0, offload="disk",
        offload_dir=str(tmp_path), expert_dtype=prec.dtype, group_size=prec.group_size,
    )  # fmt: skip
    try:
        got = decode_logits(model, ids)
        stats = rt.stats()
    finally:
        rt.detach()
    # the run is the quantized model's, not the exact one's: 20x closer to the former than to the latter
    to_ref, to_exact = (got - ref).abs().max().item(), (got - exact).abs().max().item()
    assert to_ref < to_exact / 20, (to_ref, to_exact)
    assert stats["expert_dtype"] == prec.tag
    layout = offload._layouts(offload.tier_meta(json.loads((tmp_path / "meta.json").read_text()), prec))[0]
    assert stats["bytes_read"] == stats["disk_reads"] * layout.stride
    # detach restores the exact model from its model-dtype copy
    assert torch.equal(decode_logits(model, ids), exact)


def _offload_int4(tmp_path, group=32):
    model = make_model("qwen2_moe")
    st = find_moe_structure(model)
    meta = offload.write_offload(model, st, tmp_path, precision=P.Precision("int4", group))
    return model, st, meta


def test_the_directory_keeps_each_precision_beside_the_model_dtype_copy(tmp_path):
    model, st, meta = _offload_int4(tmp_path)
    names = sorted(p.name for p in tmp_path.glob("layer_*"))
    assert names == ["layer_000.int4-g32.safetensors", "layer_000.safetensors",
                     "layer_001.int4-g32.safetensors", "layer_001.safetensors"]  # fmt: skip
    # int8 added later: the int4 entry stays recorded and its files are not rewritten
    before = (tmp_path / "layer_000.int4-g32.safetensors").stat().st_mtime_ns
    offload.write_offload(model, st, tmp_path, precision=P.Precision("int8"))
    on_disk = json.loads((tmp_path / "meta.json").read_text())
    assert sorted(on_disk["precisions"]) == ["int4-g32", "int8"]
    assert (tmp_path / "layer_000.int4-g32.safetensors").stat().st_mtime_ns == before
    assert offload.missing_layers(tmp_path, meta, P.Precision("int4", 32)) == []
    # the stored int4 parts read back as the experts' quantized weights
    reader = offload.ExpertReader(tmp_path, offload.tier_meta(meta, P.Precision("int4", 32)))
    try:
        got = offload._read_layer(reader, 0, 8)
    finally:
        reader.close()
    w = expert_params(model.model.layers[0].mlp.experts)["gate_up_proj"][3]
    parts = {"q": got["gate_up_proj.q"][3], "sz": got["gate_up_proj.sz"][3]}
    want = P.quantize_matrix(P.Precision("int4", 32), w)
    assert torch.equal(parts["q"], want["q"]) and torch.equal(parts["sz"], want["sz"])


def test_a_precision_recorded_in_another_layout_or_int4_packing_is_refused(tmp_path):
    _, _, meta = _offload_int4(tmp_path)
    prec = P.Precision("int4", 32)
    on_disk = json.loads((tmp_path / "meta.json").read_text())
    # the directory records this torch's packing: a directory that recorded none would match any torch
    codes = (torch.arange(16 * 64).reshape(16, 64) * 7 % 16).to(torch.int32)
    packed = hashlib.sha256(P.pack_int4(codes).numpy().tobytes()).hexdigest()[:16]
    assert on_disk["precisions"]["int4-g32"]["int4_layout"] == packed
    other = json.loads(json.dumps(on_disk))
    other["precisions"]["int4-g32"]["int4_layout"] = "0000000000000000"
    (tmp_path / "meta.json").write_text(json.dumps(other))
    with pytest.raises(offload.OffloadError, match="packed by another torch's int4 kernel") as exc:
        offload.missing_layers(tmp_path, meta, prec)
    assert "\n" not in str(exc.value)
    # scales missing from the recorded layout (a directory written otherwise): refused, not misread
    other = json.loads(json.dumps(on_disk))
    other["precisions"]["int4-g32"]["experts"][0] = [
        t for t in other["precisions"]["int4-g32"]["experts"][0] if not t["name"].endswith(".sz")
    ]
    (tmp_path / "meta.json").write_text(json.dumps(other))
    with pytest.raises(offload.OffloadError, match="holds int4-g32 experts in another layout") as exc:
        offload.missing_layers(tmp_path, meta, prec)
    # the first tensor that differs, named (the recorded layer lacks the scales: down_proj.q where
    # gate_up_proj.sz stands), and what to remove
    assert "MoE layer 0's gate_up_proj.sz: recorded down_proj.q" in str(exc.value)
    assert "remove its layer_*.int4-g32.safetensors files (they are written again)" in str(exc.value)
    assert "\n" not in str(exc.value) and len(str(exc.value)) < 400
    # the model-dtype copy is still fine, and a new precision is simply written
    assert offload.missing_layers(tmp_path, meta) == []
    # with the recorded precision's files removed, as the line says, they are all written again
    for f in tmp_path.glob("layer_*.int4-g32.safetensors"):
        f.unlink()
    assert offload.missing_layers(tmp_path, meta, prec) == list(range(len(meta["files"])))


def test_a_damaged_quantized_file_is_refused_in_one_line(tmp_path):
    _, _, meta = _offload_int4(tmp_path)
    path = tmp_path / "layer_001.int4-g32.safetensors"
    whole = path.read_bytes()
    data = bytearray(whole)
    data[20] ^= 1  # inside the header's JSON
    path.write_bytes(bytes(data))
    with pytest.raises(
        offload.OffloadError, match=r"layer_001.int4-g32.safetensors is damaged \(its header differs\)"
    ):
        offload.missing_layers(tmp_path, meta, P.Precision("int4", 32))
    path.write_bytes(whole + b"\0" * 10)  # its header intact: the length alone is wrong
    with pytest.raises(offload.OffloadError, match="is longer than its layout"):
        offload.missing_layers(tmp_path, meta, P.Precision("int4", 32))


@pytest.mark.filterwarnings("ignore::moecast.runtime.tiers.offload.OffloadWarning")  # tmpfs: no O_DIRECT
def test_non_finite_scales_are_refused_at_an_experts_first_read_in_one_line(tmp_path, monkeypatch):
    """A NaN written over one scale of expert 3 in MoE layer 1's int4 file (its header intact): the first
    read of that expert, whole or in parts on the I/O pool, fails with one line naming the file; the
    other experts read, and a checked expert is not checked again."""
    from moecast.runtime.tiers.offload import ExpertReader

    _, _, meta = _offload_int4(tmp_path)
    tm = offload.tier_meta(meta, P.Precision("int4", 32))
    reader = ExpertReader(tmp_path, tm, threads=2)
    lay = reader.layouts[1]
    i = lay.names.index("down_proj.sz")
    path = tmp_path / "layer_001.int4-g32.safetensors"
    data = bytearray(path.read_bytes())
    at = reader.starts[1] + 3 * lay.stride + lay.offsets[i] + 4 * 5  # the sixth fp32 of its (scale, zero)s
    data[at : at + 4] = np.float32(np.nan).tobytes()
    path.write_bytes(bytes(data))
    checked = []
    real = ExpertReader._check_scales
    monkeypatch.setattr(
        ExpertReader, "_check_scales", lambda self, *a: (checked.append(a[:2]), real(self, *a))
    )
    buf = offload.aligned_bytes(lay.stride).numpy()
    try:
        with pytest.raises(offload.OffloadError, match=r"layer_001.int4-g32.safetensors: expert 3's down_proj.sz "
                                                       r"holds non-finite scales.*delete it and run again") as exc:  # fmt: skip
            reader.submit(1, 3, buf).result(timeout=30)
        assert "\n" not in str(exc.value)
        with pytest.raises(offload.OffloadError, match="non-finite"):
            reader.read_into(1, 3, buf)
        reader.submit(1, 2, buf).result(timeout=30)  # a healthy neighbour reads
        reader.read_into(0, 3, buf)
        n = len(checked)
        reader.submit(1, 2, buf).result(timeout=30)
        reader.read_into(0, 3, buf)
        assert len(checked) == n and (1, 2) in checked and (0, 3) in checked  # checked once each
    finally:
        reader.close()
    # the model-dtype copy holds no scales: nothing to check
    plain = ExpertReader(tmp_path, offload.tier_meta(meta, P.Precision()))
    try:
        assert plain._verified.all()
    finally:
        plain.close()


@pytest.mark.filterwarnings("ignore::moecast.runtime.tiers.offload.OffloadWarning")  # tmpfs: no O_DIRECT
@pytest.mark.parametrize("prec", [P.Precision("int8"), P.Precision("int4", 32)])
def test_zeroed_or_negative_steps_are_refused_and_zero_points_are_not_checked(tmp_path, prec):
    """Finite damage the exponent check lets through: a zeroed block (steps 0: the experts would compute
    zeros, and the run would print garbage) and a step of -0.0 are refused in one line; a zero point of
    any value is the quantizer's own. int4's .sz interleaves (step, zero point): the parity of a part
    that starts inside it decides which elements are steps."""
    from moecast.runtime.tiers.offload import ExpertReader

    model = make_model("qwen2_moe")
    meta = offload.write_offload(model, find_moe_structure(model), tmp_path, precision=prec)
    tm = offload.tier_meta(meta, prec)
    reader = ExpertReader(tmp_path, tm, threads=1)
    lay = reader.layouts[1]
    name = "down_proj.sz" if prec.dtype == "int4" else "down_proj.s"
    i = lay.names.index(name)
    size = 4  # the float32 model's scales
    at = reader.starts[1] + 3 * lay.stride + lay.offsets[i]
    path = tmp_path / f"layer_001.{prec.tag}.safetensors"
    good = path.read_bytes()

    def damaged(edits: dict[int, float]) -> None:
        data = bytearray(good)
        for k, v in edits.items():
            data[at + k * size : at + (k + 1) * size] = np.float32(v).tobytes()
        path.write_bytes(bytes(data))
        reader._verified[:] = False

    buf = offload.aligned_bytes(lay.stride).numpy()
    try:
        n = lay.nbytes(i) // size
        for edits in ({k: 0.0 for k in range(n)}, {0: -0.0}, {2: -1.0}):
            damaged(edits)
            with pytest.raises(
                offload.OffloadError, match=rf"expert 3's {name} holds steps that are not positive"
            ):
                reader.read_into(1, 3, buf)
        if prec.dtype == "int4":
            damaged({1: 0.0, 3: -5.0})  # zero points: any value
            reader.read_into(1, 3, buf)
            # a part starting at element 1 (a zero point): its steps are its odd elements
            rel = lay.offsets[i] + size

            def part_check() -> None:
                block = path.read_bytes()[reader.starts[1] + 3 * lay.stride :][: lay.stride]
                reader._check_scales(1, 3, memoryview(block), rel, lay.stride)

            damaged({1: 0.0})
            part_check()
            damaged({2: 0.0})
            with pytest.raises(offload.OffloadError, match="steps that are not positive"):
                part_check()
    finally:
        reader.close()
        path.write_bytes(good)


@pytest.mark.parametrize("quantize", [P.quantize_int8, lambda w: P.quantize_int4(w, 32)])
def test_a_step_never_rounds_to_zero_in_the_models_dtype(quantize):
    """float16 groups whose weights differ by 1e-7: the step (1e-7 / 15 or / 127) is below float16's
    smallest value and would be stored as 0, which the reader refuses as damage; it is stored as that
    smallest value instead, and the group still reads back to within it."""
    w = (torch.arange(64 * 32).reshape(64, 32) % 3 * 1e-7).to(torch.float16)
    parts = quantize(w)
    steps = parts["s"] if "s" in parts else parts["sz"][..., 0]
    assert (steps > 0).all() and steps.min().item() == P.min_step(torch.float16) == 2**-24
    prec = P.Precision("int8") if "s" in parts else P.Precision("int4", 32)
    back = P.dequantize_matrix(prec, parts, 32)
    assert (back.float() - w.float()).abs().max().item() <= 2**-23


def test_the_device_path_moves_the_stored_parts_as_one_block_through_staging(tmp_path):
    """The CUDA path of the disk store (a fake stream log) at int4: a read lands in a staging buffer
    and the stored parts (weights and scales of both matrices) go to the slot as one copy, after the
    slot's last reader; the slot then holds exactly the quantized expert the directory stores."""
    from moecast.runtime.tiers.offload import DiskLayerStore, ExpertReader
    from test_datapath import FakeOps
    from test_offload import reload_after_a_read

    model = make_model("mixtral")
    prec = P.Precision("int4", 32)
    meta = offload.write_offload(model, find_moe_structure(model), tmp_path, precision=prec)
    reader = ExpertReader(tmp_path, offload.tier_meta(meta, prec))
    experts = model.model.layers[0].mlp.experts
    ops = FakeOps()
    store = DiskLayerStore(experts, 2, reader, 0, ops=ops)
    try:
        reload_after_a_read(store, ops)  # the int4 parts and their scales move as one block
        want = P.quantize_matrix(prec, experts.gate_up_proj[1])
        assert torch.equal(store.slots["gate_up_proj.q"][0], want["q"])
        assert torch.equal(store.slots["gate_up_proj.sz"][0], want["sz"])
        assert reader.bytes_read == 3 * reader.layouts[0].stride < 3 * offload._layouts(meta)[0].stride
    finally:
        store.close()
        reader.close()


@pytest.mark.parametrize("extras", [False, True])
def test_one_token_experts_call_is_the_batched_calls_row_bit_for_bit(extras):
    """A decode step's call (one token: no per-expert search; its experts' kernels back to back, the
    elementwise parts over all their rows at once) gives, bit for bit, that token's row of the same
    call over several tokens (one per-expert search): each expert weighted by its own routing weight,
    in the same order, and the sentinel id (computed elsewhere) skipped. ``extras``: with biases and a
    post-expert norm, which the decode step adds to all rows at once."""
    torch.manual_seed(0)
    prec = P.Precision("int4", 32)
    experts, hidden, inter = 4, 32, 16
    parts = [
        (
            P.quantize_matrix(prec, torch.randn(2 * inter, hidden)),
            P.quantize_matrix(prec, torch.randn(hidden, inter)),
        )
        for _ in range(experts)
    ]
    tensors = {f"gate_up_proj.{k}": torch.stack([gu[k] for gu, _ in parts]) for k in parts[0][0]}
    tensors |= {f"down_proj.{k}": torch.stack([d[k] for _, d in parts]) for k in parts[0][1]}
    if extras:
        tensors["gate_up_proj_bias"] = torch.randn(experts, 2 * inter, dtype=torch.bfloat16)
        tensors["down_proj_bias"] = torch.randn(experts, hidden, dtype=torch.bfloat16)

    class Experts:
        has_gate, has_bias, has_post_expert_norm = True, extras, extras
        post_expert_norm = torch.nn.LayerNorm(hidden, dtype=torch.bfloat16)

        def _apply_gate(self, h):
            g, u = h.chunk(2, dim=-1)
            return torch.nn.functional.silu(g) * u

    from moecast.runtime.tiers.expert_store import SlotView

    view = SlotView(Experts(), tensors, experts, True)
    x = torch.randn(3, hidden, dtype=torch.bfloat16)
    ids = torch.tensor([[2, 0, experts], [1, 3, 0], [3, 2, 1]])  # the first row's third pair: the sentinel
    w = torch.rand(3, 3)
    batched = P.quantized_experts_forward(prec, view, x, ids, w)
    for t in range(3):
        one = P.quantized_experts_forward(prec, view, x[t : t + 1], ids[t : t + 1], w[t : t + 1])
        assert torch.equal(one[0], batched[t]), t
    # the weights follow their experts: swapping two of a row's weights changes its output
    swapped = P.quantized_experts_forward(prec, view, x[:1], ids[:1], w[:1, [1, 0, 2]])
    assert not torch.equal(swapped[0], batched[0])


def test_an_experts_bytes_count_its_biases_at_every_precision():
    """Experts with biases (gpt-oss's): the matrices are quantized, the biases kept. Per expert, float32:
    gate-up [8 out, 16 in] and down [16 out, 4 in] are 192 weights, and 24 biases. The model's dtype:
    (192 + 24) x 4 = 864 bytes. int8: 192 one-byte codes, a float32 step per output row (8 + 16) = 96
    bytes, the biases' 96 bytes: 384."""
    params = {
        "gate_up_proj": torch.zeros(3, 8, 16),
        "gate_up_proj_bias": torch.zeros(3, 8),
        "down_proj": torch.zeros(3, 16, 4),
        "down_proj_bias": torch.zeros(3, 16),
    }
    assert P.expert_nbytes(P.Precision(), params, False) == 864
    assert P.expert_nbytes(P.Precision("int8"), params, False) == 384


def test_an_int4_matrix_the_layout_cannot_pack_is_refused_in_one_line():
    """torch's int4 packing takes 16 output rows and 2 inputs at a time: [24 out, 64 in] failed deep in
    the quantizer with torch's own message ("expect N to be dividable by 16"); the stored layout refuses
    it first, naming the matrix and what to use. int8 takes any shape."""
    params = {"gate_up_proj": torch.zeros(2, 24, 64), "down_proj": torch.zeros(2, 64, 12)}
    with pytest.raises(
        ValueError, match=r"the experts' gate_up_proj is \[24 out, 64 in\]: use expert_dtype=int8"
    ) as e:
        P.expert_nbytes(P.Precision("int4", 32), params, False)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=r"down_proj is \[16 out, 63 in\]"):
        P.part_shapes(P.Precision("int4", 32), "down_proj", (63, 16), torch.float32, True)
    assert P.expert_nbytes(P.Precision("int8"), params, False) == 24 * 64 + 64 * 12 + (24 + 64) * 4
    # quantizing in memory (eval-accuracy's arithmetic) refuses it alike, not with torch's message
    with pytest.raises(ValueError, match=r"the experts' gate_up_proj is \[24 out, 64 in\]"):
        P.quantize_params(P.Precision("int4", 32), params, False)
    with pytest.raises(ValueError, match=r"the experts' matrix is \[24 out, 64 in\]"):
        P.fake_quantized(P.Precision("int4", 32), params, False)
