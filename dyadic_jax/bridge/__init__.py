"""dyadic_jax.bridge: the host bridge between the draft worker and the verifier.

A sans-I/O protocol core (`WorkerSession`, `VerifierSession`: pure state
machines, messages and time in, messages and typed effects out), thin
ZeroMQ drivers around them (`Worker`, `Verifier`), capabilities and HELLO
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
"""

from dyadic_jax.bridge.counters import Counters
from dyadic_jax.bridge.deadline import AdaptiveDeadline
from dyadic_jax.bridge.effects import Plan, Propose, Send, Stage, Verify
from dyadic_jax.bridge.hello import Capabilities
from dyadic_jax.bridge.proposer import Proposal, draft_proposer
from dyadic_jax.bridge.transport import Curve, Endpoint
from dyadic_jax.bridge.verifier import (Outcome, PlanSharer, RoundHook,
                                        Validator, Verifier)
from dyadic_jax.bridge.verifier_session import (Request, RoundResult,
                                                VerifierSession)
from dyadic_jax.bridge.worker import DrawHook, Worker, serve_forever
from dyadic_jax.bridge.worker_session import WorkerSession

__all__ = [
    "AdaptiveDeadline", "Capabilities", "Counters", "Curve", "DrawHook",
    "Endpoint", "Outcome", "Plan", "PlanSharer", "Propose", "Proposal",
    "Request", "RoundHook", "RoundResult", "Send", "Stage", "Validator",
    "Verifier", "VerifierSession", "Verify", "Worker", "WorkerSession",
    "draft_proposer", "serve_forever",
]
