"""moecast.runtime: expert cache, substitution, prefetch, balancing, cost model, replay and live integration."""
