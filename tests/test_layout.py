"""The runtime's rooms import one way: core uses nothing else of the runtime; tiers only core; live and
replay use core and tiers, never each other. And the layout of an expert's packed block
(runtime/tiers/layout.py), where each tier keeps an expert's tensors."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

RUNTIME = Path(__file__).resolve().parents[1] / "runtime"
MAY_USE = {
    "core": {"core"},
    "tiers": {"core", "tiers"},
    "live": {"core", "tiers", "live"},
    "replay": {"core", "tiers", "replay"},
    "profile": {"core", "tiers", "live", "replay", "profile"},
}


def rooms_imported(path: Path) -> set[str]:
    """The runtime rooms ``path`` imports (at module level or inside a function)."""
    rooms = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[:2] == ["moecast", "runtime"] and len(parts) > 2:
                rooms.add(parts[2])
    return rooms


def test_the_rooms_are_exactly_these():
    found = {p.name for p in RUNTIME.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert found == set(MAY_USE)
    assert {p.name for p in RUNTIME.glob("*.py")} == {"__init__.py"}  # no module left outside a room


@pytest.mark.parametrize("room", sorted(MAY_USE))
def test_imports_run_one_way(room):
    for path in sorted((RUNTIME / room).glob("*.py")):
        wrong = rooms_imported(path) - MAY_USE[room]
        assert not wrong, f"{path.relative_to(RUNTIME)} imports runtime.{sorted(wrong)}"


def test_the_checker_sees_a_wrong_import(tmp_path):
    bad = tmp_path / "m.py"
    bad.write_text("def f():\n    from moecast.runtime.live import runtime\n")
    assert rooms_imported(bad) == {"live"}
    bad.write_text("from moecast.runtime import replay\n")
    assert rooms_imported(bad) == {"replay"}


# ---------------------------------------------------------------------------------------------------------
# runtime/tiers/layout.py: an expert's tensors as views into one packed block


def _packed_params() -> dict[str, torch.Tensor]:
    """Two experts of an int8 [3], a float32 [2, 2] and a bfloat16 [5] tensor, every value distinct."""
    return {
        "a": torch.tensor([[1, 2, 3], [4, 5, 6]], dtype=torch.int8),
        "b": torch.arange(8, dtype=torch.float32).reshape(2, 2, 2) + 0.5,
        "c": torch.arange(10, dtype=torch.bfloat16).reshape(2, 5) - 3,
    }


def test_an_experts_tensors_are_views_into_its_block_at_the_layouts_offsets():
    """By hand, aligned to 64: a at byte 0 (3 bytes), b at 4 (rounded up to its float32 size, 16 bytes),
    c at 20 (10 bytes); 30 bytes an expert, a block of 64. Written through the views over a base that
    starts 64 bytes into its buffer, expert 1's bytes sit in that buffer at 128 + offset and nothing
    lands before the base. Catches a view counted from the buffer's start rather than the base's,
    a byte count of the wrong element size, and a block shorter than the stride a copy moves."""
    from moecast.runtime.tiers.layout import ExpertLayout

    params = _packed_params()
    layout = ExpertLayout.of(params, align=64)
    assert (layout.offsets, layout.expert_bytes, layout.stride) == ((0, 4, 20), 30, 64)
    assert [layout.nbytes(i) for i in range(3)] == [3, 16, 10]
    assert layout.as_json() == [
        {"name": "a", "shape": [3], "dtype": "I8"},
        {"name": "b", "shape": [2, 2], "dtype": "F32"},
        {"name": "c", "shape": [5], "dtype": "BF16"},
    ]
    buf = torch.zeros(64 + 2 * 64, dtype=torch.uint8)
    base = buf[64:]
    views = layout.views(base, 2)
    for name, t in params.items():
        assert views[name].shape == t.shape
        views[name].copy_(t)
    assert not buf[:64].any()
    one = layout.block(base, 1)
    assert one.numel() == 64 and one.data_ptr() == buf.data_ptr() + 128
    assert one[0:3].view(torch.int8).tolist() == [4, 5, 6]
    assert one[4:20].view(torch.float32).tolist() == [4.5, 5.5, 6.5, 7.5]
    assert torch.equal(one[20:30].view(torch.bfloat16), params["c"][1])
    assert not one[30:].any() and not one[3:4].any()  # the padding stays untouched


def test_views_take_a_stride_other_than_the_layouts():
    """A slot sized for another layout (a two-copy slot holds its low copy at the high copy's stride):
    expert i's tensors start at i * the stride given."""
    from moecast.runtime.tiers.layout import ExpertLayout

    params = _packed_params()
    layout = ExpertLayout.of(params, align=64)
    base = torch.zeros(2 * 256, dtype=torch.uint8)
    views = layout.views(base, 2, stride=256)
    views["a"].copy_(params["a"])
    assert base[256:259].view(torch.int8).tolist() == [4, 5, 6] and not base[64:256].any()
