"""A decode step's experts calls replayed as graphs captured once (issue 43: the host's launches set the
H200's step).

On the H200 every row was host-bound: the runtime with every expert resident spent 0.66 ms of host
time a layer in its experts calls alone (`bench/results/gpu-NVIDIA-H200.md`), the model's grouped_mm
implementation issuing a score of small kernels for one token. A decode step's call has the same
shapes every token (one token, its top-k slot ids) and reads the slots at fixed addresses, and the
implementation keeps the host out of it (transformers computes its group offsets with ``histc``
rather than ``bincount`` for this), so :class:`ExpertGraphs` captures it once per layer and kind of
call, into static input buffers, and replays it: the host copies the token's hidden state, slot ids
and weights into those buffers and launches the graph. A slot's new contents (a copy landed since)
are read by the replay, as by the call, since the graph reads the slot buffers themselves.

The device's ``capture(fn, *inputs)`` (:class:`~moecast.runtime.tiers.base.CudaOps`: a CUDA graph;
the simulated device: the call kept and rerun on the same buffers, so a CPU test walks the same
path) returns the replay and the output buffer. A call that fails to capture (an implementation
that reads back from the device, say) is called directly from then on, and a warning says so once.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger(__name__)
#: a captured call: its replay, its output buffer and its static inputs (hidden state, slot ids, weights)
Captured = tuple[Callable[[], None], torch.Tensor, tuple[torch.Tensor, ...]]


class ExpertGraphs:
    """Each (layer, kind of call)'s captured graph, its static inputs and output (None: not capturable)."""

    def __init__(self, ops: Any) -> None:
        self.ops = ops
        self._graphs: dict[tuple, Captured | None] = {}
        self.captured = 0
        self.replays = 0

    @staticmethod
    def takes(hidden: torch.Tensor, kwargs: dict[str, Any]) -> bool:
        """Whether a call can be a graph's: one token, no extra arguments, no autograd."""
        return hidden.shape[0] == 1 and not kwargs and not torch.is_grad_enabled()

    def call(
        self,
        key: tuple,
        impl: Callable[..., torch.Tensor],
        view: Any,
        hidden: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
    ) -> torch.Tensor:
        """``impl(view, hidden, ids, weights)``, replayed from the graph of ``key`` (the layer and the
        view's kind) with the shapes and dtypes of the inputs, captured at its first call."""
        key = (*key, hidden.shape, hidden.dtype, ids.shape, ids.dtype, weights.dtype)
        if key not in self._graphs:
            self._graphs[key] = self._capture(impl, view, hidden, ids, weights)
        got = self._graphs[key]
        if got is None:
            return impl(view, hidden, ids, weights)
        replay, out, inputs = got
        for buf, x in zip(inputs, (hidden, ids, weights)):
            buf.copy_(x)
        replay()
        self.replays += 1
        # the next replay overwrites the buffer: the layer's output is its own
        return out.clone()

    def _capture(
        self, impl: Callable[..., torch.Tensor], view: Any, *inputs: torch.Tensor
    ) -> Captured | None:
        static = tuple(x.detach().clone() for x in inputs)
        try:
            replay, out = self.ops.capture(functools.partial(impl, view), *static)
        except Exception as exc:  # any failure: the call runs as it is, uncaptured
            _say_uncapturable(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
            return None
        self.captured += 1
        return replay, out, static


@functools.cache
def _say_uncapturable(why: str) -> None:
    log.warning("an experts call could not be captured as a graph (%s): it runs uncaptured", why)
