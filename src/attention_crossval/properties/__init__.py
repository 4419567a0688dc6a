"""Property tests and the Hypothesis strategies, mutants, coverage and replay tools they use."""
