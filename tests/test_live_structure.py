"""The live runtime's shape: every registered slow tier behind the ExpertTier protocol, classes of a
bounded size, and no branching on a device type or a tier name in the live package."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from moecast.collect.models import find_moe_structure
from moecast.runtime.live.config import OFFLOAD, LiveConfig
from moecast.runtime.tiers.base import Device, ExpertTier, LayerTier, TierSpec
from moecast.runtime.tiers.expert_store import expert_params
from moecast.runtime.tiers.precision import Precision
from moecast.runtime.tiers.registry import TIERS
from test_live import make_model

RUNTIME = Path(__file__).resolve().parents[1] / "runtime"
LIVE = RUNTIME / "live"
#: where a device type may be read: the host/device transfer functions (CUDA's pinned copies and events)
OPS_MODULES = {"transfer.py"}
#: the CLI's module, which loads a model for a tier before any runtime exists
CLI_MODULES = {"commands.py"}
MAX_METHODS, MAX_RUNTIME_METHODS = 20, 15


def _members(proto: type) -> set[str]:
    return {n for n in (*proto.__annotations__, *vars(proto)) if not n.startswith("_")}


@pytest.mark.parametrize("name", sorted(TIERS))
def test_every_registered_tier_implements_the_protocol(name, tmp_path):
    """Opened on a small model, a registered tier is an ExpertTier and each of its layers a LayerTier
    (a method dropped or renamed fails here), its methods take the protocol's parameters, and closing it
    leaves the model's experts as they were."""
    cls = TIERS[name]
    assert cls.name == name  # the registry's key is the tier's own name
    model = make_model("mixtral")
    structure = find_moe_structure(model)
    before = {k: v.clone() for k, v in expert_params(structure.layers[0].experts).items()}
    spec = TierSpec(2, Device.at("cpu"), Precision(), pinned_budget=0, directory=str(tmp_path / "off"))
    tier = cls.open(model, structure, spec)
    try:
        assert isinstance(tier, ExpertTier)
        assert len(tier.layers) == len(structure.layers)
        for layer in tier.layers:
            assert isinstance(layer, LayerTier)
        for proto, impl in ((ExpertTier, cls), (LayerTier, type(tier.layers[0]))):
            for member in _members(proto):
                want = getattr(proto, member, None)
                if callable(want):  # the protocol's parameters, by name and in order
                    got = inspect.signature(getattr(impl, member)).parameters
                    assert list(got) == list(inspect.signature(want).parameters), (impl.__name__, member)
        layer = tier.layers[0]
        layer.fill([3, 5])
        layer.wait()
        assert list(layer.expert_in) == [3, 5] and layer.slot_of[5] == 1
        assert len(layer.in_flight(np.array([0, 1]))) == 0
        (tensors, table, count), *_ = list(layer.cpu_waves(np.array([1])))
        assert table[1] < count == table[0]  # expert 1 in the wave, expert 0 the sentinel
        assert all(torch.equal(tensors[k][table[1]], before[k][1]) for k in before)
        assert isinstance(tier.waited(), float)
        # the tier's wait counts every layer's: a synchronous copy into another layer adds to it
        w0 = tier.waited()
        tier.layers[1].fill([2])
        tier.layers[1].wait()
        assert tier.waited() > w0 if not tier.background_reads else tier.waited() >= w0
        assert {"pinned_bytes", "staged_layers", "bytes_read", "disk_reads"} <= set(tier.stats())
    finally:
        tier.close()
    after = expert_params(structure.layers[0].experts)
    assert all(torch.equal(before[k], after[k]) for k in before)


def _store_members_used(source: str) -> set[str]:
    """The attributes ``source`` reads on a layer's store: ``store.X`` and ``self.stores[i].X``."""
    used = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute):
            v = node.value
            named = isinstance(v, ast.Name) and v.id == "store"
            indexed = (
                isinstance(v, ast.Subscript)
                and isinstance(v.value, ast.Attribute)
                and v.value.attr == "stores"
            )
            if named or indexed:
                used.add(node.attr)
    return used


def test_the_executor_uses_only_the_layer_protocols_members():
    """A tier that implements LayerTier exactly passed the protocol test, then failed at its first miss:
    the executor called ``load_many``, which the protocol lacked."""
    used = _store_members_used((LIVE / "executor.py").read_text())
    assert {"load_many", "cpu_waves", "fill"} <= used  # the scan sees the calls
    assert used <= _members(LayerTier), used - _members(LayerTier)


def test_a_tier_whose_cpu_waves_is_a_plain_iterator_computes_on_the_cpu(monkeypatch):
    """The protocol says ``cpu_waves`` returns an Iterator; the executor closed it as a generator
    (``'list_iterator' object has no attribute 'close'`` at the first CPU-computed expert). A list
    iterator of the same waves gives the same logits."""
    from moecast.collect.models import kv_cache, with_cache
    from moecast.runtime.live.runtime import attach
    from moecast.runtime.tiers.expert_store import LayerStore

    def run() -> tuple[torch.Tensor, int]:
        model = make_model("qwen2_moe")
        rt = attach(model, policy="lru", capacity=2, warm=False, balance="cpu")
        try:
            with torch.no_grad():  # the decode steps compute their misses on the CPU
                out = model(input_ids=torch.tensor([[1, 2, 3, 4]]), use_cache=True)
                logits = [out.logits]
                for t in range(4):
                    cache = with_cache(model, kv_cache(out))
                    out = model(input_ids=torch.tensor([[5 + t]]), **cache, use_cache=True)
                    logits.append(out.logits)
            return torch.cat(logits, 1), rt.stats()["cpu_experts"]
        finally:
            rt.detach()

    want, n = run()
    assert n > 0  # the CPU computed experts through the waves
    waves = LayerStore.cpu_waves
    monkeypatch.setattr(LayerStore, "cpu_waves", lambda self, e, wave=None: iter(list(waves(self, e, wave))))
    got, m = run()
    assert m == n and torch.equal(got, want)


def test_the_offload_names_are_the_registry(monkeypatch):
    assert tuple(TIERS) == OFFLOAD
    # --offload's help is the registry's, each tier in its own words (it was hand-kept: "ram or disk")
    from moecast.runtime.live.commands import run
    from moecast.runtime.tiers.registry import tier_help

    assert all(f"{n} ({cls.help})" in " ".join((run.__doc__ or "").split()) for n, cls in TIERS.items())
    assert "<TIER_HELP>" not in (run.__doc__ or "")
    monkeypatch.setitem(TIERS, "zlib", type("ZlibTier", (), {"help": "host memory, zlib-compressed"}))
    assert tier_help().endswith(
        ", disk (``--offload_dir``, read with direct I/O) or zlib (host memory, zlib-compressed)"
    )
    with pytest.raises(ValueError, match=f"choose one of {', '.join(TIERS)}"):
        LiveConfig(offload="tape")


def test_run_reports_a_tier_in_its_own_rows(monkeypatch, capsys):
    """`moecast run`'s text asks the run's tier for its rows (ExpertTier.report): a tier registered by a
    contributor gets its own lines without an edit to the report, and another tier's rows do not
    show. Catches a report that tests tier names again (the disk rows were hard-coded there)."""
    from moecast.runtime.live.commands import _print_stats
    from moecast.runtime.tiers.disk import DiskTier

    class ZlibTier:
        name, help = "zlib", "host memory, zlib-compressed"

        @classmethod
        def report(cls, stats):
            return [("compression", f"{stats['zlib_ratio']:.2f}x smaller in host memory")]

    monkeypatch.setitem(TIERS, "zlib", ZlibTier)
    stats = dict(
        policy="lru", capacity=2, num_experts=8, alpha=0.0, prefetch="none", decode_steps=1, hit_rate=0.5,
        hits=1, uses=2, substitution_rate=0.0, substituted=0, routed=2, transfers=1, loads=1,
        prefetches_landed=0, prefetches_issued=0, prefetch_accuracy=None, cpu_experts=0, cpu_uses=0,
        measured_tpot_ms=1.0, device="cpu", modeled_tpot_ms=1.0, hardware="h", hardware_from="f",
        peak_rss_mb=1.0, offload="zlib", zlib_ratio=2.5, disk_reads=3, bytes_read=2**20, direct_io=True,
        **{f"{part}_ms": 0.0 for part in ("attention", "expert_compute", "transfer_wait", "device_sync", "predictor", "policy")},
    )  # fmt: skip
    _print_stats(stats)
    text = capsys.readouterr().out
    assert re.search(r"compression\s+2\.50x smaller in host memory", text), text
    assert "disk reads" not in text  # the disk's keys are there, its tier is not
    _print_stats({**stats, "offload": "disk", "disk_read_gbps_observed": 1.5})
    text = capsys.readouterr().out
    assert "compression" not in text
    want = DiskTier.report({**stats, "disk_read_gbps_observed": 1.5})
    assert want == [("disk reads", "3 (1.0 MiB, direct I/O; whole 4 KiB blocks, 1.50 GB/s while reading)")]
    assert re.search(r"disk reads\s+3 \(1\.0 MiB, direct I/O; whole 4 KiB blocks, 1\.50 GB/s", text), text


def _classes(root: Path) -> list[tuple[str, str, int]]:
    out = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                n = sum(isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef) for f in node.body)
                out.append((path.relative_to(root).as_posix(), node.name, n))
    return out


def test_classes_stay_small_and_the_live_runtime_orchestrates():
    """LiveRuntime keeps at most 15 methods (the rest lives in the executor, tiers, prefetch, stats);
    no class under runtime/ grows past 20."""
    sizes = _classes(RUNTIME)
    (runtime,) = [n for path, name, n in sizes if (path, name) == ("live/runtime.py", "LiveRuntime")]
    assert runtime <= MAX_RUNTIME_METHODS
    from moecast.runtime.live.runtime import LiveRuntime

    own = [k for k, v in vars(LiveRuntime).items() if inspect.isfunction(v)]
    assert len(own) == runtime  # the ast count sees what the class has
    big = [(p, c, n) for p, c, n in sizes if n > MAX_METHODS]
    assert not big, f"classes over {MAX_METHODS} methods: {big}"


BRANCHING_ATTRS = {"cuda", "reader"}
#: a branch tests equality; membership in the registry (validating a name) is no branch
EQUALITY = (ast.Eq, ast.NotEq, ast.Is, ast.IsNot)


def branching(source: str, tier_names: set[str]) -> list[str]:
    """What in ``source`` branches on the device type or the tier: an attribute ``.cuda`` or ``.reader``,
    an equality test on ``offload``, or one against a tier's name."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in BRANCHING_ATTRS:
            found.append(f"line {node.lineno}: .{node.attr}")
        if isinstance(node, ast.Compare) and any(isinstance(op, EQUALITY) for op in node.ops):
            sides = [node.left, *node.comparators]
            names = {s.attr if isinstance(s, ast.Attribute) else getattr(s, "id", None) for s in sides}
            consts = {s.value for s in sides if isinstance(s, ast.Constant)}
            if "offload" in names or consts & tier_names:
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


@pytest.mark.parametrize(
    "path", sorted(p.name for p in LIVE.glob("*.py") if p.name not in OPS_MODULES | CLI_MODULES)
)
def test_the_live_package_asks_the_tier_and_the_device(path):
    assert not branching((LIVE / path).read_text(), set(TIERS)), path


def test_the_branching_check_sees_a_flag():
    names = set(TIERS)
    assert branching("if st.cuda:\n    pass\n", names) == ["line 1: .cuda"]
    assert branching("x = rt.reader.reads\n", names) == ["line 1: .reader"]
    assert branching("if self.config.offload == 'disk':\n    pass\n", names)
    assert branching("if kind != 'ram':\n    pass\n", names)
    assert not branching("if self.offload not in TIERS:\n    pass\n", names)
    assert not branching("if self.device.accelerated and self.tier.background_reads:\n    pass\n", names)


def test_a_device_says_whether_it_accelerates_and_whether_it_simulates():
    """Device.accelerates answers from the names alone (the runtime sizes its slots with it before the
    device exists): a CUDA device or the simulated ops accelerate, the plain CPU does not; the CPU,
    plain or simulated, stands in for an accelerator (``simulated``), and the simulated ops only on it."""
    from moecast.errors import InputError

    assert Device.accelerates("cuda") and Device.accelerates("cuda:1")
    assert not Device.accelerates("cpu")
    assert Device.accelerates("cpu", "simulated")
    cpu, sim = Device.at("cpu"), Device.at("cpu", "simulated")
    assert (cpu.accelerated, cpu.simulated) == (False, True)
    assert (sim.accelerated, sim.simulated) == (True, True)
    with pytest.raises(InputError, match="simulates an accelerator on the CPU; the slots are on cuda"):
        Device.at("cuda", "simulated")
    with pytest.raises(InputError, match="unknown device_ops 'tape'"):
        Device.at("cpu", "tape")


def test_the_slots_go_where_given_else_where_the_experts_are():
    """slot_device: the device named, else the experts' own device, else (experts on meta) the
    model's first real weight's."""
    from moecast.runtime.tiers.base import slot_device

    model = make_model("qwen2_moe")
    structure = find_moe_structure(model)
    assert slot_device(model, structure, "cuda:1") == torch.device("cuda:1")  # named: not looked up
    assert slot_device(model, structure, None) == torch.device("cpu")
    model.model.layers[0].mlp.experts.to("meta")
    assert slot_device(model, structure, None) == torch.device("cpu")  # the first real weight's


def test_the_host_tier_reports_a_row_only_for_staged_copies():
    from moecast.runtime.tiers.host import HostTier

    assert HostTier.report({"staged_layers": 0}) == []
    ((label, text),) = HostTier.report({"staged_layers": 3})
    assert label == "staged copies" and text.startswith("3 layers' host copies stayed pageable")
