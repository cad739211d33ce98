"""moecast.train: Lightning modules, data modules and CLI runs that fit predictors on TraceSets."""
