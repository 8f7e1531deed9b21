"""Absl-flag entry points: demos and benchmarks of the dyadic_jax library."""
