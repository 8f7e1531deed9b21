"""The q formats' batch verdicts: one jitted pass over a staged batch.

JAX's half of `dense` and `sparse` validation (`validate(...,
device=True)`, the verifier's staged batch), loaded on first use so that
the formats, the codec and the protocol sessions import without JAX. The
dense pass and why it is shaped so: `dense`'s docstring (on CPU one
elementwise XLA pass and exact numpy partial sums, `_host_dense`; on an
accelerator one jitted verdict, `_dense`); the sparse one is the core
kernel `qrows.sparse` under one jit with the sampling audit.
"""

import functools
import math

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
from numpy.typing import ArrayLike

from dyadic_jax import qrows, x64
from dyadic_jax.constants import M
from dyadic_jax.wire.qformats import base

_BAD = float(1 << 25)     # what a refused entry adds to its row's sum
# The class qrows.classify gives a fine entry (that of +0.0).
_FINE = int(qrows.classify(np.zeros(1, np.uint32), np)[0][0])


@functools.partial(jax.jit, static_argnames=("audit",))
def _dense(values: jax.Array, tokens: jax.Array, draws: jax.Array, *,
            audit: bool) -> tuple[jax.Array, jax.Array, jax.Array]:
  vocab = values.shape[-1]
  bits = lax.bitcast_convert_type(values, jnp.uint32)
  cls, count = qrows.classify(bits, jnp)
  fine = cls == _FINE
  total = jnp.sum(jnp.where(fine, count.astype(jnp.float64), _BAD), -1)
  counts = jnp.where(fine, count, 0)
  at = jnp.take_along_axis(counts, jnp.clip(tokens, 0, vocab - 1)[..., None],
                           axis=-1)[..., 0]
  ok = (total == M) & (tokens >= 0) & (tokens < vocab) & (at > 0)
  if audit:
    # Sibling reductions over the batch that XLA CPU fuses into one
    # multi-output reduction run several times slower than apart.
    counts, ok = lax.optimization_barrier((counts, ok))
    drawn = base.audit(counts, tokens, draws, jnp)
  else:
    drawn = jnp.ones(ok.shape, bool)
  return counts, ok, drawn


# A non-fine entry's value in `_entries`: above M, so one such entry puts
# its row's exact sum above M whatever the other (nonnegative) entries are.
_BAD_ENTRY = M + 1
# Entries per exact partial sum: 255 (M + 1) < 2^32, so a uint32 sum of a
# segment never wraps (256 could: 256 (M + 1) > 2^32).
_SEGMENT = 255


@jax.jit
def _entries(values: jax.Array, tokens: jax.Array
             ) -> tuple[jax.Array, jax.Array]:
  """The host path's one XLA pass: (e, near). e [..., V]: each entry's
  count where fine, else M + 1 (`qrows.fine_counts`). near uint32[..., 2]
  per row: e at the token (0 if the token is out of range) and the sum of
  e over the token's own segment of _SEGMENT entries before it (the
  audit's part of a segment; fewer than _SEGMENT entries: no wrap), read
  from at most _SEGMENT entries of the row, so XLA's gathers cost nothing
  beside the pass."""
  vocab = values.shape[-1]
  e = qrows.fine_counts(lax.bitcast_convert_type(values, jnp.uint32),
                        _BAD_ENTRY, jnp)
  token = jnp.clip(tokens, 0, vocab - 1)
  start = token // _SEGMENT * _SEGMENT
  places = jnp.arange(_SEGMENT, dtype=jnp.int32)
  seg = jnp.take_along_axis(
      e, jnp.minimum(start[..., None] + places, vocab - 1), axis=-1)
  part = jnp.sum(jnp.where(places < (token - start)[..., None], seg, 0)
                 .astype(jnp.uint32), -1, dtype=jnp.uint32)
  at = jnp.take_along_axis(e, token[..., None], axis=-1)[..., 0]
  at = jnp.where(token == tokens, at, 0).astype(jnp.uint32)
  return e, jnp.stack([at, part], -1)


@functools.lru_cache(maxsize=16)
def _layout(rows: int, vocab: int) -> tuple[np.ndarray, np.ndarray]:
  """Per (rows, vocab), made once: the flat offsets of each row's
  segments of _SEGMENT entries (the last one of a row shorter), for
  `np.add.reduceat` [rows * segments], and the flat offset of each row's
  first exclusive running sum in a [rows, segments + 1] table [rows]."""
  per_row = np.arange(0, vocab, _SEGMENT, dtype=np.int64)
  first = np.arange(rows, dtype=np.int64) * vocab
  starts = (first[:, None] + per_row[None, :]).reshape(-1)
  return starts, np.arange(rows, dtype=np.int64) * (len(per_row) + 1)


def _host_dense(values: np.ndarray | jax.Array, tokens: np.ndarray,
                draws: np.ndarray | None
                ) -> tuple[jax.Array, np.ndarray, np.ndarray]:
  """`_dense`'s verdict with the reductions on the host (XLA CPU).

  XLA CPU runs integer and multi-output row reductions several times
  slower than a pass over memory, and numpy runs a uint32 sum at memory
  speed; so one elementwise XLA pass (`_entries`) reads the rows (a staged
  numpy slot goes in as it is: the CPU client aliases an aligned buffer,
  no copy, no DLPack round trip) and writes e = count (fine) or M + 1 (any
  other entry) per entry, the counts' own buffer, plus two numbers per
  row from at most 255 entries of it (e at the token, and the token's
  segment before it); numpy then reads e once: uint32 sums of segments of
  255 entries (never wrap), then exact int64 running sums of those per
  row. A row is valid iff its sum is M (one non-fine entry alone makes it
  > M), its token is in range and e > 0 there; the audit's count mass
  before the token is the running sum of the whole segments before it
  plus its own segment's part (read only where the row is valid, so e is
  then its counts). After the two passes, a dozen numpy calls on arrays
  of rows x segments or smaller. docs/numerics.md section 4.
  """
  shape = values.shape
  vocab = shape[-1]
  rows = math.prod(shape[:-1])
  entries, near = _entries(values, tokens)
  if rows == 0:
    empty = np.zeros(shape[:-1], bool)
    return entries, empty, empty
  starts, running_first = _layout(rows, vocab)
  flat = np.asarray(entries).reshape(-1).view(np.uint32)   # no copy (CPU)
  sums = np.add.reduceat(flat, starts, dtype=np.uint32).reshape(rows, -1)
  near = np.asarray(near).reshape(rows, 2).astype(np.int64)
  at = near[:, 0]
  # running[r, j]: the exact mass of row r's first j segments.
  running = np.zeros((rows, sums.shape[1] + 1), np.int64)
  np.cumsum(sums, -1, dtype=np.int64, out=running[:, 1:])
  valid = (running[:, -1] == M) & (at > 0)
  if draws is None:
    drawn = np.ones(rows, bool)
  else:
    segment = np.minimum(np.maximum(tokens.reshape(rows), 0),
                         vocab - 1) // _SEGMENT
    before = running.reshape(-1)[running_first + segment] + near[:, 1]
    u = draws.reshape(rows).astype(np.int64)
    drawn = (before <= u) & (u < before + at)
  counts = entries
  if not valid.all():   # rare: refused rows' counts are zeros (qrows.dense)
    e = flat.view(np.int32).reshape(rows, vocab)
    counts = jnp.asarray(np.where(valid[:, None], e, 0).reshape(shape))
  return counts, valid.reshape(shape[:-1]), drawn.reshape(shape[:-1])


def dense_verdict(values: np.ndarray | jax.Array, tokens: ArrayLike,
                  draws: ArrayLike | None, *, host: bool | None = None
                  ) -> tuple[jax.Array, np.ndarray | jax.Array,
                             np.ndarray | jax.Array]:
  """(counts, valid, drawn) of dense rows [..., V]: counts where a row is
  valid (zeros elsewhere on the host path; on the device path each fine
  entry's count), valid as `qrows.dense`'s OK without the audit, drawn the
  audit's verdict (meaningful where valid; True without draws).

  host: reductions on the host (`_host_dense`; default on a CPU backend)
  or the one jitted verdict (`_dense`; default on an accelerator). Both
  give the same valid, drawn where valid and counts of valid rows.
  """
  if host is None:
    host = jax.default_backend() == "cpu"
  if host:
    # A numpy slot goes to the elementwise pass as it is (see _host_dense).
    return _host_dense(values, np.asarray(tokens, np.int32),
                       None if draws is None else np.asarray(draws, np.uint32))
  if isinstance(values, np.ndarray):
    values = (jax.dlpack.from_dlpack(values)
              if values.ctypes.data % 64 == 0 and values.flags.c_contiguous
              else jnp.asarray(values))
  return _device_dense(values, tokens, draws)


@x64.scoped
def _device_dense(values: jax.Array, tokens: ArrayLike,
                  draws: ArrayLike | None
                  ) -> tuple[jax.Array, jax.Array, jax.Array]:
  audit = draws is not None
  draws = jnp.asarray(draws if audit else np.zeros(np.shape(tokens),
                                                   np.uint32), jnp.uint32)
  return _dense(values, jnp.asarray(tokens, jnp.int32), draws, audit=audit)


@functools.partial(jax.jit, static_argnames=("vocab", "audit"))
def _sparse(values: jax.Array, ids: jax.Array, n: jax.Array,
            tokens: jax.Array, draws: jax.Array, *, vocab: int,
            audit: bool) -> tuple[jax.Array, jax.Array, jax.Array]:
  bits = lax.bitcast_convert_type(values, jnp.uint32)
  counts, row_status = qrows.sparse(bits, ids, n, tokens, vocab=vocab,
                                    xp=jnp)
  if audit:
    drawn = base.audit(counts, base.support_position(ids, n, tokens, jnp), draws, jnp)
  else:
    drawn = jnp.ones(row_status.shape, bool)
  return counts, row_status, drawn


@x64.scoped
def sparse_verdict(rows: base.Rows, draws: ArrayLike | None, vocab: int
                    ) -> tuple[jax.Array, jax.Array, jax.Array]:
  audit = draws is not None
  draws = np.zeros(np.shape(rows.tokens), np.uint32) if not audit else draws
  return _sparse(rows.values, rows.ids, rows.n, rows.tokens,
                 np.asarray(draws, np.uint32), vocab=int(vocab), audit=audit)
