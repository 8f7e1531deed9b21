"""Tests of dyadic_jax.models."""
