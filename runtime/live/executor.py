"""Running one MoE layer's experts on the tiers: resident experts from their slots, the rest on the CPU.

The resident experts (the step's hits and the loads it placed) run from their slots with the wrapped
experts implementation, seen through a :class:`moecast.runtime.tiers.expert_store.SlotView`; the step's
CPU set runs from host memory (SMoE §5.4, CPU-assisted computation): on a worker thread while an
accelerator computes the resident ones, else after them on this thread (a second thread would only
contend for the same cores), its reads started first where the tier reads in the background. Loads the
cache did not keep (a long prefill's) stream through the slots in waves.

Where a layer's experts run in more than one call (waves, each demand load as it lands, the CPU
set), or in one over several tokens, each call computes its (token, expert) pairs' outputs, each
expert's pairs in the order the model's one call gives them, and they are combined once, as the
model's implementation combines them (:mod:`moecast.runtime.live.pairs`), so the output at alpha 0
is the model's bit for bit in any dtype.

Two expert copies (:mod:`moecast.runtime.core.mixed`): in a decode step each call on the slots is
split by the copy its slots hold, each copy's experts in a call of their own, timed apart (the sum,
high part first, is the one :class:`moecast.runtime.live.copies.MixedExperts` makes of a mixed
call), and the CPU set computes at the low copy; so the stats hold each copy's compute time and
uses (``expert_compute_by_copy``), which calibrate turns into each copy's expert time.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from moecast.runtime.core.cache import ExpertCache
from moecast.runtime.live import pairs, transfer
from moecast.runtime.live.graphs import ExpertGraphs
from moecast.runtime.live.stats import ForwardTimes, LiveStats
from moecast.runtime.tiers.base import Device, ExpertTier
from moecast.runtime.tiers.expert_store import SlotView


def _closing(waves: Any) -> contextlib.AbstractContextManager:
    """The waves, closed when the compute ends early where they can be (a generator releases its
    buffers); a tier's ``cpu_waves`` may return any iterator, as the protocol says."""
    return contextlib.closing(waves) if hasattr(waves, "close") else contextlib.nullcontext(waves)


@dataclass
class ExpertsCall:
    """One experts call's inputs: device tensors, and the host copies the layer's one read brought."""

    module: Any
    hidden: torch.Tensor
    index: torch.Tensor
    weights: torch.Tensor
    ids: np.ndarray
    kwargs: dict[str, Any]
    host: dict[str, torch.Tensor]
    w_host: torch.Tensor | None
    distinct: int  # distinct expert ids in ``ids``
    decode: bool = False  # the call is a decode step's
    step: int = 0  # the step, as the cache's time
    # its calls compute (token, expert) pairs' outputs, combined once (runtime/live/pairs.py)
    pairs: bool = False
    _pair_rows: tuple[torch.Tensor, torch.Tensor] | None = None
    _order: tuple[torch.Tensor, torch.Tensor] | None = None

    def pair_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The hidden state a row per (token, top-k) pair and the pairs' unit weights (made once)."""
        if self._pair_rows is None:
            hidden, _, ones = pairs.pair_inputs(self.hidden, self.index, self.weights)
            self._pair_rows = (hidden, ones)
        return self._pair_rows

    def placing(self, keys: torch.Tensor, sentinel: int, host_keys: np.ndarray | None) -> torch.Tensor | None:
        """The pair each row of a pairs call with ids ``keys`` (a slot id a pair, ``sentinel`` for the
        others) takes, so that its expert's group is ordered as the model's one call orders it
        (:func:`moecast.runtime.live.pairs.placing`); ``host_keys``: the same ids on the host where the
        model computes on the CPU (None on an accelerator). None for one token: its pairs' experts are
        distinct, each group one row, so no order to keep (and a decode step pays nothing)."""
        if self.hidden.shape[0] == 1:
            return None
        if host_keys is None:
            if self._order is None:
                self._order = pairs.reference_order(self.index)
            rows = torch.arange(keys.numel(), device=keys.device)
            return pairs.placing(self._order, self.index.reshape(-1), keys, sentinel, rows)
        experts = self.ids.reshape(-1)
        if self._order is None:  # the CPU's sort of the same ids, in the index's dtype: the model's order
            self._order = pairs.reference_order(torch.from_numpy(experts).to(self.index.dtype))
        src = pairs.placing_host(self._order, experts, host_keys, sentinel, np.arange(len(experts)))
        return torch.from_numpy(src)


def _plus(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    """The sum of two calls' outputs, either of which may be None (the call computed nothing)."""
    return b if a is None else (a if b is None else a + b)


class Executor:
    """Computes a layer's experts where the step put them, and copies what the cache takes into the slots.

    ``impls``: each layer's experts implementation (set when the runtime attaches). ``overlap_cpu``: the
    CPU experts run on a worker thread beside the device (an accelerator); without one the same cores
    compute both, so they run after the resident ones.
    """

    def __init__(
        self, tier: ExpertTier, device: Device, cache: ExpertCache, times: ForwardTimes, stats: LiveStats
    ) -> None:
        self.tier, self.stores, self.cache = tier, tier.layers, cache
        self.device, self.times, self.stats = device, times, stats
        self.impls: list[Callable[..., torch.Tensor]] = []
        self.overlap_cpu = device.accelerated
        # a layer computed in several calls combines their pairs' outputs once (set when the runtime
        # attaches: the model's implementation sums over the top-k, and the slots hold its weights)
        self.exact = False
        self.identity = [False] * len(self.stores)  # layers whose slot i holds expert i
        # two copies: the (high, low) copies' tags, under which a decode step's compute is timed
        self.copy_tags: tuple[str, str] | None = None
        self._pool: ThreadPoolExecutor | None = None
        # an accelerator's decode calls replayed as graphs (LiveConfig.graphs; set when the runtime attaches)
        self.graphs: ExpertGraphs | None = None

    # ------------------------------------------------------------------ placement
    def place(self, initial: np.ndarray) -> None:
        """Fill each layer's slots with ``initial`` ([c] for every layer, or [L, c]) and tell the cache."""
        for pos, store in enumerate(self.stores):
            store.fill(initial[pos] if initial.ndim == 2 else initial)
        self.placed()

    def preload(self, pos: int, want: np.ndarray) -> int:
        """Make layer ``pos``'s slots hold ``want``, evicting only residents it does not want, only as
        many as it needs; returns the loads."""
        store = self.stores[pos]
        keep = set(want.tolist())
        out = [int(e) for e in store.expert_in if e >= 0 and int(e) not in keep]
        before = store.loads
        store.load_many([int(e) for e in want if store.slot_of[int(e)] < 0], out)
        return store.loads - before

    def placed(self, moved: np.ndarray | None = None) -> None:
        """The slots were filled outside the step: the cache takes them as resident. ``moved`` [L, E]:
        the experts that came over the link for it (a plan's preloads), prefetched until their first use."""
        lanes = np.arange(len(self.stores))
        held = np.stack([s.expert_in for s in self.stores])
        flags = None if moved is None else (held >= 0) & np.take_along_axis(moved, np.maximum(held, 0), 1)
        self.cache.preload(lanes, held, moved=flags)
        self.identity = [bool((s.expert_in == np.arange(s.num_slots)).all()) for s in self.stores]

    def load(self, pos: int, experts: np.ndarray, shield: np.ndarray, t: int) -> np.ndarray:
        """Insert ``experts`` into layer ``pos``'s cache and copy them into the slots the cache frees."""
        before = self.cache.resident[pos].copy()
        inserted = self.cache.insert(np.array([pos]), experts[None, :], shield=shield[None, :], t=t)[0]
        self.move(pos, before, experts[inserted])
        return experts[inserted]

    def move(self, pos: int, before: np.ndarray, placed: np.ndarray, prefetch: bool = False) -> None:
        """Copy the experts the cache just took (``placed``) into the slots of those it evicted since ``before``:
        one batch, issued back to back on the link before anything the caller issues next. ``prefetch``:
        no compute waits for the batch yet, so a tier that queues a copy when its read lands queues it
        behind the demand copies still being read then (issue 43: a prefetch never goes on the link
        ahead of a copy the compute waits for)."""
        if not len(placed):
            return
        # their slots in any order: each load waits for its slot's last reader, whichever slot it takes
        evicted = np.flatnonzero(before & ~self.cache.resident[pos])
        self.stores[pos].load_many(placed, [int(e) for e in evicted], prefetch=prefetch)

    # ------------------------------------------------------------------ compute
    def full(
        self,
        pos: int,
        module: Any,
        hidden: torch.Tensor,
        index: torch.Tensor,
        weights: torch.Tensor,
        kwargs: dict[str, Any],
    ) -> torch.Tensor:
        """Full residency, slot i holding expert i: the wrapped implementation runs on the slots as is."""
        st = self.stores[pos]
        if st.awaits(None):  # a disk store's slots may still be landing
            self.times.stream_wait(st.wait, None)
        view = SlotView(module, st.slots, st.num_slots, False)
        if self.copy_tags is not None:  # full residency holds the high copy in every slot
            return self.times.timed_copy(
                self.copy_tags[0], index.numel(), self.impls[pos], view, hidden, index, weights, **kwargs
            )
        return self.times.timed("expert_compute", self.impls[pos], view, hidden, index, weights, **kwargs)

    def run(
        self,
        pos: int,
        call: ExpertsCall,
        hit_ids: np.ndarray,
        placed: np.ndarray,
        streamed: np.ndarray,
        uniq: np.ndarray,
        cpu_ids: np.ndarray,
    ) -> tuple[torch.Tensor | None, np.ndarray, Any]:
        """Run the resident experts (hits and the loads just placed) on the device, start the rest on the CPU.

        Returns the device's output (None if it ran nothing), the experts left to the CPU and a
        callable that joins their output (host memory); the CPU's experts are computed meanwhile.
        Where the layer takes several calls, or the call several tokens (``call.pairs``, set here),
        each output is its pairs' (:mod:`moecast.runtime.live.pairs`), which :meth:`join` combines.
        ``streamed``: loads the cache did not keep (more misses than slots, a long prefill): they go
        through the slots in waves of ``capacity`` experts after the resident ones. ``cpu_ids``: the
        step's CPU set (-1 padded), which is the rest of ``uniq`` when nothing streams.
        """
        on_device = np.concatenate([hit_ids, placed])
        if not len(streamed):
            to_cpu = np.sort(cpu_ids[cpu_ids >= 0])
            parts = self._resident(pos, call, hit_ids, placed)
            # the CPU's set is a part, and in waves (a disk tier's one expert at a time) several; one
            # call over several tokens too: its slot ids would order an expert's pairs otherwise than
            # the model's expert ids do (pairs.py), so its pairs are placed in the model's order
            several = len(parts) > 1 or bool(len(to_cpu)) or call.hidden.shape[0] > 1
            call.pairs = self.exact and several
            # started before the device call, which may block the host (a wrapped implementation may sync)
            cpu_part = self._start_cpu(pos, call, to_cpu) if len(to_cpu) else None
            out = None
            for experts in parts:
                got = self._device(pos, call, experts)
                out = _plus(out, got)
            return out, to_cpu, cpu_part
        call.pairs = self.exact
        out = self._device(pos, call, on_device)
        done = [on_device]
        capacity = self.stores[pos].num_slots
        for wave in (streamed[i : i + capacity] for i in range(0, len(streamed), capacity)):
            loaded = self.load(pos, wave, shield=wave, t=call.step)
            part = self._device(pos, call, loaded)
            out = _plus(out, part)
            done.append(loaded)
        to_cpu = np.setdiff1d(uniq, np.concatenate(done))
        return out, to_cpu, self._start_cpu(pos, call, to_cpu) if len(to_cpu) else None

    def join(
        self,
        call: ExpertsCall,
        out: torch.Tensor | None,
        to_cpu: np.ndarray,
        cpu_part: Any,
        uniq: np.ndarray,
        counts: np.ndarray,
    ) -> torch.Tensor:
        """The layer's output over the call's tokens: the device's experts' part plus the CPU's,
        computed while the device ran its own (``cpu_part`` gives it), or zeros where the call
        computed no expert; the pairs' outputs combined where the parts computed pairs."""
        hidden, n = call.hidden, call.hidden.shape[0]
        if len(to_cpu):
            # one token: each expert has one use
            uses = len(to_cpu) if n == 1 else int(counts[np.isin(uniq, to_cpu)].sum())
            self.stats.cpu_uses += uses
            if self.copy_tags is not None:  # the CPU set reads the low copy
                got = self.times.timed_copy(self.copy_tags[1], uses, cpu_part)
            else:
                got = self.times.timed("expert_compute", cpu_part)
            part = transfer.to_device(got, hidden.device)
            out = _plus(out, part)
        if out is None:
            return torch.zeros_like(hidden)
        return pairs.combine(out, call.weights, hidden.dtype) if call.pairs else out

    def _resident(
        self, pos: int, call: ExpertsCall, hit_ids: np.ndarray, placed: np.ndarray
    ) -> list[np.ndarray]:
        """The calls that compute a call's resident experts (the hits and the demand loads just
        placed), in their order: each call's experts.

        Reading in the background without an accelerator (each call runs to its end before the next
        starts), a decode step computes the hits while the loads are read, then each load as it
        lands, so only the last one's compute follows the link (the step's ``max(n_dev * t_g, link +
        t_g)``); a hit whose prefetch is still in flight computes as it lands, before the loads.
        Elsewhere they are one call: a device's stream waits for the copies without blocking the
        host, a host-memory store copies synchronously, and a prefill's loads are many (a call per
        expert would cost more than the overlap gains). Either way the layer's output is the
        wrapped implementation's bit for bit (several calls or tokens: their pairs combined, module
        docstring)."""
        if not (call.decode and self.tier.background_reads and not self.device.accelerated):
            return [np.concatenate([hit_ids, placed])]
        # a hit whose prefetch is still being read computes once it lands, after the hits that
        # have landed and before the loads (its read went to the disk first)
        st = self.stores[pos]
        late = st.expert_in[st.in_flight(st.slot_of[hit_ids])]
        if len(late):
            hit_ids = hit_ids[~np.isin(hit_ids, late)]
        return [e for e in [hit_ids, *late[:, None], *placed[:, None]] if len(e)]

    def _device(self, pos: int, call: ExpertsCall, experts: np.ndarray) -> torch.Tensor | None:
        """The (token, expert) pairs of ``experts`` (resident) from their device slots (:meth:`_slots`);
        with two copies, in a decode step, each copy's experts in a call of their own, timed at that
        copy: the high part first, then the low one added, as MixedExperts adds a mixed call's parts,
        so the output is the same."""
        if self.copy_tags is None or not call.decode or not len(experts):
            return self._slots(pos, call, experts, None)
        st = self.stores[pos]
        low = st.slot_low[st.slot_of[experts]]
        out = None
        for tag, part in zip(self.copy_tags, (experts[~low], experts[low])):
            got = self._slots(pos, call, part, tag)
            out = _plus(out, got)
        return out

    def _slots(
        self, pos: int, call: ExpertsCall, experts: np.ndarray, tag: str | None
    ) -> torch.Tensor | None:
        """The (token, expert) pairs of ``experts`` (resident) from their device slots, with the wrapped
        implementation (``tag``: all at that copy, the call's time and uses counted at it).

        Pairs of other experts carry the sentinel id ``num_slots``, which every experts implementation
        skips (its expert-parallel path), so the call computes exactly the pairs that run on the device.
        The slot ids are mapped on the host (the ids are there already) and sent without a sync; the
        compute stream waits only for these slots' transfers, and an event after the call marks them read.
        """
        if not len(experts):
            return None
        st = self.stores[pos]
        slot_of = st.slot_of
        if len(experts) == call.distinct:
            table = slot_of
            partial = False
        else:
            table = np.full(st.num_experts, st.num_slots, np.int64)
            table[experts] = slot_of[experts]
            partial = True
        slot_ids = transfer.to_device(torch.from_numpy(table[call.ids]), call.index.device)
        slots = slot_of[experts]
        if st.awaits(slots):  # else no copy to wait for: no wait, and no timing events around none
            self.times.stream_wait(st.wait, slots)
        view = SlotView(call.module, st.slots, st.num_slots, partial)
        src = None
        if call.pairs:  # one row per pair, unweighted: join combines every call's pairs at once
            hidden, ones = call.pair_rows()
            keys = slot_ids.reshape(-1, 1)
            host_keys = None if self.device.accelerated else table[call.ids].reshape(-1)
            src = call.placing(keys[:, 0], st.num_slots, host_keys)  # each group in the model's order
            args = (self.impls[pos], view, hidden if src is None else hidden[src], keys, ones)
        else:
            args = (self.impls[pos], view, call.hidden, slot_ids, call.weights)
        if (
            tag is None
            and not call.pairs
            and call.decode
            and self.graphs is not None
            and self.graphs.takes(call.hidden, call.kwargs)
        ):
            # a decode step's call, replayed from its layer's graph (runtime/live/graphs.py)
            out = self.times.timed("expert_compute", self.graphs.call, (pos, partial), *args)
        elif tag is None:
            out = self.times.timed("expert_compute", *args, **call.kwargs)
        else:
            uses = int(np.isin(call.ids, experts).sum())  # the (token, expert) pairs it computes
            out = self.times.timed_copy(tag, uses, *args, **call.kwargs)
        st.mark_read(slots)
        return out if src is None else pairs.unplace(out, src)

    def _start_cpu(self, pos: int, call: ExpertsCall, experts: np.ndarray) -> Any:
        """Start the CPU's experts (on the worker thread when overlapping); returns the join."""
        if "hidden" not in call.host:  # not foreseen by the layer's read: read the rows now
            call.host["hidden"], call.host["w"] = transfer.to_host([call.hidden, call.weights])
            call.w_host = call.host["w"]
            self.stats.host_syncs += 1
        if not self.overlap_cpu:
            # one token's experts each compute as its read lands (the step's rule); a prefill's in
            # waves of the reader's size. The reads go out now; the caller times the join.
            waves = self.stores[pos].cpu_waves(experts, wave=1 if len(call.ids) == 1 else None)
            return lambda: self._host(pos, call, experts, waves)
        grad = torch.is_grad_enabled()

        def job() -> torch.Tensor:
            with torch.set_grad_enabled(grad):  # grad mode is per thread
                return self._host(pos, call, experts)

        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moecast-cpu-experts")
        return self._pool.submit(job).result

    def _host(self, pos: int, call: ExpertsCall, experts: np.ndarray, waves: Any = None) -> torch.Tensor:
        """CPU-assisted computation (SMoE §5.4): only the tokens routed to ``experts``, from host memory, on the host.

        The store gives the experts in waves (the disk tier holds a bounded number of them at a time;
        ``waves``: the store's already started); the waves' parts add up in float32, so one wave's
        result is exactly its part in the model's dtype.
        """
        hidden = call.host["hidden"].reshape(-1, call.hidden.shape[-1])
        waves = waves if waves is not None else self.stores[pos].cpu_waves(experts)
        if call.pairs:
            return self._host_pairs(pos, call, hidden, waves)
        out = torch.zeros(hidden.shape, dtype=torch.float32)
        with _closing(waves):
            for tensors, table, count in waves:
                cpu_ids = torch.from_numpy(table[call.ids])
                rows = (cpu_ids < count).any(1)
                view = SlotView(call.module, tensors, count, True)
                part = self.impls[pos](view, hidden[rows], cpu_ids[rows], call.w_host[rows], **call.kwargs)
                out[rows] += part.float()
        return out.to(call.hidden.dtype)

    def _host_pairs(self, pos: int, call: ExpertsCall, hidden: torch.Tensor, waves: Any) -> torch.Tensor:
        """:meth:`_host`'s experts as their pairs' unweighted outputs ([tokens x top-k, hidden]; zeros for
        the pairs of other experts), each wave's pairs computed by one call."""
        experts = torch.from_numpy(call.ids)
        hidden, _, ones = pairs.pair_inputs(hidden, experts, call.w_host)
        # the host's sort of the ids: where the device is the CPU, the model's order (an accelerator's
        # model computes on other kernels, which no host call matches bit for bit)
        order = pairs.reference_order(experts) if call.hidden.shape[0] > 1 else None
        flat = call.ids.reshape(-1)
        out = torch.zeros(hidden.shape, dtype=call.hidden.dtype)
        with _closing(waves):
            for tensors, table, count in waves:
                ids = torch.from_numpy(table[call.ids].reshape(-1))
                mine = ids < count
                rows, keys = torch.nonzero(mine)[:, 0], ids[mine]
                if order is not None:  # each group in the model's order (pairs.placing)
                    placed = pairs.placing_host(order, flat[rows.numpy()], keys.numpy(), count, rows.numpy())
                    rows = torch.from_numpy(placed)
                view = SlotView(call.module, tensors, count, True)
                out[rows] = self.impls[pos](view, hidden[rows], keys[:, None], ones[rows], **call.kwargs)
        return out

    def close(self) -> None:
        """Join and close the CPU worker."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
