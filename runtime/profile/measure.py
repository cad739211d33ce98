"""``moecast profile``: measure this machine into a hardware profile (PreScope Sec. 4.3.2 variables).

- CPU: a real SwiGLU expert MLP of the model's shape and dtype (gate, up, down projections on the
  CPU) timed for several token counts, each call on the next weight set of a ring of distinct
  experts larger than twice the last-level cache (the runtime's experts come cold from DRAM; one
  set timed again and again stays in the cache and runs about twice as fast); a least-squares line
  gives PreScope Eq. 3's ``beta`` (per token) and ``C`` (start-up).
- CUDA, when present: pinned host-to-device bandwidth for one expert's bytes, device time of the
  same expert at batch 1 (``t_g``, over the same ring) and a stand-in for attention time (two
  hidden x hidden matmuls). Without CUDA the device fields are taken from the PreScope A100 profile
  and the source says so.
- With the model at hand (:func:`profile_model`): its non-expert time per MoE layer (a decode step
  with the routed experts skipped) and the layer-ahead predictor's latency per layer (the given
  checkpoint, else a LLaPor of the default size with random weights: the same computation).
- With the model at hand and CUDA (:func:`device_load_host_ms`): the host's time to issue one expert
  load (``load_host_ms``), through the runtime's own store (a copy of the model's first experts
  module): what the host spends per copy while a decode step waits on it.
- With an offload directory (:func:`on_disk`): the experts live on its disk (``slow_tier`` disk),
  whose bandwidth is measured as the runtime reads it (random whole experts with O_DIRECT on the
  ExpertReader's I/O threads; a directory without an offload gets a temporary file, which a VM's
  host may serve from its cache). Without CUDA the CPU is the fast tier: the link is the disk and
  a resident expert costs the CPU expert at one token, and the disk is read while the CPU computes
  experts (:func:`cpu_busy`), as the runtime reads it; the compute time a read takes from the
  cores is the CPU time its reading thread and the machine's interrupts spend on it
  (:func:`read_compute_ms`).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import mmap
import os
import sys
import threading
import time
import warnings
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, replace
from pathlib import Path
from statistics import NormalDist
from typing import Any

import numpy as np
from moecast.collect.models import kv_cache, with_cache
from moecast.predictors.base import LayerAhead
from moecast.runtime.core.cost_model import HardwareProfile, load_profile

from moecast.errors import InputError


def _time(fn, repeat: int, min_sample_s: float = 2e-3) -> float:
    """ms of one call: the median over ``repeat`` samples, each sample as many calls as fill
    ``min_sample_s`` (a small expert runs in microseconds, where one timed call is mostly clock
    noise and a busy machine's interruptions would decide the fit)."""
    fn()
    t = time.perf_counter()
    fn()
    one = max(time.perf_counter() - t, 1e-7)
    n = max(1, min(10_000, int(min_sample_s / one)))
    samples = []
    for _ in range(repeat):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        samples.append((time.perf_counter() - t) / n)
    return float(np.median(samples)) * 1e3


def _sig(x: float, digits: int = 4) -> float:
    """Round to significant digits (fixed decimals would turn a microsecond-scale beta into 0)."""
    return float(f"{x:.{digits}g}")


# ----------------------------------------------------------------------------- the CPU expert, cold

CACHE_DIR = Path("/sys/devices/system/cpu/cpu0/cache")
LLC_FALLBACK = 64 << 20  # where /sys does not say (containers without it, other systems)
RING_MAX = 1024  # experts of a few KB never leave the caches; more sets would only cost time to build


def _cache_bytes(text: str) -> int:
    """A /sys cache size ("491520K", "32M", "512") in bytes."""
    text = text.strip().upper()
    unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(text.rstrip("KMG")) * unit


def llc_bytes(root: Path | None = None) -> int:
    """Bytes of the last-level cache: the level-3 cache where there is one, else the largest; 64 MiB
    where ``root`` (cpu0's cache directory in /sys) cannot be read."""
    caches = []
    for index in sorted((root or CACHE_DIR).glob("index*")):
        try:
            caches.append((int((index / "level").read_text()), _cache_bytes((index / "size").read_text())))
        except (OSError, ValueError):
            continue
    if not caches:
        return LLC_FALLBACK
    level3 = [size for level, size in caches if level == 3]
    return max(level3) if level3 else max(size for _, size in caches)


def ring_size(expert_bytes: int) -> int:
    """How many distinct experts a cold timing cycles through: more bytes than twice the last-level
    cache, so each call reads its weights from DRAM as the runtime's slots do; at most a quarter of
    the available memory (and RING_MAX sets), at least 2."""
    from moecast.runtime.tiers.offload import available_bytes

    n = 2 * llc_bytes() // expert_bytes + 1
    avail = available_bytes()
    if avail:
        n = min(n, avail // 4 // expert_bytes)
    return int(max(2, min(n, RING_MAX)))


def _swiglu(x: Any, w: tuple[Any, Any, Any]) -> Any:
    """One expert's gate, up and down projections over ``x``."""
    import torch.nn.functional as F

    wg, wu, wd = w
    return F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd)


def _ring_note(ring: list[tuple[Any, ...]]) -> str:
    nbytes = sum(t.numel() * t.element_size() for t in ring[0]) * len(ring)
    mib = f"{nbytes / 2**20:.0f}" if nbytes >= 10 << 20 else f"{nbytes / 2**20:.2g}"
    if nbytes > 2 * llc_bytes():
        return f"cold: a ring of {len(ring)} experts ({mib} MiB) > 2x LLC"
    cap = f"capped at a quarter of available memory or {RING_MAX} sets"
    return f"cold: a ring of {len(ring)} experts ({mib} MiB) <= 2x LLC ({cap})"


def _cycle(ring: list[Any]) -> Any:
    """A function that returns the ring's next set on each call."""
    it = itertools.cycle(ring)
    return lambda: next(it)


def measure(
    hidden: int,
    intermediate: int,
    name: str = "local",
    token_counts=(1, 2, 4, 8, 16),
    repeat: int = 5,
    dtype: str = "float32",
    cpu_expert: tuple[float, float, str] | None = None,
) -> HardwareProfile:
    """The profile for an expert of ``hidden`` x ``intermediate``; the CPU expert runs in ``dtype``
    (the model's: bf16 matmuls take another code path than float32 ones on the CPU), each call on
    the next weight set of a ring larger than the last-level cache (:func:`ring_size`).
    ``cpu_expert``: (beta, C, how) already measured (:func:`implementation_expert_ms`, the model at
    hand), which the SwiGLU's timing then does not repeat."""
    import torch

    threads = torch.get_num_threads()
    expert_bytes = 3 * hidden * intermediate * 2  # bf16, the dtype a runtime moves
    ring = None
    if cpu_expert is None:
        ring = _weight_ring(hidden, intermediate, dtype)
        beta, c = _swiglu_fit(ring, hidden, dtype, token_counts, repeat)
        cpu_note = f"{dtype} expert {hidden}x{intermediate}, {_ring_note(ring)}"
    else:
        beta, c, cpu_note = cpu_expert
    source = f"measured by moecast profile on this machine (CPU, {threads} threads; {cpu_note})"
    if torch.cuda.is_available():
        ring = ring or _weight_ring(hidden, intermediate, dtype)
        gbps, t_g, t_attn = _cuda_times(ring, hidden, expert_bytes, repeat)
        source += (
            f"; CUDA {torch.cuda.get_device_name(0)}: pinned H2D copy, bf16 expert over the same ring "
            "and 2-matmul attention stand-in"
        )
    else:
        ref = load_profile("prescope-a100-pcie4")
        scale = expert_bytes / ref.ref_expert_bytes
        gbps, t_g, t_attn = ref.transfer_gbps, ref.gpu_expert_ms * scale, ref.attn_ms
        source += NO_CUDA
    return HardwareProfile(
        name=name,
        transfer_gbps=_sig(gbps),
        ref_expert_bytes=expert_bytes,
        gpu_expert_ms=_sig(t_g),
        cpu_beta_ms=_sig(beta),
        cpu_c_ms=_sig(c),
        attn_ms=_sig(t_attn),
        source=source,
    )


def _weight_ring(hidden: int, intermediate: int, dtype: str) -> list[tuple[Any, ...]]:
    """Distinct SwiGLU weight sets (values do not matter, addresses do: one set would stay in the
    cache), as many as :func:`ring_size` asks."""
    import torch

    torch.manual_seed(0)
    dt = getattr(torch, dtype)
    shapes = ((intermediate, hidden), (intermediate, hidden), (hidden, intermediate))
    base = tuple((torch.randn(*s) * 0.02).to(dt) for s in shapes)
    set_bytes = sum(w.numel() * w.element_size() for w in base)
    return [base] + [tuple(w.clone() for w in base) for _ in range(ring_size(set_bytes) - 1)]


def _swiglu_fit(
    ring: list[tuple[Any, ...]], hidden: int, dtype: str, token_counts, repeat: int
) -> tuple[float, float]:
    """PreScope Eq. 3's (beta, C) of the SwiGLU, each call on the ring's next weight set."""
    import torch

    weights = _cycle(ring)
    ms = []
    with torch.inference_mode():
        for m in token_counts:
            x = torch.randn(m, hidden, dtype=getattr(torch, dtype))
            ms.append(_time(lambda x=x: _swiglu(x, weights()), repeat))
    beta, c = np.polyfit(np.asarray(token_counts, dtype=float), np.asarray(ms), 1)
    # a positive slope even where the timings are flat (tiny experts): Eq. 3's beta is per token
    return max(float(beta), 1e-6), max(float(c), 0.0)


NO_CUDA = "; no CUDA here: link and device times taken from prescope-a100-pcie4"


def _cuda_times(
    ring: list[tuple[Any, ...]], hidden: int, expert_bytes: int, repeat: int
) -> tuple[float, float, float]:
    """(GB/s of a pinned host-to-device expert copy, ms of a bf16 expert at one token cycling
    through the ring on the device (its L2 holds one expert), ms of a 2-matmul attention stand-in)."""
    import torch

    dev = torch.device("cuda")
    host = torch.empty(expert_bytes // 2, dtype=torch.bfloat16).pin_memory()
    buf = torch.empty_like(host, device=dev)

    def copy() -> None:
        buf.copy_(host, non_blocking=True)
        torch.cuda.synchronize()

    gbps = expert_bytes / (_time(copy, repeat) / 1e3) / 1e9
    n = max(2, min(len(ring), torch.cuda.mem_get_info()[0] // 4 // expert_bytes))
    weights = _cycle([tuple(w.to(dev, torch.bfloat16) for w in ws) for ws in ring[:n]])
    x = torch.randn(1, hidden, device=dev, dtype=torch.bfloat16)
    wa = torch.randn(hidden, hidden, device=dev, dtype=torch.bfloat16)

    def gpu_expert() -> None:
        _swiglu(x, weights()).sum().item()

    def attn() -> None:
        (x @ wa @ wa).sum().item()

    with torch.inference_mode():
        return gbps, _time(gpu_expert, repeat), _time(attn, repeat)


def _skip_experts(module, hidden_states, top_k_index, top_k_weights, **kwargs):
    """An experts implementation that computes nothing: what is left of a forward is the dense part."""
    return hidden_states.new_zeros(hidden_states.shape)


def _sync(device) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def dense_layer_ms(model, steps: int = 8, prompt: int = 8, repeat: int = 3) -> float:
    """Non-expert time (ms) per MoE layer of ``model`` on its device: the median decode step with every
    routed expert skipped (attention, router, shared experts, norms, and the embedding and output
    head shared out over the layers), divided by the MoE layer count."""
    import torch
    from moecast.collect.models import find_moe_structure
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    layers = len(find_moe_structure(model).layers)
    device = next(model.parameters()).device
    ALL_EXPERTS_FUNCTIONS["moecast_skip"] = _skip_experts
    previous = model.get_experts_implementation()
    model.set_experts_implementation("moecast_skip")
    vocab = int(model.config.vocab_size)
    ids = torch.arange(prompt + steps + 1, device=device)[None] % vocab
    samples = []
    try:
        with torch.inference_mode():
            for _ in range(repeat):
                out = model(input_ids=ids[:, :prompt], use_cache=True)
                cache = kv_cache(out)
                _sync(device)
                t0 = time.perf_counter()
                for t in range(prompt, prompt + steps):
                    out = model(input_ids=ids[:, t : t + 1], **with_cache(model, cache), use_cache=True)
                _sync(device)
                samples.append((time.perf_counter() - t0) / steps)
    finally:
        model.set_experts_implementation(previous)
    return float(np.median(samples)) * 1e3 / layers


# ----------------------------------------------------------------------------- offload disk

_ALIGN = 4096  # O_DIRECT needs buffers, offsets and sizes aligned to the logical block size
MIN_READ_S = 3.0  # an offload probe reads for at least this long and MIN_READS experts,
MIN_READS = 32
READ_BUDGET_MB = 8192  # and stops after this many MB whatever the two say


def disk_read_gbps(
    directory: str | Path,
    size_mb: int = 256,
    chunk_mb: int = 4,
    block_bytes: int | None = None,
    threads: int | None = None,
) -> tuple[float, str]:
    """(GB/s, how) of direct reads from ``directory``'s disk.

    An offload directory (its meta.json present) is read as the runtime reads it
    (:func:`offload_read_gbps`, on ``threads`` I/O threads). Any other directory gets a ``size_mb``
    temporary file, written with fsync, read once on one thread in ``block_bytes`` reads (an
    expert's block, where known; else ``chunk_mb`` MB) and removed: O_DIRECT, or buffered reads
    after dropping the file's cached pages where the filesystem refuses O_DIRECT; ``how`` says which."""
    from moecast.runtime.tiers.offload import _read_meta

    d = Path(directory)
    meta = _read_meta(d) if d.is_dir() else None
    if meta is not None:
        return offload_read_gbps(d, meta, threads)
    block = int(block_bytes) if block_bytes else chunk_mb << 20
    return _fresh_file_gbps(d, size_mb, max(_ALIGN, -(-block // _ALIGN) * _ALIGN))


def _fresh_file_gbps(d: Path, size_mb: int, chunk: int) -> tuple[float, str]:
    d.mkdir(parents=True, exist_ok=True)
    n = max(1, (size_mb << 20) // chunk)
    path = d / f".moecast-profile-{os.getpid()}.bin"
    buf = mmap.mmap(-1, chunk)  # page-aligned, as O_DIRECT requires
    buf.write(np.random.default_rng(0).integers(0, 256, chunk, dtype=np.uint8).tobytes())
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            for _ in range(n):
                os.write(fd, buf)
            os.fsync(fd)
        finally:
            os.close(fd)
        how = "O_DIRECT"
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
            if not hasattr(os, "O_DIRECT"):
                raise OSError("no O_DIRECT on this platform")
            os.preadv(fd, [buf], 0)  # some filesystems accept the flag and refuse the read
        except OSError:
            how = "buffered after posix_fadvise(DONTNEED), the filesystem refusing O_DIRECT"
            fd = os.open(path, os.O_RDONLY)
        try:
            if how != "O_DIRECT" and hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            t0 = time.perf_counter()
            for i in range(n):
                os.preadv(fd, [buf], i * chunk)
            dt = time.perf_counter() - t0
        finally:
            os.close(fd)
    finally:
        buf.close()
        path.unlink(missing_ok=True)
    how += (
        f": a fresh {n * chunk / 2**20:.0f} MiB temporary file read in {chunk / 2**20:.2f} MiB blocks on one "
        "thread (a host, a VM's, may serve a freshly written file from its cache; an offload directory "
        "gives the runtime's figure)"
    )
    return n * chunk / dt / 1e9, how


def offload_read_gbps(
    directory: str | Path, meta: dict[str, Any], threads: int | None = None
) -> tuple[float, str]:
    """(GB/s, how) of the runtime's own reads: whole experts at random (layer, expert) from the
    offload directory's layer files with :class:`~moecast.runtime.tiers.offload.ExpertReader` (O_DIRECT on
    its I/O pool of ``threads``, the runtime's IO_THREADS by default), two reads per thread queued,
    until MIN_READ_S and MIN_READS have passed or READ_BUDGET_MB are read; bytes over wall time."""
    from moecast.runtime.tiers.offload import IO_THREADS, ExpertReader

    threads = IO_THREADS if threads is None else max(1, int(threads))
    reader = ExpertReader(directory, meta, threads)
    try:
        nbytes, per_read, wall = _random_reads(reader, 2 * threads)
    finally:
        reader.close()
    mode = "O_DIRECT" if reader.direct else "buffered after posix_fadvise(DONTNEED) (no O_DIRECT here)"
    stride = max(lay.stride for lay in reader.layouts)
    how = (
        f"ExpertReader: {len(per_read)} random whole-expert reads of {stride / 2**20:.2f} MiB with {mode} "
        f"on {threads} I/O threads in {wall:.2f} s, median {np.median(per_read):.2f} ms per read"
    )
    return nbytes / wall / 1e9, how


def _random_reads(reader: Any, depth: int) -> tuple[int, list[float], float]:
    """(bytes, ms of each read, wall s) of random expert reads kept ``depth`` deep on the reader's pool."""
    from moecast.runtime.tiers.offload import aligned_bytes

    rng = np.random.default_rng()  # not seeded: a probe run again must not re-read blocks a host just cached
    strides = [lay.stride for lay in reader.layouts]
    experts = int(reader.meta["num_experts"])
    bufs = [aligned_bytes(max(strides)) for _ in range(depth)]

    def timed(pos: int, expert: int, buf: Any) -> float:
        t = time.perf_counter()
        reader.read_into(pos, expert, buf)
        return (time.perf_counter() - t) * 1e3

    pending: deque[Future] = deque()
    per_read: list[float] = []
    nbytes, t0 = 0, time.perf_counter()
    while True:
        while len(pending) < depth and not _read_enough(t0, len(per_read) + len(pending), nbytes):
            pos, expert = int(rng.integers(len(strides))), int(rng.integers(experts))
            # the oldest read, done, had this buffer: at most ``depth`` are in flight
            buf = bufs[(len(per_read) + len(pending)) % depth][: strides[pos]].numpy()
            pending.append(reader.pool.submit(timed, pos, expert, buf))
            nbytes += strides[pos]
        if not pending:
            return nbytes, per_read, time.perf_counter() - t0
        per_read.append(pending.popleft().result())


def _read_enough(t0: float, reads: int, nbytes: int) -> bool:
    long_enough = time.perf_counter() - t0 >= MIN_READ_S and reads >= MIN_READS
    return long_enough or nbytes >= READ_BUDGET_MB << 20


# ----------------------------------------------------------------------------- predictor latency


def llapor_standin(num_layers: int, num_experts: int, top_k: int, seed: int = 0) -> Any:
    """A LLaPor of the default size with random weights: the per-layer computation of a trained one
    (ids of earlier layers and tokens, a token embedding, hidden 256), when no checkpoint is given."""
    import torch
    from moecast.predictors.llapor import LLaPor
    from moecast.predictors.llapor_features import FeatureSpec
    from moecast.predictors.llapor_net import LLaPorNet, NetConfig

    torch.manual_seed(seed)
    spec = FeatureSpec(
        num_layers=num_layers, num_experts=num_experts, top_k=top_k, prev_layers=2, history_tokens=2,
        token_buckets=4096, context_tokens=2, deep_history=True,
    )  # fmt: skip
    third = max(1, num_layers // 3)
    layers = list(range(num_layers))
    groups = {
        "input": layers[:third],
        "middle": layers[third:-third] or layers[:1],
        "output": layers[-third:],
    }
    return LLaPor(LLaPorNet(spec, groups, NetConfig()), list(range(1, num_layers + 1)))


def predictor_latency_ms(predictor: LayerAhead, hidden: int = 0, window: int = 16, repeat: int = 5) -> float:
    """Median ms of one layer-ahead call (``score_at``: one layer's features and network on the
    current token) over the predictor's layers, on a window of ``window`` earlier tokens, as the live
    runtime calls it: each call alone, right after a pass over more memory than the CPU's
    private caches hold (:func:`evict_caches`), as a layer's attention and experts leave them between
    two calls. In a hot loop the call's code, weights and the dispatcher stay cached, and it measured
    2-4x faster than the runtime's calls on a 2-core VM (bench/results/experiments.md)."""
    from moecast.collect.traceset import RequestTrace

    L, E, k = predictor.num_layers, predictor.num_experts, predictor.top_k
    rng = np.random.default_rng(0)
    T = window + 1
    ids = np.stack([[rng.choice(E, k, replace=False) for _ in range(L)] for _ in range(T)]).astype(np.int16)
    needs = predictor.needs
    trace = RequestTrace(
        request_id="profile", workload="profile", category="", prompt="",
        token_ids=rng.integers(0, 1000, T), token_texts=[""] * T, is_decode=np.ones(T, bool),
        topk_ids=ids, topk_weights=np.full((T, L, k), 1.0 / k, np.float16), router_probs=None,
        gate_inputs=rng.normal(size=(T, L, hidden)).astype(np.float32) if "gate_inputs" in needs else None,
    )  # fmt: skip
    for n in range(1, L):  # compiled and built once, as at attach (LayerAhead.warm)
        predictor.score_at(trace, n)
    times = []
    for _ in range(repeat):
        for n in range(1, L):  # the layers in the runtime's order, each after the caches were evicted
            evict_caches()
            t = time.perf_counter()
            predictor.score_at(trace, n)
            times.append(time.perf_counter() - t)
    return float(np.median(times)) * 1e3


#: bytes :func:`evict_caches` streams: past a core's L1 and L2 many times over (a layer of a
#: DeepSeek-V2-Lite-sized model streams ~20-70 MB of weights between two predictor calls)
EVICT_BYTES = 64 << 20
_evict: list[np.ndarray] = []


def evict_caches() -> None:
    """Read :data:`EVICT_BYTES` of memory, which leaves the CPU's private caches holding it instead of
    what the caller ran before (the buffer is kept: allocating it would fault its pages in each time)."""
    if not _evict:
        _evict.append(np.ones(EVICT_BYTES // 8, np.uint64))
    int(_evict[0].sum())


# ----------------------------------------------------------------------------- the model at hand


def check_latency_predictor(predictor: Any) -> None:
    """Refuse a predictor whose latency a profile cannot time: only a layer-ahead one is called per layer."""
    if predictor is not None and not isinstance(predictor, LayerAhead):
        raise InputError(
            f"the predictor latency is a layer-ahead predictor's per-layer call; {predictor.name} is "
            f"{predictor.horizon}: give a layer-ahead checkpoint (LLaPor) or none"
        )


def profile_model(
    model: Any,
    name: str = "local",
    predictor: Any = None,
    offload_dir: str | Path | None = None,
    disk_mb: int = 256,
    precisions: Sequence[Any] = (),
) -> tuple[HardwareProfile, dict[str, str]]:
    """The hardware profile for ``model`` on this machine, and how each figure was obtained.
    ``precisions`` (runtime/tiers/precision.py, quantized ones): each one's expert is also timed on the
    kernels the live runtime computes that precision with, into ``expert_ms`` where the CPU is the fast
    tier (the expert's bytes stay the model dtype's, which the cost model scales compute from)."""
    from moecast.collect.models import find_moe_structure, model_info

    check_latency_predictor(predictor)
    st = find_moe_structure(model)
    info = model_info(model, st, name)
    p = next(st.layers[0].experts.parameters())
    hidden = int(info.hidden_size)
    inter = max(1, info.expert_bytes // (3 * hidden * p.element_size()))
    dtype = str(p.dtype).replace("torch.", "")
    # what the runtime pays per expert: its calls of the family's implementation, glue included
    fit = implementation_expert_ms(st.layers[0].experts)
    if fit is not None:
        fit = (fit[0], fit[1], f"{dtype} expert {hidden}x{inter}: {fit[2]}")
    prof = measure(hidden, inter, name=name, dtype=dtype, cpu_expert=fit)
    how = {"expert": f"{dtype} {hidden}x{inter}", "cpu": prof.source}
    # times are for the model's own expert (its dtype), which replay scales from
    prof = replace(prof, attn_ms=_sig(dense_layer_ms(model)), ref_expert_bytes=int(info.expert_bytes))
    how["attn_ms"] = "the model's decode step with the routed experts skipped, per MoE layer"
    if predictor is None:
        predictor = llapor_standin(len(st.layers), info.num_experts, info.top_k)
        how["predictor_ms"] = "LLaPor of the default size, random weights (no --predictor)"
    else:
        how["predictor_ms"] = f"{predictor.name} checkpoint"
    prof = replace(prof, predictor_ms=_sig(predictor_latency_ms(predictor, hidden)))
    if offload_dir is not None:
        prof, disk_how = on_disk(prof, offload_dir, disk_mb, attn_measured=True)
        how.update(disk_how)
    prof, prec_how = precision_times(prof, st.layers[0].experts, precisions)
    how.update(prec_how)
    prof, dq_how = device_dequant_times(prof, st.layers[0].experts, precisions)
    how.update(dq_how)
    prof, load_how = device_load_host_ms(prof, st.layers[0].experts)
    how.update(load_how)
    prof.source += "; " + "; ".join(f"{k}: {v}" for k, v in how.items() if k not in ("cpu", "expert"))
    return prof, how


class ProfileWarning(UserWarning):
    """Something asked of the profile that it did not measure (said in one line)."""


def precision_times(
    prof: HardwareProfile, experts: Any, precisions: Sequence[Any]
) -> tuple[HardwareProfile, dict[str, str]]:
    """``prof`` with a resident expert's time at each quantized precision of ``precisions``
    (``expert_ms``): on a CPU fast tier the resident expert is the CPU expert at one token, timed on
    the precision's kernels (:func:`implementation_expert_ms`). A device computes its experts with
    kernels this probe does not time, so there the precisions are left out, and said so."""
    quantized = [q for q in precisions if q.quantized]
    if not quantized:
        return prof, {}
    if prof.fast_tier != "cpu":
        tags = ", ".join(q.tag for q in quantized)
        # said on a line of its own too: the note sits deep in the profile's source string
        warnings.warn(
            ProfileWarning(
                f"--expert-dtype {tags} not timed: this profile's experts compute on a device (a CUDA device, "
                "else another profile's: without CUDA, --offload-dir DIR profiles the CPU, which computes "
                "them, and times each precision)"
            ),
            stacklevel=2,
        )
        return prof, {
            "expert_ms": f"{tags} not timed: the probe times CPU kernels, and a device computes the experts"
        }
    times, how = dict(prof.expert_ms), {}
    for q in quantized:
        fit = implementation_expert_ms(experts, precision=q)
        if fit is None:
            continue
        times[q.tag] = _sig(fit[0] + fit[1])
        how[f"{q.tag} experts"] = fit[2]
    return replace(prof, expert_ms=times), how


def device_dequant_times(
    prof: HardwareProfile, experts: Any, precisions: Sequence[Any]
) -> tuple[HardwareProfile, dict[str, str]]:
    """:func:`dequant_times` on CUDA where the profile's device was measured here; without CUDA the
    device fields are another profile's, so a CPU's dequantize (tens of ms an expert) is not written
    over them: ``dequant_ms`` stays unmeasured (0), and the note says so."""
    import torch

    if not any(q.quantized for q in precisions) or torch.cuda.is_available():
        return dequant_times(prof, experts, precisions)
    return prof, {
        "dequant_ms": "not timed: no CUDA here, and the CPU's time would stand in for another device's"
    }


def device_load_host_ms(prof: HardwareProfile, experts: Any) -> tuple[HardwareProfile, dict[str, str]]:
    """``prof`` with ``load_host_ms`` (:func:`load_host_ms`) on CUDA where the profile's device was
    measured here; without CUDA it stays unmeasured (0): the CPU's copy calls would stand in for a
    device's issue."""
    import torch
    from moecast.runtime.tiers.base import Device

    if not torch.cuda.is_available():
        return prof, {"load_host_ms": "not timed: no CUDA here"}
    try:
        ms, how = load_host_ms(experts, Device.at("cuda"))
    except (RuntimeError, ValueError, InputError) as exc:
        # one figure of many: the profile stands without it (0, unmeasured), and says why
        why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        print(f"moecast profile: load_host_ms not measured ({why}); it stays 0", file=sys.stderr)
        return prof, {"load_host_ms": f"not timed: {why}"}
    return replace(prof, load_host_ms=_sig(ms)), {"load_host_ms": how}


def load_host_ms(experts: Any, device: Any, loads: int = 48, slots: int = 4) -> tuple[float, str]:
    """(ms, how) the host takes to issue one expert load to ``device`` (a
    :class:`~moecast.runtime.tiers.base.Device` with ``ops``) through the runtime's own
    :class:`~moecast.runtime.tiers.expert_store.LayerStore`: the median over ``loads`` loads into
    ``slots`` slots, each evicting the oldest resident, of the issue time the store counts for it
    (``issue_seconds``, what a live run reports as ``copy_issue_ms``: its events and the copy call,
    not a simulated device's own work; the copies run on the transfer stream meanwhile, waited for
    only at the end). The store packs a copy of ``experts``, so the model's own tensors stay as they
    are."""
    import copy

    from moecast.runtime.tiers.expert_store import LayerStore

    if device.ops is None:
        raise InputError(
            "load_host_ms times copies issued to an accelerator; this device copies synchronously"
        )
    module = copy.deepcopy(experts)
    n = int(module.num_experts)
    slots = max(1, min(slots, n - 1))
    store = LayerStore(module, slots, device.where, ops=device.ops)
    try:
        store.fill(range(slots))
        times, nxt = [], slots
        for i in range(max(loads, 1) + 1):
            evict, expert = int(store.expert_in[i % slots]), nxt % n
            nxt += 1
            before = store.issue_seconds
            store.load(expert, evict=evict)
            times.append(store.issue_seconds - before)
        store.settle(block=True)  # every copy landed before the store's buffers go
    finally:
        store.close()
    pinned = "staged through pinned buffers" if store.staged else "one copy an expert"
    # the first load warms the store's views and the copy path: not counted
    return float(np.median(times[1:])) * 1e3, (
        f"the runtime's store issuing {len(times) - 1} loads ({pinned}) into {slots} slots on "
        f"{device.where.type}, host time per load (median)"
    )


def dequant_times(
    prof: HardwareProfile, experts: Any, precisions: Sequence[Any], device: Any = None, repeat: int = 5
) -> tuple[HardwareProfile, dict[str, str]]:
    """``prof`` with ``dequant_ms``: per quantized precision of ``precisions``, the time to dequantize
    one of ``experts``' experts from its stored block into a model-dtype slot, as a load on an
    accelerator does (:class:`~moecast.runtime.tiers.precision.SlotDequantizer`), on ``device`` (default
    CUDA where present, else the CPU, which the note then names: its time stands in for a device's)."""
    import torch
    from moecast.runtime.tiers.expert_store import expert_params
    from moecast.runtime.tiers.precision import SlotDequantizer

    quantized = [q for q in precisions if q.quantized]
    if not quantized:
        return prof, {}
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    params = {n: t[:1] for n, t in expert_params(experts).items()}
    times = dict(prof.dequant_ms)
    for q in quantized:
        dq = SlotDequantizer(q, experts)
        block = torch.zeros(dq.stored.stride, dtype=torch.uint8)
        for name, t in dq.quantize(params).items():
            dq.stored.views(block, 1)[name].copy_(t)
        block = block.to(dev)
        slot = {n: torch.empty(t.shape[1:], dtype=t.dtype, device=dev) for n, t in params.items()}
        dq.prepare(dev)

        def once(dq=dq, block=block, slot=slot) -> None:
            dq(block, slot)
            _sync(dev)

        with torch.inference_mode():
            times[q.tag] = _sig(_time(once, repeat))
    tags = ", ".join(q.tag for q in quantized)
    return replace(prof, dequant_ms=times), {
        "dequant_ms": f"{tags}: one expert's block into a slot on {dev.type}"
    }


def implementation_expert_ms(
    experts: Any, token_counts=(1, 2, 4, 8, 16), repeat: int = 7, precision: Any = None
) -> tuple[float, float, str] | None:
    """(beta, C, how) of one expert as the live runtime computes it on the CPU: a call of the model's
    experts implementation on a :class:`~moecast.runtime.tiers.expert_store.SlotView` of the module's
    expert count, the views cycling over a cold ring of slots (more bytes than twice the last-level
    cache), one expert's tokens and the others' pairs marked with the sentinel. The call's own work
    (routing bookkeeping, the implementation's glue) is part of the figure, as it is of the runtime's. None for experts without per-expert weights.
    ``precision`` (quantized): the slots hold the precision's stored parts and the call is the
    runtime's quantized experts call on them."""
    import functools

    import torch
    from moecast.runtime.live.attach import _resolve_impl
    from moecast.runtime.tiers.expert_store import SlotView
    from moecast.runtime.tiers.precision import quantize_params, quantized_experts_forward

    params = {n: p for n, p in experts.named_parameters(recurse=False) if p.dim() >= 2}
    if not params:
        return None
    num = next(iter(params.values())).shape[0]
    dtype = next(iter(params.values())).dtype
    one = {k: torch.full((1, *p.shape[1:]), 0.01, dtype=p.dtype) for k, p in params.items()}
    if precision is not None and precision.quantized:
        one = quantize_params(precision, one, bool(getattr(experts, "is_transposed", False)))
        impl = functools.partial(quantized_experts_forward, precision)
    else:
        impl = _resolve_impl(experts.config._experts_implementation, experts)
    set_bytes = sum(t[0].numel() * t.element_size() for t in one.values())
    # views of the module's expert count (full residency's slots): an implementation's call costs more
    # with every slot it is given (grouped_mm walks all of them), so one view over the whole ring would
    # charge each call for hundreds of slots no runtime holds; the ring is whole views, cycled in turn
    ring = ring_size(set_bytes)
    w_slots = min(num, ring)
    n = -(-ring // w_slots) * w_slots
    slots = {k: t.expand(n, *t.shape[1:]).contiguous() for k, t in one.items()}
    views = [
        SlotView(experts, {k: t[i : i + w_slots] for k, t in slots.items()}, w_slots, True)
        for i in range(0, n, w_slots)
    ]
    hidden = int(experts.config.hidden_size)
    k = int(getattr(experts.config, "num_experts_per_tok", 2) or 2)
    turn = itertools.count()
    ms = []
    with torch.inference_mode():
        for m in token_counts:
            x = torch.full((m, hidden), 0.01, dtype=dtype)
            ids = torch.full((m, k), w_slots, dtype=torch.int64)
            w = torch.full((m, k), 1.0 / k, dtype=dtype)

            def call(x=x, ids=ids, w=w) -> None:
                j = next(turn) % n  # the ring's next slot: its weights come from DRAM
                ids[:, 0] = j % w_slots
                impl(views[j // w_slots], x, ids, w)

            ms.append(_time(call, repeat))
    beta, c = np.polyfit(np.asarray(token_counts, dtype=float), np.asarray(ms), 1)
    what = (
        f"the {precision.tag} experts call"
        if precision is not None and precision.quantized
        else f"the model's {experts.config._experts_implementation or 'eager'} experts implementation"
    )
    _say_scatter(what, token_counts, ms, float(beta), float(c))
    how = (
        f"{what} on slot views of {w_slots} slots, one expert per call, over a ring of {n} slots "
        f"({n * set_bytes / 2**20:.0f} MiB; {num} experts)"
    )
    return max(float(beta), 1e-6), max(float(c), 0.0), how


def _say_scatter(what: str, token_counts: Sequence[int], ms: Sequence[float], beta: float, c: float) -> None:
    """A line where a time per call is more than 100 % off the fit ``beta t + C``: an expert's time grows
    smoothly with its tokens, so such a point is a busy host's (another process on a core made a 25 KB
    int8 expert take 25 ms), and the profile's figure would be wrong."""
    fit = [max(beta * t + c, 1e-9) for t in token_counts]
    worst = max(abs(m - f) / f for m, f in zip(ms, fit))
    if worst > 1.0:
        times = ", ".join(f"{m:.3g}" for m in ms)
        off = f"{worst:.0%}" if worst < 10 else "over 1000%"  # a fit through zero makes any ratio huge
        warnings.warn(
            ProfileWarning(
                f"{what}: its times per call ({times} ms at {', '.join(map(str, token_counts))} tokens) lie up "
                f"to {off} off their line, as on a busy host; profile again with the machine quiet"
            ),
            stacklevel=3,
        )


@contextlib.contextmanager
def cpu_busy(expert_bytes: int, sets: int = 8) -> Iterator[None]:
    """A background thread computing bf16 experts of ``expert_bytes`` (one token each, over ``sets``
    distinct weight sets, with torch's threads) for as long as the block runs."""
    import torch

    hidden = 2048
    inter = max(1, expert_bytes // (3 * hidden * 2))
    ring = [tuple(torch.full(s, 0.01, dtype=torch.bfloat16) for s in ((inter, hidden),) * 2 + ((hidden, inter),))
            for _ in range(sets)]  # fmt: skip
    x = torch.full((1, hidden), 0.01, dtype=torch.bfloat16)
    stop = threading.Event()

    def work() -> None:
        with torch.inference_mode():
            for w in itertools.cycle(ring):
                if stop.is_set():
                    return
                _swiglu(x, w)

    th = threading.Thread(target=work, name="moecast-profile-busy", daemon=True)
    th.start()
    try:
        yield
    finally:
        stop.set()
        th.join()


@contextlib.contextmanager
def _block_reads(directory: Path, block_bytes: int) -> Iterator[tuple[Any, int]]:
    """(read one block, its bytes): a random whole expert of the offload in ``directory`` read as
    the runtime reads it, or where it holds none, a block of a temporary file (O_DIRECT where the
    filesystem takes it), removed afterwards."""
    from moecast.runtime.tiers.offload import ExpertReader, _read_meta, aligned_bytes

    local = threading.local()  # each reading thread's buffer and generator (a Generator is not thread-safe)

    def rng() -> np.random.Generator:
        if not hasattr(local, "rng"):
            local.rng = np.random.default_rng()
        return local.rng

    meta = _read_meta(directory) if directory.is_dir() else None
    if meta is not None:
        reader = ExpertReader(directory, meta, 1)
        stride = max(lay.stride for lay in reader.layouts)
        experts = int(meta["num_experts"])

        def read() -> None:
            if not hasattr(local, "buf"):
                local.buf = aligned_bytes(stride).numpy()
            pos = int(rng().integers(len(reader.layouts)))
            reader.read_into(pos, int(rng().integers(experts)), local.buf[: reader.layouts[pos].stride])

        try:
            yield read, stride
        finally:
            reader.close()
        return
    block = max(_ALIGN, -(-block_bytes // _ALIGN) * _ALIGN)
    blocks = 16
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f".moecast-profile-reads-{os.getpid()}.bin"
    with path.open("wb") as f:
        f.write(np.random.default_rng(0).integers(0, 256, block * blocks, dtype=np.uint8).tobytes())
        f.flush()
        os.fsync(f.fileno())
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
    except OSError:
        fd = os.open(path, os.O_RDONLY)
    try:

        def read_file() -> None:
            if not hasattr(local, "buf"):
                local.buf = aligned_bytes(block).numpy()  # the runtime's buffers (aligned, huge pages)
            try:
                os.preadv(fd, [local.buf], int(rng().integers(blocks)) * block)
            except OSError:  # a filesystem that accepts the flag and refuses the read
                with open(path, "rb", buffering=0) as g:
                    g.readinto(local.buf)

        yield read_file, block
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)


READ_CPU_BUDGET_S = 15.0  # the read-cost probe stops after this long whatever its interval says,
READ_CPU_REL = 0.2  # or once its 95 % interval lies within this fraction of its estimate
READ_CPU_FLOOR_MS = 0.01  # (or of this, for a cost near 0, which has no relative width)
READ_CPU_MIN_S = 2.0  # and not before this long and this many reads (the interrupt time comes in
READ_CPU_MIN_READS = 64  # ticks of 10 ms, a few per 100 reads)


@dataclass(frozen=True)
class ReadCost:
    """The CPU time of one read (ms): the reading thread's (its median over the reads, with the
    median's 95 % interval) and the interrupts' (the machine's interrupt ticks over the reads, with
    a Poisson count's 95 % half-width)."""

    thread_ms: float
    low: float
    high: float
    irq_ms: float
    irq_half: float
    reads: int

    @property
    def ms(self) -> float:
        return self.thread_ms + self.irq_ms

    @property
    def half(self) -> float:
        """The interval's half-width: the wider side of the median's plus the interrupts'."""
        return max(self.thread_ms - self.low, self.high - self.thread_ms) + self.irq_half

    def settled(self, rel: float, floor: float) -> bool:
        """Whether the interval lies within ``rel`` of the estimate or ``floor`` ms."""
        return self.half <= max(rel * self.ms, floor)


def median_interval(x: np.ndarray, alpha: float = 0.05) -> tuple[float, float]:
    """The distribution-free ``1 - alpha`` interval of the median of ``x``: the order statistics
    ``r`` and ``n + 1 - r`` (1-based) for the largest ``r`` with ``2 P(Binomial(n, 1/2) <= r - 1) <=
    alpha`` (:func:`_median_rank`); (-inf, inf) where ``x`` is too short for one (n < 6 at 95 %)."""
    n, x = len(x), np.sort(x)
    r = _median_rank(n, alpha)
    return (float(x[r - 1]), float(x[n - r])) if r else (-math.inf, math.inf)


def _median_rank(n: int, alpha: float) -> int:
    """:func:`median_interval`'s ``r``: exact up to 60 samples, past that the normal approximation
    with continuity correction (a probe's thousands of reads would make the exact sum slow)."""
    if n > 60:
        z = NormalDist().inv_cdf(1 - alpha / 2)
        return max(0, math.floor(n / 2 + 0.5 - z * math.sqrt(n) / 2))
    r, tail = 0, 0.0
    while r < n // 2 and 2 * (tail + math.comb(n, r) / 2**n) <= alpha:
        tail += math.comb(n, r) / 2**n
        r += 1
    return r


def read_cost(thread_ms: list[float], irq_ticks: int | None, tick_ms: float) -> ReadCost:
    """:class:`ReadCost` of reads whose reading threads spent ``thread_ms`` of CPU each, while the
    machine counted ``irq_ticks`` ticks of ``tick_ms`` in interrupts (None: not known here, 0). The
    median, not the mean: a thread preempted inside its read is charged no CPU for the wait, but a
    page fault or a migration in one read would move a mean."""
    x = np.asarray(thread_ms, float)
    if not len(x):
        return ReadCost(0.0, -math.inf, math.inf, 0.0, math.inf, 0)
    low, high = median_interval(x)
    ticks = irq_ticks or 0
    irq, irq_half = ticks * tick_ms / len(x), 2 * math.sqrt(max(ticks, 1)) * tick_ms / len(x)
    return ReadCost(
        max(float(np.median(x)), 0.0), low, high, irq, irq_half if irq_ticks is not None else 0.0, len(x)
    )


def _irq_ticks() -> int | None:
    """Ticks the machine has spent in hard and soft interrupts (/proc/stat), None where unreadable."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        return int(fields[6]) + int(fields[7])
    except (OSError, IndexError, ValueError):
        return None


@contextlib.contextmanager
def _reading(read: Any, threads: int) -> Iterator[None]:
    """``threads`` threads calling ``read`` back to back for as long as the block runs."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            read()

    pool = [threading.Thread(target=loop, name="moecast-profile-read", daemon=True) for _ in range(threads)]
    for th in pool:
        th.start()
    try:
        yield
    finally:
        stop.set()
        for th in pool:
            th.join()


def read_compute_ms(
    directory: str | Path, expert_bytes: int, threads: int | None = None, budget_s: float | None = None
) -> tuple[float, str]:
    """(ms per expert of ``expert_bytes``, how): :func:`read_cpu_probe`'s estimate and how it was made."""
    probe = read_cpu_probe(directory, expert_bytes, threads, budget_s)
    return probe.ms, probe.how


@dataclass(frozen=True)
class ReadProbe:
    """What :func:`read_cpu_probe` measured: ms of CPU per expert read, the reads timed, the wall time
    they took (s) and how the estimate was made."""

    ms: float
    reads: int
    wall_s: float
    how: str


def read_cpu_probe(
    directory: str | Path, expert_bytes: int, threads: int | None = None, budget_s: float | None = None
) -> ReadProbe:
    """The compute time one expert read of ``expert_bytes`` takes from the
    cores (the profile's ``read_cpu_ms``), measured as CPU time, which other work on the machine
    does not inflate (a wall-clock slowdown of compute beside the reads varied 20-fold between runs
    on a shared 2-core machine).

    ``threads`` threads read whole experts from ``directory``'s disk back to back (as
    :func:`_block_reads` reads them) while the CPU computes experts (:func:`cpu_busy`), as the
    runtime's reads run; each read's CPU time on its thread is timed, and the machine's interrupt
    time over the reads is shared out (:func:`read_cost`), scaled from the block read to
    ``expert_bytes`` (a read's work is per page). Reads go on for READ_CPU_MIN_S and
    READ_CPU_MIN_READS at least, until the 95 % interval lies within READ_CPU_REL of the estimate
    (or READ_CPU_FLOOR_MS) or ``budget_s`` (READ_CPU_BUDGET_S) has passed."""
    from moecast.runtime.tiers.offload import IO_THREADS

    threads = IO_THREADS if threads is None else max(1, int(threads))
    budget = READ_CPU_BUDGET_S if budget_s is None else budget_s
    tick_ms = 1e3 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 10.0
    samples: list[float] = []
    with cpu_busy(expert_bytes), _block_reads(Path(directory), expert_bytes) as (read, nbytes):

        def timed() -> None:
            t = time.thread_time()
            read()
            samples.append((time.thread_time() - t) * 1e3)

        read()  # the reader's first open and buffer
        scale = expert_bytes / nbytes
        with _reading(timed, threads):
            cost, wall = _until_settled(samples, tick_ms, budget, READ_CPU_FLOOR_MS / scale)
    settled = cost.settled(READ_CPU_REL, READ_CPU_FLOOR_MS / scale)
    how = (
        f"CPU time of {cost.reads} reads of {nbytes / 2**20:.2f} MiB on {threads} threads beside experts computed: "
        f"the reading thread's median {cost.thread_ms * scale:.3g} ms (95 % interval {cost.low * scale:.3g} to "
        f"{cost.high * scale:.3g}) plus the machine's interrupts {cost.irq_ms * scale:.3g} ms per read, "
        f"{'settled' if settled else f'the {budget:g} s budget spent'} in {wall:.1f} s; scaled to the profile's expert"
    )
    return ReadProbe(cost.ms * scale, cost.reads, wall, how)


def _until_settled(
    samples: list[float], tick_ms: float, budget_s: float, floor: float
) -> tuple[ReadCost, float]:
    """(:func:`read_cost` of ``samples`` as reads append to it, s) once it settles (READ_CPU_REL or
    ``floor`` ms, after READ_CPU_MIN_S and READ_CPU_MIN_READS) or ``budget_s`` has passed."""
    t0, ticks0 = time.perf_counter(), _irq_ticks()
    while True:
        time.sleep(0.25)
        ticks, wall = _irq_ticks(), time.perf_counter() - t0
        cost = read_cost(list(samples), None if ticks0 is None or ticks is None else ticks - ticks0, tick_ms)
        enough = wall >= READ_CPU_MIN_S and cost.reads >= READ_CPU_MIN_READS
        if wall >= budget_s or (enough and cost.settled(READ_CPU_REL, floor)):
            return cost, wall


def on_disk(
    prof: HardwareProfile, offload_dir: str | Path, disk_mb: int = 256, attn_measured: bool = False
) -> tuple[HardwareProfile, dict[str, str]]:
    """``prof`` for experts that live in ``offload_dir``, and how its new figures were obtained.

    The slow tier is the disk, whose read bandwidth is measured (:func:`disk_read_gbps`, in blocks
    of ``prof``'s expert). With CUDA the link is the slower of the host-to-device copy and the disk.
    Without it the fast tier is the CPU: the link is the disk itself, and a resident expert is
    computed by the CPU at one token (beta + C); of the reference device's figures only its
    attention time is left, unless ``attn_measured`` (the model at hand), and the source says so."""
    import torch

    cuda = torch.cuda.is_available()
    if cuda:
        gbps, method = disk_read_gbps(offload_dir, disk_mb, block_bytes=prof.ref_expert_bytes)
    else:
        # the runtime reads while the CPU computes experts; on a small machine the I/O threads then
        # wait for a core, and the disk delivers less than it does to an idle probe
        with cpu_busy(prof.ref_expert_bytes):
            gbps, method = disk_read_gbps(offload_dir, disk_mb, block_bytes=prof.ref_expert_bytes)
        method += ", while the CPU computes experts (as the runtime's reads run)"
    disk = _sig(gbps)
    how = {"disk_read_gbps": f"{method}, in {offload_dir}"}
    read_cpu = 0.0
    if not cuda:  # the cores that compute also serve the reads (a device's copies leave them alone)
        read_cpu, how["read_cpu_ms"] = read_compute_ms(offload_dir, prof.ref_expert_bytes)
    if cuda:
        how["tiers"] = (
            "device and disk: the link is the slower of the host-to-device copy and the disk's reads"
        )
        return replace(
            prof, disk_read_gbps=disk, slow_tier="disk", transfer_gbps=min(prof.transfer_gbps, disk)
        ), how
    how["tiers"] = (
        "cpu and disk: the link is the disk's reads (transfer_gbps = disk_read_gbps) and a resident expert "
        "is the CPU expert at one token (gpu_expert_ms = cpu_beta_ms + cpu_c_ms)"
    )
    no_cuda = "" if attn_measured else ": attention time taken from prescope-a100-pcie4"
    return replace(
        prof,
        disk_read_gbps=disk,
        read_cpu_ms=_sig(read_cpu),
        transfer_gbps=disk,
        gpu_expert_ms=_sig(prof.cpu_beta_ms + prof.cpu_c_ms),
        fast_tier="cpu",
        slow_tier="disk",
        source=prof.source.replace(NO_CUDA, "; no CUDA here" + no_cuda),
    ), how


def calibrate(prof: HardwareProfile, stats: dict[str, Any], num_layers: int) -> HardwareProfile:
    """``prof`` with the rates a live run measured (:meth:`LiveRuntime.stats` after decode steps), for a
    CPU fast tier, where every part of a step is host wall time:

    - the link: the disk's read rate while a read was in flight (``disk_read_gbps_observed``);
    - one expert: the decode steps' expert compute over the experts they computed (``routed`` uses;
      at one token per step each use is one expert call), the calls' glue included; a run of two
      copies (``expert_dtype`` ``high+low``, runtime/core/mixed.py) times each copy's calls apart
      (``expert_compute_by_copy``: seconds and uses per copy tag), so each copy's time is its own
      seconds over its own uses, and a copy no use computed at keeps ``prof``'s;
    - the rest of a layer (``attn_ms``): the step's time outside the experts' compute, transfer waits
      and the predictor (attention, dense layers, the routing reads' wait for the device, the
      runtime's own host work), per MoE layer, less
      what follows the last layer's experts, which is the step's own (``step_ms``: the final norm
      and the LM head, in no prefetch window);
    - the predictor's latency per layer as the runtime calls it (features of the live window
      included), where the run predicted (else ``prof``'s).

    The replay under it models other requests on this machine as the live runtime runs them
    (bench/bench_tiers.py calibrates on requests it does not measure)."""
    if prof.fast_tier != "cpu":
        return calibrate_device(prof, stats, num_layers)
    steps, routed = stats.get("decode_steps") or 0, stats.get("routed") or 0
    if not steps or not routed:
        raise InputError(
            "calibration needs decode steps measured by the live runtime; decode a few tokens first"
        )
    tag = stats.get("expert_dtype", "model")
    if "+" in tag:
        rates = _copy_rates(prof, tag, stats.get("expert_compute_by_copy"))
    else:
        rates = _expert_rates(prof, tag, stats["expert_compute_ms"] * steps / routed)
    gbps = stats.get("disk_read_gbps_observed") or prof.transfer_gbps
    after = stats.get("after_layers_ms") or 0.0
    if not math.isfinite(after):
        after = 0.0
    return replace(
        prof,
        name=prof.name + "-calibrated",
        transfer_gbps=_sig(gbps),
        disk_read_gbps=_sig(gbps),
        **rates,
        attn_ms=_sig(
            max(stats["attention_ms"] + stats["policy_ms"] + stats.get("device_sync_ms", 0.0) - after, 0.0)
            / num_layers
        ),
        step_ms=_sig(after),
        predictor_ms=_sig(stats["predictor_ms"] / num_layers)
        if stats.get("predictor_ms")
        else prof.predictor_ms,
        source=prof.source
        + f"; calibrated on a live run of {steps} decode steps (moecast.runtime.profile.measure.calibrate)",
    )


def _copy_rates(
    prof: HardwareProfile, tag: str, by_copy: dict[str, dict[str, float]] | None
) -> dict[str, Any]:
    """The profile fields a run of two copies (``tag``: ``high+low``) sets: each copy's expert time
    from its own decode compute seconds over its own uses (``by_copy``: the live stats'
    ``expert_compute_by_copy``); a copy with no use keeps ``prof``'s."""
    if by_copy is None:
        raise InputError(
            f"the run at two expert copies ({tag}) did not time each copy's expert compute "
            "(stats without expert_compute_by_copy): rerun it with this version's live runtime"
        )
    out: dict[str, Any] = {"expert_ms": dict(prof.expert_ms)}
    for copy in tag.split("+"):
        got = by_copy.get(copy) or {}
        if got.get("uses"):
            rates = _expert_rates(prof, copy, got["s"] * 1e3 / got["uses"])
            out["expert_ms"].update(rates.pop("expert_ms", {}))
            out.update(rates)
    return out


def _expert_rates(prof: HardwareProfile, tag: str, expert: float) -> dict[str, Any]:
    """The profile fields one expert call of ``expert`` ms at precision ``tag`` sets on a CPU fast tier:
    the model dtype's ``gpu_expert_ms`` and ``cpu_c_ms``, or the precision's ``expert_ms`` entry."""
    if tag == "model":
        return {"gpu_expert_ms": _sig(expert), "cpu_c_ms": _sig(max(expert - prof.cpu_beta_ms, 0.0))}
    return {"expert_ms": {**prof.expert_ms, tag: _sig(expert)}}


def calibrate_device(prof: HardwareProfile, stats: dict[str, Any], num_layers: int) -> HardwareProfile:
    """``prof`` (resident experts computed on a device) calibrated on a live run with every expert
    resident (no transfer, no miss): what a layer costs beyond its experts' kernels.

    On a device the host timers cannot split a step (its kernels run asynchronously), but an
    all-resident step is modeled as ``L * (attn + n * t_g) + step_ms`` (runtime/core/step.py with no
    load), ``n`` the experts a layer computes: so ``attn_ms = (tpot - step_ms) / L - n * t_g``, with
    ``t_g`` the profile's kernel time (CUDA events) at the run's expert size. It takes the runtime's
    host work and the routing reads' waits with it, which no probe sees. The link keeps the profile's
    CUDA-event copy bandwidth; the predictor's latency is the run's, where it predicted."""
    steps, routed = stats.get("decode_steps") or 0, stats.get("routed") or 0
    if not steps or not routed:
        raise InputError(
            "calibration needs decode steps measured by the live runtime; decode a few tokens first"
        )
    if stats.get("loads") or stats.get("cpu_experts") or stats.get("expert_dtype", "model") != "model":
        raise InputError(
            f"profile {prof.name!r} computes resident experts on a device: calibrate it on a run with every "
            "expert resident at the model's dtype (capacity=None), where no transfer or CPU expert hides in the step"
        )
    after = stats.get("after_layers_ms") or 0.0
    after = after if math.isfinite(after) else 0.0
    t_g = prof.gpu_expert_ms * stats.get("expert_bytes", prof.ref_expert_bytes) / prof.ref_expert_bytes
    per_layer = (stats["measured_tpot_ms"] - after) / num_layers - routed / (steps * num_layers) * t_g
    return replace(
        prof,
        name=prof.name + "-calibrated",
        attn_ms=_sig(max(per_layer, 0.0)),
        step_ms=_sig(after),
        predictor_ms=_sig(stats["predictor_ms"] / num_layers)
        if stats.get("predictor_ms")
        else prof.predictor_ms,
        source=prof.source + f"; calibrated on an all-resident live run of {steps} decode steps "
        "(moecast.runtime.profile.measure.calibrate_device)",
    )


def calibrate_live(
    model: Any,
    prof: HardwareProfile,
    offload_dir: str | Path,
    tokens: int,
    capacity: float = 0.25,
    prompt: int = 8,
    precision: Any = None,
) -> HardwareProfile:
    """``prof`` calibrated (:func:`calibrate`) on a live run of ``model`` with its experts in
    ``offload_dir``: LRU at ``capacity``, a prefill of ``prompt`` tokens, then ``tokens`` greedy decode
    steps. The experts are written into the directory first where it holds none."""
    import torch
    from moecast.collect.models import find_moe_structure
    from moecast.runtime.live.runtime import attach

    if tokens < 1:
        raise InputError(f"calibration decodes at least one token, got {tokens}")
    vocab = int(model.config.vocab_size)
    ids = (torch.arange(prompt)[None] * 7919 + 13) % vocab  # a fixed prompt: the rates, not the text, matter
    rt = attach(
        model,
        capacity=capacity,
        offload="disk",
        offload_dir=str(offload_dir),
        hardware=prof,
        policy="lru",
        **(precision.settings() if precision is not None else {}),
    )
    try:
        with torch.inference_mode():
            out = model(input_ids=ids, use_cache=True)
            for _ in range(tokens):
                nxt = out.logits[:, -1:].argmax(-1)
                out = model(input_ids=nxt, **with_cache(model, kv_cache(out)), use_cache=True)
        stats = rt.stats()
    finally:
        rt.detach()
    return calibrate(prof, stats, len(find_moe_structure(model).layers))


def table(prof: HardwareProfile, nbytes: dict[str, int] | None = None) -> str:
    """The profile as a printed table (ms unless said otherwise; ``nbytes``: an expert's bytes at each
    precision of ``expert_ms``, where known)."""
    rows = [
        ("host-to-device bandwidth", f"{prof.transfer_gbps:g} GB/s"),
        (
            "disk direct-read bandwidth",
            f"{prof.disk_read_gbps:g} GB/s" if prof.disk_read_gbps else "not measured",
        ),
        ("device time per expert (t_g)", f"{prof.gpu_expert_ms:g} ms"),
        ("CPU expert: beta per token", f"{prof.cpu_beta_ms:g} ms"),
        ("CPU expert: C (start-up)", f"{prof.cpu_c_ms:g} ms"),
        ("attention / dense per layer", f"{prof.attn_ms:g} ms"),
        ("predictor per layer", f"{prof.predictor_ms:g} ms"),
        ("compute time one read takes from the cores", f"{prof.read_cpu_ms:g} ms"),
        (
            "host time to issue one load (device)",
            f"{prof.load_host_ms:g} ms" if prof.load_host_ms else "not measured",
        ),
        ("expert bytes", f"{prof.ref_expert_bytes:,}"),
    ]
    for tag, ms in prof.expert_ms.items():
        size = f", {nbytes[tag]:,} bytes" if nbytes and tag in nbytes else ""
        rows.append((f"resident expert at {tag}", f"{ms:g} ms{size}"))
    w = max(len(r[0]) for r in rows)
    return "\n".join(f"  {k:<{w}}  {v}" for k, v in rows)
