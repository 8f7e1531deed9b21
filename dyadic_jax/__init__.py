"""dyadic_jax: exact speculative decoding with dyadic (2^-24) draft q.

Pure single-shard math: draft/target weights, dyadic ticket allocation,
proposal rows (weights, counts and token in one op), the
q codec, integer categorical draws, the RNG key schedule, fixed-depth
verification and admission. `dyadic_jax.reference` is the exact rational
oracle. The numerical contract is in docs/numerics.md.

The names below load on first use (PEP 562): `import dyadic_jax.wire` or
a protocol session (`dyadic_jax.bridge.verifier_session`) costs no JAX
import; `dyadic_jax.verify_chain` and the rest import their module then.
"""

import importlib
import importlib.util
import typing

from dyadic_jax import rowsetting

# A bad DYADIC_JAX_ROWS is refused here, at import, before any op runs.
rowsetting.setting_from_env()

if typing.TYPE_CHECKING:
  from dyadic_jax import qrows
  from dyadic_jax import reference
  from dyadic_jax import rowops
  from dyadic_jax.admission import (AdaptiveDepth, AdmissionContext,
                                    FixedDepth, StoppingRule, draft_chain)
  from dyadic_jax.allocation import allocate_dense, allocate_sparse
  from dyadic_jax.constants import (DEFAULT_VOCAB, LOG2_M, M, MAX_VOCAB,
                                    SEMANTIC_ID, TARGET_BITS, Status)
  from dyadic_jax.draws import sample_counts
  from dyadic_jax.errors import DyadicError, checked, raise_for_status
  from dyadic_jax.proposal import propose_dense, propose_sparse
  from dyadic_jax.qcodec import counts_to_q, q_to_counts
  from dyadic_jax.rng import (Domain, draw24, draw64, draw_key,
                              proposal_draws, rng_key, round_key)
  from dyadic_jax.verification import (DenseQ, SparseQ, quantize_target,
                                       sample_target, verify_batch,
                                       verify_chain)
  from dyadic_jax.weights import draft_weights, target_probs
  from dyadic_jax.x64 import X64Required

# Public name -> the module that defines it (a submodule: itself).
_WHERE = {
    **dict.fromkeys(("qrows", "reference", "rowops"), ""),
    **dict.fromkeys(("AdaptiveDepth", "AdmissionContext", "FixedDepth",
                     "StoppingRule", "draft_chain"), "admission"),
    **dict.fromkeys(("allocate_dense", "allocate_sparse"), "allocation"),
    **dict.fromkeys(("DEFAULT_VOCAB", "LOG2_M", "M", "MAX_VOCAB",
                     "SEMANTIC_ID", "TARGET_BITS", "Status"), "constants"),
    "sample_counts": "draws",
    **dict.fromkeys(("DyadicError", "checked", "raise_for_status"),
                    "errors"),
    **dict.fromkeys(("propose_dense", "propose_sparse"), "proposal"),
    **dict.fromkeys(("counts_to_q", "q_to_counts"), "qcodec"),
    **dict.fromkeys(("Domain", "draw24", "draw64", "draw_key",
                     "proposal_draws", "rng_key", "round_key"), "rng"),
    **dict.fromkeys(("DenseQ", "SparseQ", "quantize_target",
                     "sample_target", "verify_batch", "verify_chain"),
                    "verification"),
    **dict.fromkeys(("draft_weights", "target_probs"), "weights"),
    "X64Required": "x64",
}


def __getattr__(name: str) -> typing.Any:
  """Loads a public name's module on first use (and keeps the name)."""
  where = _WHERE.get(name)
  if where is None:       # any other submodule, as an eager import had it
    if name.startswith("_") or not importlib.util.find_spec(
        f"dyadic_jax.{name}"):
      raise AttributeError(f"module 'dyadic_jax' has no attribute {name!r}")
    where = ""
  if where:
    value = getattr(importlib.import_module(f"dyadic_jax.{where}"), name)
  else:
    value = importlib.import_module(f"dyadic_jax.{name}")
  globals()[name] = value
  return value


__all__ = [
    "AdaptiveDepth", "AdmissionContext", "DEFAULT_VOCAB", "DenseQ", "Domain",
    "DyadicError", "FixedDepth", "LOG2_M", "M", "MAX_VOCAB", "SEMANTIC_ID", "SparseQ",
    "Status", "StoppingRule", "TARGET_BITS", "allocate_dense",
    "allocate_sparse", "checked", "counts_to_q", "draft_chain",
    "draft_weights", "draw24", "draw64", "draw_key", "propose_dense",
    "propose_sparse", "proposal_draws", "q_to_counts",
    "qrows", "quantize_target", "raise_for_status", "reference", "rng_key",
    "round_key", "rowops", "sample_counts", "sample_target", "target_probs",
    "verify_batch", "verify_chain", "X64Required",
]
