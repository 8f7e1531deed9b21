"""dyadic_jax.wire: the v3 wire format (no sockets).

Frames and messages (`codec`), their layouts (`layouts`), frame tags
(`auth`: keyed BLAKE3 MAC, or CRC32C when insecure), one object per q
representation (`qformats`), the row validator (`validate_q_row`) and the
rejection classes: one exception type, `ProtocolError`, whose `.code` is a
`Code`. This layer refuses bad bytes before any use; docs/wire.md has the
layouts and the decoding order.
"""

import typing

from dyadic_jax.wire.refusals import Code, ProtocolError

if typing.TYPE_CHECKING:
  from dyadic_jax.wire.validate import validate_q_row


def __getattr__(name: str) -> typing.Any:
  """`validate_q_row` loads on first use: it runs the core's kernel
  (JAX's numerics), which frames and sessions never need."""
  if name != "validate_q_row":
    raise AttributeError(f"module 'dyadic_jax.wire' has no attribute "
                         f"{name!r}")
  from dyadic_jax.wire import validate  # pylint: disable=g-import-not-at-top
  return validate.validate_q_row

__all__ = ["Code", "ProtocolError", "validate_q_row"]
