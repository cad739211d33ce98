"""moecast.runtime.core: the per-layer decision: policy, cache, step and its compiled kernels, cost model, substitution, PreSched."""
