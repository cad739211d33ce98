"""bench/bench_layer_host.py's timing of the per-layer decisions."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import numpy as np
from moecast.runtime.core import step
from moecast.runtime.live import prefetch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import bench_layer_host


def test_decisions_count_the_host_threads_calls_only(monkeypatch):
    """On an accelerator the ranking runs on the prediction thread, overlapped with the host's work: it
    is the predictor's time, not the host's decision. Catches that thread's calls added to the host's
    figure (and, without a lock, racing it)."""
    for name in ("route", "layer", "prefetch"):  # restored after the test: the bench patches the class
        monkeypatch.setattr(step.LayerStep, name, getattr(step.LayerStep, name))
    monkeypatch.setattr(prefetch, "ranked_predictions", prefetch.ranked_predictions)
    acc = [0.0]
    bench_layer_host._time_decisions(acc)
    scores = np.random.default_rng(0).random((1, 64)).astype(np.float32)
    other = threading.Thread(target=lambda: [prefetch.ranked_predictions(scores, 6) for _ in range(200)])
    other.start()
    other.join()
    assert acc[0] == 0.0
    prefetch.ranked_predictions(scores, 6)
    assert acc[0] > 0.0
