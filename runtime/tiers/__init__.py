"""moecast.runtime.tiers: where experts live: host and disk stores, the offload directory, expert precision."""
