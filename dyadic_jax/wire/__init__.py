"""dyadic_jax.wire: the v2 wire format, numpy only (no sockets).

This layer refuses bad bytes before any use: one exception type,
`ProtocolError`, whose `.code` names the rejection class. So far it holds
the row validator; the message layouts build on it (docs/wire.md).
"""

from dyadic_jax.wire.errors import Code, ProtocolError
from dyadic_jax.wire.validate import validate_q_row

__all__ = ["Code", "ProtocolError", "validate_q_row"]
