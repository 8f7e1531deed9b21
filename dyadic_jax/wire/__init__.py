"""dyadic_jax.wire: the v3 wire format (no sockets).

Frames and messages (`codec`), their layouts (`layouts`), frame tags
(`auth`: keyed BLAKE3 MAC, or CRC32C when insecure), one object per q
representation (`qformats`), the row validator (`validate_q_row`) and the
rejection classes: one exception type, `ProtocolError`, whose `.code` is a
`Code`. This layer refuses bad bytes before any use; docs/wire.md has the
layouts and the decoding order.
"""

from dyadic_jax.wire.refusals import Code, ProtocolError
from dyadic_jax.wire.validate import validate_q_row

__all__ = ["Code", "ProtocolError", "validate_q_row"]
