"""moecast.runtime.replay: trace replay: the discrete-event engine, its fast paths, and the replay/compare commands."""
