"""Deliberately broken kernels: each has one known bug that a named harness check must catch."""
