"""dyadic_jax.bridge: the host bridge between the draft worker and the verifier.

A sans-I/O protocol core (`WorkerSession`, `VerifierSession`: pure state
machines, messages and time in, messages and typed effects out), thin
ZeroMQ drivers around them (`Worker`, `Verifier`), the verifier's round
engine, which the one-process `generate.Local` runs too (`engine`: target
rows, verification, the target-only fallback; no socket), capabilities
and HELLO
negotiation, staging slots, the sampling audit, key files (`keys`, also the command
`python -m dyadic_jax.bridge.keys DIR`), the plan broadcast of a
multi-rank verifier (`ranks`) and the rank-to-rank q links of a
tensor-parallel worker and verifier (`shard_link`, their sessions, and
`rank_links`, their drivers); those four are imported on demand. The
drivers take components instead of being subclassed (`Validator`,
`RoundHook`, a plan sharer; `DrawHook`). The
verifier takes its verification function as an argument (single-device
`dyadic_jax.verify_chain` or the sharded one); this package never imports
`sharding` (docs/architecture.md).

The names below load on first use (PEP 562): the sessions import neither
JAX nor ZeroMQ (`verifier_session`, `worker_session`, `shard_link`); the
drivers and the proposer do, when one of their names is first read.
"""

import importlib
import typing

if typing.TYPE_CHECKING:
  from dyadic_jax.bridge.counters import Counters
  from dyadic_jax.bridge.deadline import AdaptiveDeadline
  from dyadic_jax.bridge.effects import Plan, Propose, Send, Stage, Verify
  from dyadic_jax.bridge.engine import Outcome
  from dyadic_jax.bridge.hello import Capabilities
  from dyadic_jax.bridge.proposer import draft_proposer
  from dyadic_jax.bridge.transport import Curve, Endpoint
  from dyadic_jax.bridge.verifier import (PlanSharer, RoundHook, Validator,
                                          Verifier)
  from dyadic_jax.bridge.ledger import Request, RoundResult
  from dyadic_jax.bridge.verifier_session import VerifierSession
  from dyadic_jax.bridge.worker import DrawHook, Worker, serve_forever
  from dyadic_jax.bridge.worker_session import WorkerSession

# Public name -> the module of this package that defines it.
_WHERE = {
    "Counters": "counters", "AdaptiveDeadline": "deadline",
    **dict.fromkeys(("Plan", "Propose", "Send", "Stage", "Verify"),
                    "effects"),
    "Outcome": "engine",
    "Capabilities": "hello",
    "draft_proposer": "proposer",
    **dict.fromkeys(("Curve", "Endpoint"), "transport"),
    **dict.fromkeys(("PlanSharer", "RoundHook", "Validator", "Verifier"),
                    "verifier"),
    **dict.fromkeys(("Request", "RoundResult"), "ledger"),
    "VerifierSession": "verifier_session",
    **dict.fromkeys(("DrawHook", "Worker", "serve_forever"), "worker"),
    "WorkerSession": "worker_session",
}


def __getattr__(name: str) -> typing.Any:
  """Loads a public name's module on first use (and keeps the name)."""
  where = _WHERE.get(name)
  if where is None:
    raise AttributeError(f"module 'dyadic_jax.bridge' has no attribute "
                         f"{name!r}")
  value = getattr(importlib.import_module(f"dyadic_jax.bridge.{where}"), name)
  globals()[name] = value
  return value


__all__ = [
    "AdaptiveDeadline", "Capabilities", "Counters", "Curve", "DrawHook",
    "Endpoint", "Outcome", "Plan", "PlanSharer", "Propose", "Request",
    "RoundHook", "RoundResult", "Send", "Stage", "Validator", "Verifier",
    "VerifierSession", "Verify", "Worker", "WorkerSession", "draft_proposer",
    "serve_forever",
]
