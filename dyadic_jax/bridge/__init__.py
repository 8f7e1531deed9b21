"""dyadic_jax.bridge: the host bridge between the draft worker and the verifier.

Sessions (HELLO negotiation, generations and rounds), preallocated slots
with a watchdog, the ZeroMQ transport, and the worker and verifier loops.
The verifier takes its verification function as an argument (single-device
`dyadic_jax.verify_chain` or the sharded one); this package never imports
`sharding` (DESIGN.md section 1).
"""

from dyadic_jax.bridge.counters import Counters
from dyadic_jax.bridge.hello import Capabilities, negotiate
from dyadic_jax.bridge.proposer import Proposal, draft_proposer
from dyadic_jax.bridge.staging import SlotPool, SlotState, dense_rows
from dyadic_jax.bridge.transport import Endpoint
from dyadic_jax.bridge.verifier import Request, RoundResult, Verifier
from dyadic_jax.bridge.worker import Worker, serve_forever

__all__ = [
    "Capabilities", "Counters", "Endpoint", "Proposal", "Request",
    "RoundResult", "SlotPool", "SlotState", "Verifier", "Worker",
    "dense_rows", "draft_proposer", "negotiate", "serve_forever",
]
