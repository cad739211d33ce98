"""moecast.runtime.live: live integration with a Hugging Face model: hooks, transfers, executor, stats, and the run/eval-accuracy commands."""
