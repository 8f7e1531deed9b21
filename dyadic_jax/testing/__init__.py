"""Test tools users may reuse, as chex ships its fakes.

  stats       chi-square helpers with a stated false-failure rate and power
  hlo         the collectives of a compiled program and the bytes they move
  adversarial adversarial weight/target/q rows (the oracle, identity and
              GPU qualification tests')
  session_pair a WorkerSession and a VerifierSession wired in memory

Import the submodule you need (`from dyadic_jax.testing import stats`):
this package imports nothing eagerly, so tools with optional dependencies
cost nothing to the ones without. The library never imports it. The toy
draft/target pair is a model like the trained one: dyadic_jax.models.toy_pair.
"""
