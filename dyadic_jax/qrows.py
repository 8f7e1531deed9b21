"""Validation of received dyadic q rows, on their float32 bit patterns.

One kernel per q format, written once against an array namespace `xp`
(numpy or jax.numpy), so the host (wire, bridge staging) and the device
(`q_to_counts`, the verifier) give the same verdict for the same bits:

    dense(bits, token=None, *, vocab=None, xp)     -> (counts [..., N], status [...])
    sparse(bits, ids, n, token=None, *, vocab, xp) -> (counts [..., k], status [...])
    sparse_counts(counts, ids, n, token=None, *, vocab, xp)   (a SparseQ's
                                                   integer counts, same order)
    fine_counts(bits, bad, xp)  -> each entry's count if fine, else `bad`
                                   (the verifier's dense pass on CPU)

`bits` is the float32 q viewed as uint32 (`q.view(np.uint32)`,
`lax.bitcast_convert_type(q, jnp.uint32)`). Every check is an integer
operation on the sign, exponent and mantissa fields, never a float compare:
XLA CPU flushes float32 subnormals to zero in comparisons, which would let a
subnormal q (not on the 2^-24 grid) or a negative subnormal pass. Verdicts:

* 0x00000000 and 0x80000000 (-0.0) are zero;
* a sign bit with a nonzero magnitude is NEGATIVE (0x80000001 too);
* a positive value above 1 (bits > 0x3f800000) is WRONG_MASS;
* a positive value is dyadic iff it is a multiple of 2^-24: its exponent is
  at least that of 2^-24 and the mantissa bits below 2^-24 are zero; every
  subnormal is NON_DYADIC. The count is then c = q 2^24 exactly.

Each row gets the first failing class in a fixed order (docs/numerics.md,
"The q codec"), the order of the wire's `validate_q_row` with its NON_FINITE
split into NAN and INF:

    dense:  TOKEN_OUT_OF_RANGE, NAN, INF, NEGATIVE, WRONG_MASS (a value
            above 1), NON_DYADIC, PADDING_NONZERO (nonzero at an id >= vocab),
            WRONG_MASS (the exact sum of counts is not 2^24), ZERO_Q_AT_TOKEN
    sparse: TOKEN_OUT_OF_RANGE, MISSING_Q (n outside [1, k]), ID_OUT_OF_RANGE,
            DUPLICATE_ID (any duplicate among live ids, sorted or not, even
            with zero q), UNSORTED_IDS, NAN, INF, NEGATIVE, WRONG_MASS (> 1),
            NON_DYADIC, WRONG_MASS (sum), ZERO_Q_AT_TOKEN (the token absent
            from the live support, or its count zero)

A wire row may list ids with q = 0 (n counts the entries sent) and its
entries past n are framing, never read. A `SparseQ` (`sparse_counts`) is
the canonical form: every entry past n must be (id -1, count 0), else
PADDING_NONZERO (in the class order after NON_DYADIC, as in `dense`), and a
live count of 0 is MISSING_Q (n counts an entry with no q), after the sum.

Refused rows get all-zero counts. Nothing is renormalized.

Cost: one elementwise pass that classifies every entry and extracts its
count, then two reductions per row (the minimum class, the count sum). The
sum runs in float64 (integers below 2^53: exact; XLA CPU reduces float64
several times faster than int64). With jax.numpy the kernel needs 64-bit
types: it runs in the library's scoped x64 mode (dyadic_jax/x64.py).
"""

import types
from typing import Any

import numpy as np

from dyadic_jax import x64
from dyadic_jax.constants import LOG2_M, M, Status

_MAGNITUDE = 0x7FFFFFFF
_INF_BITS = 0x7F800000
_ONE_BITS = 0x3F800000        # 1.0f
_MANTISSA = 0x007FFFFF
_HIDDEN = 0x00800000
_ONE_EXPONENT = 127           # biased exponent of 1.0
# Smallest biased exponent of a multiple of 2^-24 (2^-24 itself).
_GRID_EXPONENT = _ONE_EXPONENT - LOG2_M

# Per-entry classes, numbered in the order of the row verdict: the row's
# first failing class is the minimum over its entries.
(_NAN, _INF, _NEGATIVE, _ABOVE_ONE, _NON_DYADIC, _PADDING,
 _FINE) = range(7)
_CLASS_STATUS = (Status.NAN, Status.INF, Status.NEGATIVE, Status.WRONG_MASS,
                 Status.NON_DYADIC, Status.PADDING_NONZERO, Status.OK)


def _check_bits(op, bits):
  if bits.dtype != np.uint32:
    raise TypeError(f"qrows.{op}: bits must be uint32 (the float32 q viewed "
                    f"as uint32), got {bits.dtype}")
  if bits.ndim < 1:
    raise ValueError(f"qrows.{op}: bits must have a trailing row axis, got "
                     f"shape {bits.shape}")


def _check_token(op, token, batch):
  if token is not None and tuple(token.shape) != tuple(batch):
    raise ValueError(f"qrows.{op}: token shape {tuple(token.shape)} must be "
                     f"the batch shape {tuple(batch)}")


def classify(bits: Any, xp: types.ModuleType) -> tuple[Any, Any]:
  """(class int32, count int32) of every entry of uint32 bits (any shape).

  class is the entry's first failing class (_NAN .. _NON_DYADIC) or _FINE;
  count is q 2^24 for a fine entry and 0 otherwise. Integer operations only.
  """
  u32 = xp.uint32
  mag = bits & u32(_MAGNITUDE)
  exponent = (mag >> u32(23)).astype(xp.int32)
  # c = (2 * significand) >> (127 - exponent): exact for 2^-24 <= q <= 1.
  sig2 = ((mag & u32(_MANTISSA)) | u32(_HIDDEN)) << u32(1)
  shift = xp.clip(_ONE_EXPONENT - exponent, 0, 31).astype(u32)
  below_grid = sig2 & ((u32(1) << shift) - u32(1))
  dyadic = (mag == u32(0)) | ((exponent >= _GRID_EXPONENT)
                              & (below_grid == u32(0)))
  cls = xp.where(
      mag > u32(_INF_BITS), _NAN, xp.where(
          mag == u32(_INF_BITS), _INF, xp.where(
              (bits != mag) & (mag != u32(0)), _NEGATIVE, xp.where(
                  mag > u32(_ONE_BITS), _ABOVE_ONE, xp.where(
                      dyadic, _FINE, _NON_DYADIC))))).astype(xp.int32)
  fine = cls == _FINE
  count = xp.where(fine & (mag != u32(0)), sig2 >> shift, u32(0))
  return cls, count.astype(xp.int32)


_GRID_BITS = _GRID_EXPONENT << 23   # 2^-24, the smallest positive fine q


def fine_counts(bits: Any, bad: int, xp: types.ModuleType) -> Any:
  """int32 of every entry of uint32 bits: its count where `classify` calls
  it fine, `bad` everywhere else; exactly
  `where(classify(bits)[0] == FINE, classify(bits)[1], bad)`.

  The same predicate in a third of the operations (no class chain), for
  the verifier's dense pass on XLA CPU: a fine entry is +-0.0, or a q in
  [2^-24, 1] (bits 0x33800000..0x3f800000: no sign, no NaN or INF, no
  subnormal) whose count c = 2 significand >> (127 - e) shifts back to the
  significand (no bit below 2^-24). `bad` must fit in int32. With numpy,
  the same predicate by table (`_fine_counts_np`).
  """
  if xp is np:
    return _fine_counts_np(bits, bad)
  u32 = xp.uint32
  positive = (bits >= u32(_GRID_BITS)) & (bits <= u32(_ONE_BITS))
  exponent = (bits >> u32(23)).astype(xp.int32)
  # clip's numpy wrapper costs more than the pass on a small batch.
  shift = xp.minimum(xp.maximum(_ONE_EXPONENT - exponent, 0), 31).astype(u32)
  sig2 = ((bits & u32(_MANTISSA)) | u32(_HIDDEN)) << u32(1)
  count = sig2 >> shift
  fine = positive & ((count << shift) == sig2)
  zero = (bits & u32(_MAGNITUDE)) == u32(0)
  return xp.where(fine, count, xp.where(zero, u32(0), u32(bad))).astype(
      xp.int32)


def _clear_bits() -> np.ndarray:
  """Per sign and exponent field (bits >> 23): the bits a fine entry of
  that field must have clear. Exponent 0 (either sign): the mantissa (only
  +-0.0 is fine). Biased exponent e in [103, 126]: the 126 - e mantissa
  bits below 2^-24; e = 127: the whole mantissa (only 1.0). Any other
  field (negative, above 1, NaN, INF, below 2^-24): every bit (no such
  entry is zero)."""
  table = np.full(512, 0xFFFFFFFF, np.uint32)
  table[[0, 256]] = _MANTISSA
  for e in range(_GRID_EXPONENT, _ONE_EXPONENT):
    table[e] = (1 << (_ONE_EXPONENT - 1 - e)) - 1
  table[_ONE_EXPONENT] = _MANTISSA
  return table


_CLEAR_BITS = _clear_bits()


def _fine_counts_np(bits: np.ndarray, bad: int) -> np.ndarray:
  # A numpy call costs about a microsecond whatever its size: fewer calls
  # than the shift form. A fine entry is zero or normal, so its float32
  # times 2^24 is its count exactly (even with denormals flushed).
  fine = (bits & _CLEAR_BITS[bits >> np.uint32(23)]) == 0
  q = np.where(fine, bits.view(np.float32), np.float32(0))
  return np.where(fine, (q * np.float32(M)).astype(np.int32),
                  np.int32(bad))


_INT32_MIN, _INT32_MAX = -2 ** 31, 2 ** 31 - 1


def saturate_int32(x: Any, xp: types.ModuleType) -> Any:
  """x (any integer dtype) as int32, values beyond int32 clamped to its ends.

  Verdict-preserving for every integer field of a q row: each bound the
  checks use (-1, 0, 1, k, V, M) lies strictly inside int32, so a clamped
  value fails exactly the checks the value fails, and a row's sum is only
  read when every count is in [0, M] (unclamped). A plain cast would wrap
  (2^32 + 2^22 -> 2^22).
  """
  info = np.iinfo(x.dtype)
  if info.min < _INT32_MIN:
    x = xp.maximum(x, xp.asarray(_INT32_MIN, x.dtype))
  if info.max > _INT32_MAX:
    x = xp.minimum(x, xp.asarray(_INT32_MAX, x.dtype))
  return x.astype(xp.int32)


def classify_counts(counts: Any, xp: types.ModuleType) -> tuple[Any, Any]:
  """(class int32, count int32) of int32 counts c (any shape): `classify`
  on integers, exactly: NEGATIVE below 0, _ABOVE_ONE above M (q > 1), else
  fine with the count c."""
  cls = xp.where(counts < 0, _NEGATIVE, xp.where(
      counts > M, _ABOVE_ONE, _FINE)).astype(xp.int32)
  return cls, xp.where(cls == _FINE, counts, 0).astype(xp.int32)


def _row_sum(counts, xp):
  # Exact: each count <= 2^24 and rows are far shorter than 2^29 entries.
  return xp.sum(counts.astype(xp.float64), axis=-1)


def _barrier(xp, *xs):
  """Keeps XLA from fusing sibling reductions into one slow multi-output one."""
  if xp is np:
    return xs
  from jax import lax  # pylint: disable=g-import-not-at-top
  return lax.optimization_barrier(xs)


def _first_class(cls, xp):
  return xp.min(cls, axis=-1, initial=_FINE)


def _status_of_class(first, xp):
  return xp.asarray(np.asarray(_CLASS_STATUS, np.int32))[first]


def _token_range(token, vocab):
  """The first check of every format: the token in [0, vocab) (if given)."""
  if token is None:
    return []
  return [((token < 0) | (token >= vocab), int(Status.TOKEN_OUT_OF_RANGE))]


def _first_status(checks, xp):
  """The code of the first (condition, code) pair that holds, else OK."""
  return xp.select([c for c, _ in checks], [code for _, code in checks],
                   int(Status.OK))


def _finish(status, counts, xp):
  ok = status == Status.OK
  return (xp.where(ok[..., None], counts, 0).astype(xp.int32),
          status.astype(xp.int32))


def _dense(bits, token, vocab, xp):
  cls, counts = classify(bits, xp)
  ids = xp.arange(bits.shape[-1])
  cls = xp.where((ids >= vocab) & (cls == _FINE) & (counts != 0), _PADDING,
                 cls)
  first = _first_class(cls, xp)
  cls, counts, first = _barrier(xp, cls, counts, first)
  total = _row_sum(counts, xp)
  checks = _token_range(token, vocab) + [
      (first != _FINE, _status_of_class(first, xp)),
      (total != M, int(Status.WRONG_MASS))]
  if token is not None:
    at = xp.clip(token.astype(xp.int32), 0, bits.shape[-1] - 1)[..., None]
    checks.append((xp.take_along_axis(counts, at, axis=-1)[..., 0] == 0,
                   int(Status.ZERO_Q_AT_TOKEN)))
  return _finish(_first_status(checks, xp), counts, xp)


_dense_x64 = x64.scoped(_dense, "qrows.dense")


def dense(bits: Any, token: Any = None, *, vocab: Any = None,
          xp: types.ModuleType = np) -> tuple[Any, Any]:
  """Validates dense q rows; returns (counts int32[..., N], status int32[...]).

  Args:
    bits: uint32[..., N], the float32 q rows viewed as uint32.
    token: optional int[...], the token sampled from each row (None: no
      token checks).
    vocab: V (default N); ids in [V, N) are padding and must be zero.
    xp: numpy or jax.numpy.
  """
  bits = xp.asarray(bits)
  _check_bits("dense", bits)
  n = bits.shape[-1]
  if vocab is None:
    vocab = n
  elif isinstance(vocab, (int, np.integer)) and not 1 <= vocab <= n:
    raise ValueError(f"qrows.dense: vocab={vocab} not in [1, {n}]")
  if token is not None:
    token = xp.asarray(token)
  _check_token("dense", token, bits.shape[:-1])
  if xp is np:
    return _dense(bits, token, vocab, xp)
  return _dense_x64(bits, token, vocab, xp)


def _sparse(bits, ids, n, token, vocab, xp):
  return _sparse_rows(*classify(bits, xp), ids, n, token, vocab, xp,
                      strict_padding=False)


def _sparse_rows(cls, counts, ids, n, token, vocab, xp, strict_padding):
  """The sparse verdict from each entry's class and count.

  strict_padding (a SparseQ): entries past n must be (id -1, count 0), else
  PADDING_NONZERO, and live counts positive, else MISSING_Q; otherwise (a
  wire row) entries past n are not read and a live q may be 0.
  """
  k = cls.shape[-1]
  pos = xp.arange(k)
  n = n.astype(xp.int32)
  live = pos < n[..., None]
  ids = ids.astype(xp.int32)
  missing = (n < 1) | (n > k)
  id_bad = xp.any(live & ((ids < 0) | (ids >= vocab)), axis=-1)
  # Padding keys are distinct and above every valid id, so after the sort
  # equal neighbours are duplicate live ids (once all live ids are valid).
  keys = xp.sort(xp.where(live, ids, vocab + pos), axis=-1)
  duplicate = xp.any(keys[..., 1:] == keys[..., :-1], axis=-1)
  unsorted = xp.any(live[..., 1:] & (ids[..., 1:] <= ids[..., :-1]), axis=-1)
  if strict_padding:
    stray = (cls == _FINE) & ((counts != 0) | (ids != -1))
    cls = xp.where(live | ~stray, cls, _PADDING)
  else:
    cls = xp.where(live, cls, _FINE)
  counts = xp.where(live, counts, 0)
  first = _first_class(cls, xp)
  total = _row_sum(counts, xp)
  checks = _token_range(token, vocab) + [
      (missing, int(Status.MISSING_Q)), (id_bad, int(Status.ID_OUT_OF_RANGE)),
      (duplicate, int(Status.DUPLICATE_ID)),
      (unsorted, int(Status.UNSORTED_IDS)),
      (first != _FINE, _status_of_class(first, xp)),
      (total != M, int(Status.WRONG_MASS))]
  if token is not None:
    held = live & (ids == token.astype(xp.int32)[..., None]) & (counts > 0)
    checks.append((~xp.any(held, axis=-1), int(Status.ZERO_Q_AT_TOKEN)))
  if strict_padding:
    # A live count of 0: n counts an entry that holds no q (the canonical
    # support is exactly the positive counts).
    checks.append((xp.any(live & (counts == 0), axis=-1),
                   int(Status.MISSING_Q)))
  return _finish(_first_status(checks, xp), counts, xp)


_sparse_x64 = x64.scoped(_sparse, "qrows.sparse")


def sparse(bits: Any, ids: Any, n: Any, token: Any = None, *, vocab: Any,
           xp: types.ModuleType = np) -> tuple[Any, Any]:
  """Validates sparse q rows; returns (counts int32[..., k], status int32[...]).

  Args:
    bits: uint32[..., k], the float32 q values viewed as uint32.
    ids: int32[..., k] global ids of the values.
    n: int[...], live entries per row: the first n entries are the row, the
      rest is padding and ignored (its counts come back 0).
    token: optional int[...], the token sampled from each row.
    vocab: V; live ids must lie in [0, V). V + k must stay below 2^31.
    xp: numpy or jax.numpy.
  """
  bits, ids, n = xp.asarray(bits), xp.asarray(ids), xp.asarray(n)
  _check_bits("sparse", bits)
  batch = bits.shape[:-1]
  if ids.shape != bits.shape or tuple(n.shape) != tuple(batch):
    raise ValueError(f"qrows.sparse: need ids {tuple(bits.shape)} and n "
                     f"{tuple(batch)}, got {tuple(ids.shape)} and "
                     f"{tuple(n.shape)}")
  if isinstance(vocab, (int, np.integer)) and not (
      1 <= vocab and vocab + bits.shape[-1] < 2 ** 31):
    raise ValueError(f"qrows.sparse: vocab={vocab} must be >= 1 with "
                     f"vocab + k < 2^31")
  if token is not None:
    token = xp.asarray(token)
  _check_token("sparse", token, batch)
  if xp is np:
    return _sparse(bits, ids, n, token, vocab, xp)
  return _sparse_x64(bits, ids, n, token, vocab, xp)


def _sparse_counts(counts, ids, n, token, vocab, xp):
  counts, ids, n = (saturate_int32(xp.asarray(a), xp)
                    for a in (counts, ids, n))
  return _sparse_rows(*classify_counts(counts, xp), ids, n, token, vocab, xp,
                      strict_padding=True)


_sparse_counts_x64 = x64.scoped(_sparse_counts, "qrows.sparse_counts")


def _dtype(a):
  return a.dtype if hasattr(a, "dtype") else np.asarray(a).dtype


def sparse_counts(counts: Any, ids: Any, n: Any, token: Any = None, *,
                  vocab: Any, xp: types.ModuleType = np
                  ) -> tuple[Any, Any]:
  """`sparse` on integer counts (a `SparseQ`); returns (counts int32[..., k],
  status int32[...]).

  Judged on the exact integer values of any integer dtype
  (`saturate_int32`), never through float32 (float32(2^24 + 1) is 2^24).
  The checks and their order are `sparse`'s, for the canonical form: an
  entry past n is classified like a live one (NEGATIVE, WRONG_MASS above
  M) and must then be (id -1, count 0), else PADDING_NONZERO (the class
  after NON_DYADIC's place, as in `dense`); after the sum (and the token),
  a live count of 0 is MISSING_Q.

  Args:
    counts, ids: integer [..., k]; n: integer [...]; token, vocab, xp: as
      `sparse`.
  """
  for name, a in (("counts", counts), ("ids", ids), ("n", n)):
    if not np.issubdtype(_dtype(a), np.integer):
      raise TypeError(f"qrows.sparse_counts: {name} must be integers, got "
                      f"{_dtype(a)}")
  shape = np.shape(counts)
  if len(shape) < 1 or np.shape(ids) != shape or np.shape(n) != shape[:-1]:
    raise ValueError(f"qrows.sparse_counts: need counts and ids [..., k] and "
                     f"n [...], got {shape}, {np.shape(ids)} and "
                     f"{np.shape(n)}")
  if isinstance(vocab, (int, np.integer)) and not (
      1 <= vocab and vocab + shape[-1] < 2 ** 31):
    raise ValueError(f"qrows.sparse_counts: vocab={vocab} must be >= 1 with "
                     f"vocab + k < 2^31")
  if token is not None:
    token = xp.asarray(token)
  _check_token("sparse_counts", token, shape[:-1])
  if xp is np:
    return _sparse_counts(counts, ids, n, token, vocab, xp)
  return _sparse_counts_x64(counts, ids, n, token, vocab, xp)
