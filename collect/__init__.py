"""moecast.collect: router traces (models, hooks, workloads, the TraceSet store, importers)."""

from moecast.collect.traceset import (
    MissingFieldError,
    ModelInfo,
    RequestRecord,
    RequestTrace,
    TraceMeta,
    TraceSet,
    TraceSetError,
    TraceWriter,
    open_traces,
)

__all__ = [
    "MissingFieldError",
    "ModelInfo",
    "RequestRecord",
    "RequestTrace",
    "TraceMeta",
    "TraceSet",
    "TraceSetError",
    "TraceWriter",
    "open_traces",
]
