"""moecast.runtime.replay: trace replay: the discrete-event engine, its fast paths, and the replay/compare commands."""

from moecast.runtime.replay.engine import ReplayConfig, ReplayResult, replay

__all__ = ["ReplayConfig", "ReplayResult", "replay"]
