"""What a live run counts and how long its parts take: :class:`LiveStats`, :class:`ForwardTimes` and
:func:`runtime_stats` (``LiveRuntime.stats()``)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
from moecast.runtime.core.mixed import bytes_by_copy
from moecast.runtime.tiers.offload import peak_rss_mb

if TYPE_CHECKING:
    from moecast.runtime.live.runtime import LiveRuntime

#: the per-layer breakdown of a decode step's wall time, as LiveStats lists and as_dict means
BREAKDOWN = ("attention", "expert_compute", "transfer_wait", "device_sync", "predictor", "policy")


class StreamWaits:
    """Device time the compute stream waits for expert copies: the stream wait of each call's kernels.

    Around each wait for slots' copies a timing event goes on the compute stream before and after it;
    the time between them is how long the device's kernels stood waiting for the copies (CUDA's
    ``elapsed_time``; the simulated device's timeline). Nothing is read inside a forward (the host
    never waits for the device there); :meth:`settle` reads the forward's pairs at its end, so a
    step's waits count in that step, the one its wall time (the TPOT) covers, the last step's too.
    ``ops`` None: copies are synchronous, the host's wall time counts them instead (``ForwardTimes.waited``).
    """

    def __init__(self, ops: Any) -> None:
        self.ops = ops
        self.pending: list[tuple[Any, Any, bool]] = []  # (before, after, in a decode step)

    def around(self, wait: Callable[[Any], None], slots: Any, decode: bool) -> None:
        """``wait(slots)`` (it queues the compute stream's waits), timed on the compute stream."""
        if self.ops is None:
            wait(slots)
            return
        compute = self.ops.current()
        before, after = self.ops.event(timing=True), self.ops.event(timing=True)
        before.record(compute)
        wait(slots)
        after.record(compute)
        self.pending.append((before, after, decode))

    def settle(self) -> float:
        """Milliseconds the decode-step pairs recorded so far waited, every pair read now.

        The host waits once, for the last pair's end: the pairs are on the compute stream, which
        passes them in order, so the others are done then. At a step's end this wait ends before the
        step's token can be read (the LM head follows it on the compute stream), which the caller
        waits for next anyway: it adds no synchronisation a decode step does not already make."""
        if not self.pending:
            return 0.0
        self.pending[-1][1].synchronize()
        ms = 0.0
        for before, after, decode in self.pending:
            if not after.query():  # another stream's (none today): wait for it too
                after.synchronize()
            if decode:
                ms += before.elapsed_time(after)
        self.pending = []
        return ms

    def drop(self) -> None:
        """Forget the pairs recorded so far unread (a prefill's: no step's split counts them)."""
        self.pending = []


class ForwardTimes:
    """One forward's wall time by part (seconds): the experts calls (``layers``) and, inside them, expert
    compute, transfer waits, the device sync and predictor calls; the rest of a call is the policy's.

    ``waited`` reads the tier's host time spent on transfers: a part's time excludes the waits inside
    it, which count as ``transfer_wait``. ``streams`` times the device's own waits for copies (``ops``:
    the device's stream calls, None without an accelerator).
    """

    def __init__(self, waited: Callable[[], float], ops: Any = None) -> None:
        self.waited = waited
        self.streams = StreamWaits(ops)
        self.begin()

    def begin(self, decode: bool = False) -> None:
        """A forward starts now (``decode``: a decode step); the stream waits of the one before it that
        no split read (a prefill's) are dropped, so none is counted in another forward."""
        self.streams.drop()
        self.acc = dict.fromkeys(("layers", *BREAKDOWN[1:-1]), 0.0)
        self.by_copy: dict[str, list[float]] = {}  # two copies: tag -> [expert compute s, uses]
        self.t0 = self.layer_end = time.perf_counter()
        self.decode = decode

    def stream_wait(self, wait: Callable[[Any], None], slots: Any) -> None:
        """``wait(slots)``: the compute stream waits for the slots' copies, its device time measured."""
        self.streams.around(wait, slots, self.decode)

    def timed(self, part: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """``fn(*args)``, its wall time added to ``part`` less the transfer waits inside it (counted apart)."""
        t0, w0 = time.perf_counter(), self.waited()
        try:
            return fn(*args, **kwargs)
        finally:
            self.acc[part] += time.perf_counter() - t0 - (self.waited() - w0)

    def timed_copy(self, tag: str, uses: int, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """:meth:`timed` as ``expert_compute``, its time and the ``uses`` it computes also counted at
        copy ``tag`` (two copies: every use of the call is at that copy)."""
        before = self.acc["expert_compute"]
        try:
            return self.timed("expert_compute", fn, *args, **kwargs)
        finally:
            got = self.by_copy.setdefault(tag, [0.0, 0])
            got[0] += self.acc["expert_compute"] - before
            got[1] += uses

    @contextmanager
    def layer(self) -> Iterator[None]:
        """An experts call (or work counted with them): its wall time, and the transfer waits in it."""
        t0, w0 = time.perf_counter(), self.waited()
        try:
            yield
        finally:
            self.layer_end = time.perf_counter()
            self.acc["layers"] += self.layer_end - t0
            self.acc["transfer_wait"] += self.waited() - w0


@dataclass
class LiveStats:
    """Counters since attach (or :meth:`LiveRuntime.reset_stats`); rates are derived in :meth:`as_dict`."""

    decode_steps: int = 0
    prefill_steps: int = 0
    routed: int = 0  # (token, layer, expert) uses the router chose in decode steps
    cpu_uses: int = 0  # token uses of the experts computed on the CPU
    plans_learned: int = 0  # planned prompts whose prefill EP went to the planner's buffer (CasMoE)
    plans_folded: int = 0  # of those, the ones that filled the buffer and were folded into the index
    online_updates: int = 0  # PreScope §4.2.2 continual-learning steps taken on decoded tokens
    online_loss: float = float("nan")  # the predictor's loss on the latest decoded token, before its update
    host_syncs: int = 0  # device-to-host reads the experts calls waited for (one per layer and step)
    measured_decode_ms: list[float] = field(default_factory=list)
    modeled_decode_ms: list[float] = field(default_factory=list)
    measured_prefill_ms: float = 0.0
    # per decode step (ms): everything outside the experts calls (attention, dense, router, head), the
    # experts' arithmetic, host time blocked on transfers, the routing reads' wait for the device (on
    # a GPU the device finishing what was queued before them; on a CPU a copy), predictor calls, and
    # the rest of the calls (the policy's decisions)
    attention_decode_ms: list[float] = field(default_factory=list)
    expert_compute_decode_ms: list[float] = field(default_factory=list)
    transfer_wait_decode_ms: list[float] = field(default_factory=list)
    device_sync_decode_ms: list[float] = field(default_factory=list)
    predictor_decode_ms: list[float] = field(default_factory=list)
    policy_decode_ms: list[float] = field(default_factory=list)
    # per decode step (ms): after the last MoE layer's experts (its shared experts, final norm, LM head)
    after_layers_decode_ms: list[float] = field(default_factory=list)
    # per decode step (ms): the device's kernels waiting for their experts' copies (events on the compute
    # stream; 0 without an accelerator, whose copies the host makes: transfer_wait counts them)
    stream_wait_decode_ms: list[float] = field(default_factory=list)
    modeled_prefill_ms: float = 0.0
    # two copies, over decode steps: each copy's (tag's) expert compute seconds and the routed uses
    # computed at it (hits on its slots; the low copy's also the demand loads and the CPU set)
    expert_compute_by_copy: dict[str, dict[str, float]] = field(default_factory=dict)

    def clear(self) -> None:
        """Back to zero, in place (the executor holds this object)."""
        self.__dict__.update(vars(LiveStats()))

    def add_breakdown(self, wall: float, times: ForwardTimes) -> None:
        """One decode step's wall time (ms) split: outside the experts calls, and inside them by kind.

        Called at the step's end, after its wall time was taken: the step's stream waits are read
        here, all of them (:meth:`StreamWaits.settle`), so each step's parts cover its own work."""
        acc = {k: v * 1e3 for k, v in times.acc.items()}
        inner = acc["expert_compute"] + acc["transfer_wait"] + acc["device_sync"] + acc["predictor"]
        # the device's wait for copies delays what follows it on the compute stream, which the host sees
        # where it next reads the device (device_sync): that much of the sync was the transfers'
        stream = times.streams.settle()
        moved = min(stream, acc["device_sync"])
        self.attention_decode_ms.append(max(0.0, wall - acc["layers"]))
        self.expert_compute_decode_ms.append(acc["expert_compute"])
        self.transfer_wait_decode_ms.append(acc["transfer_wait"] + moved)
        self.device_sync_decode_ms.append(acc["device_sync"] - moved)
        self.stream_wait_decode_ms.append(stream)
        self.predictor_decode_ms.append(acc["predictor"])
        self.policy_decode_ms.append(max(0.0, acc["layers"] - inner))
        for tag, (sec, uses) in times.by_copy.items():
            got = self.expert_compute_by_copy.setdefault(tag, {"s": 0.0, "uses": 0})
            got["s"] += sec
            got["uses"] += int(uses)

    def as_dict(self, step: dict[str, np.ndarray]) -> dict[str, Any]:
        """The counters, the per-layer step's (``step``: LayerStep.stats) under replay's names, and rates."""
        d = {k: v for k, v in asdict(self).items() if not isinstance(v, list)}
        t = {name: int(v.sum()) for name, v in step.items() if name != "time"}
        d.update(
            uses=t["uses"],
            hits=t["hits"],
            substituted=t["subs"],
            loads=t["loads"],  # on-demand loads
            cpu_experts=t["cpu"],  # (step, layer, expert) groups computed on the CPU
            prefetches_issued=t["pf_issued"],
            prefetches_landed=t["pf_landed"],
            prefetch_used=t["pf_used"],
            gate_refused=t["pf_refused"],  # late prefetches the prefetch gate did not start
            plan_loads=t["plan_loads"],  # experts a prompt plan (CasMoE) loaded before decoding
            # experts moved over the link: demand loads, prefetches that landed, plan preloads
            transfers=t["loads"] + t["pf_landed"] + t["plan_loads"],
        )
        d["hit_rate"] = t["hits"] / t["uses"] if t["uses"] else float("nan")
        d["substitution_rate"] = t["subs"] / self.routed if self.routed else 0.0
        # of the experts prefetches and plan preloads put in the cache, the share used there (the replay's)
        d["prefetch_accuracy"] = t["pf_used"] / t["pf_inserted"] if t["pf_inserted"] else float("nan")
        d["measured_tpot_ms"] = (
            float(np.mean(self.measured_decode_ms)) if self.measured_decode_ms else float("nan")
        )
        d["modeled_tpot_ms"] = (
            float(np.mean(self.modeled_decode_ms)) if self.modeled_decode_ms else float("nan")
        )
        for part in (*BREAKDOWN, "after_layers", "stream_wait"):
            ms = getattr(self, f"{part}_decode_ms")
            d[f"{part}_ms"] = float(np.mean(ms)) if ms else float("nan")
        return d


def runtime_stats(rt: LiveRuntime) -> dict[str, Any]:
    """Counters and rates since attach, with the settings that produced them and the tier's figures."""
    d = rt.stats_.as_dict(rt.step.stats)
    tier = (
        rt.tier.stats()
    )  # pinned_bytes, staged_layers, bytes_read, disk_reads, disk_read_gbps_observed, direct_io
    d.update(
        policy=rt.policy.name,
        alpha=rt.policy.alpha,
        balancer=rt.policy.balancer,
        capacity=rt.capacity,
        capacity_given=rt.config.capacity,
        slot_bytes=rt.slot_bytes,  # what a capacity in bytes divides by (a device's slot is dequantized)
        num_experts=rt.num_experts,
        modeled_predictor_ms=rt.step.predictor_ms,  # charged per layer before a prefetch (replay: predictor_ms)
        prefetch=rt.prefetcher.mode,
        hardware=rt.cost.profile,
        hardware_from=rt.hardware_from,  # given, or the default chosen (this machine's where measured)
        device=str(rt.device.where),
        simulated_device=rt.device.simulated,
        device_ops=rt.config.device_ops,
        pinned_bytes=tier.pop("pinned_bytes"),
        staged_layers=tier.pop("staged_layers"),
        offload=rt.config.offload,
        expert_dtype=rt.config.precision.label,
        expert_bytes=rt.link_bytes,  # one expert as the link moves it (its precision's bytes; two copies: the high one's)
        **tier,
        peak_rss_mb=peak_rss_mb(),
        # decode experts calls replayed as graphs (runtime/live/graphs.py; None: graphs off or no accelerator)
        graph_replays=rt.executor.graphs.replays if rt.executor.graphs is not None else None,
    )
    d["wasted_bytes"] = wasted_bytes(rt)
    if rt.copies is not None:  # two copies: low_share, upgrades and the bytes by copy, as the replay's
        d.update(rt.copies.figures())
        by = d["expert_compute_by_copy"]  # both copies named, a copy nothing computed at with zeros
        d["expert_compute_by_copy"] = {
            tag: by.get(tag, {"s": 0.0, "uses": 0}) for tag in rt.executor.copy_tags or ()
        }
    return d


def wasted_bytes(rt: LiveRuntime) -> float:
    """Bytes the link moved for prefetched experts never used while resident, each at the copy it
    read (:func:`moecast.runtime.core.mixed.bytes_by_copy`, the replay's ``wasted_mb_per_token``
    count); a prefetch the gate refused or the window cut moved nothing. A plan's preloads count as
    prefetches: one never used while resident is wasted."""
    low = rt.step.demand.expert_bytes if rt.copies is not None else None
    return max(bytes_by_copy(rt.step.stats, rt.step.cost.expert_bytes, low)["wasted"], 0.0)
