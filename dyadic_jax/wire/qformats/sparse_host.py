"""The sparse verdict's host pass: one compiled loop over the staged rows.

    verdict(rows, draws, vocab) -> Verdict   (counts int32[..., D, k],
                                              codes int32[..., D])

The verifier's staged sparse batch (`SparseFormat.validate(...,
device=True)` on a CPU backend, or up to `sparse.HOST_ENTRIES` entries on
an accelerator) is judged here, row by row, in one numba-compiled call: the
same counts and the same `Code` per row as the core kernel `qrows.sparse`
(numpy) mapped by `status.codes`, then the sampling audit as `base.audit`
and `base.with_audit` apply it. It replaced a dozen numpy passes (about
30 numpy calls a batch, each ~1 us whatever its size) that decided only
validity and sent refused rows back to the kernel for their code.

Each row gets the first failing class in the kernel's order
(docs/numerics.md, "The q codec"; `qrows` module docstring):

    TOKEN_OUT_OF_RANGE  token outside [0, V)
    MISSING_Q           n outside [1, k]
    ID_OUT_OF_RANGE     a live id (the first n) outside [0, V)
    DUPLICATE_ID        two equal live ids (anywhere, with zero q too)
    UNSORTED_IDS        live ids not strictly ascending
    NON_FINITE, NEGATIVE, WRONG_MASS (q > 1), NON_DYADIC
                        the least class over the live entries (`qrows`'s
                        classes: NaN before INF before a sign before a
                        value above 1 before one off the 2^-24 grid)
    WRONG_MASS          the exact sum of the live counts is not 2^24
    ZERO_Q_AT_TOKEN     the token is no live id, or its count is 0
    SAMPLING_MISMATCH   (draws given) the draw u (the uint32 read as
                        int32, as `base.audit` does) is outside
                        [prefix, prefix + count) at the token's place

Entries past n are never read. A row refused before the audit has all-zero
counts; a valid row (code 0 or SAMPLING_MISMATCH) its live counts and
zeros past n. How each test is made, and why it is the kernel's:

* ids, one pass over the live ids: any outside [0, V), and whether they
  strictly ascend. Ascending ids hold no duplicate; otherwise the live ids
  are sorted (a copy, O(n log n): a peer's unsorted rows cost no more)
  and equal neighbours decide DUPLICATE_ID before UNSORTED_IDS, as the
  kernel's sort does.
* entries, on the bit pattern b (integers only, whatever the FPU's
  denormal mode): fine is +-0.0 (count 0) or b in [bits(2^-24), bits(1.0)]
  whose count c = (2 significand) >> (127 - exponent) shifts back to it
  (no bit below 2^-24), exactly `qrows.classify`'s FINE; any other entry
  gets `classify`'s class by its chain (rare: only refused rows).
* the sum is int64 over counts <= 2^24 each (k < 2^39 entries: exact).
* the token's place: the first live id equal to it (ids ascend here, so
  the only one); the audit's prefix is the sum of the counts before it,
  exact in int64 and equal to `base.audit`'s int32 sum on a valid row.

numba compiles it once per machine for one signature (arrays of any
layout, read-only or not; cached beside this file, or in the user's cache
where that is read-only). tests/wire/test_sparse_verdict.py holds it to
the kernel (numpy and jitted), the numpy host pass it replaced (frozen in
the test), `reference.sparse_q_counts` and the audit's oracle on every
class, on random valid batches and on mutations of them.
"""

import numba
from numba import types
import numpy as np
from numpy.typing import ArrayLike

from dyadic_jax.constants import LOG2_M, M
from dyadic_jax.wire.qformats import base
from dyadic_jax.wire.refusals import Code

_U32 = np.uint32
_MAGNITUDE = _U32(0x7FFFFFFF)
_INF_BITS = _U32(0x7F800000)
_ONE_BITS = _U32(0x3F800000)              # 1.0
_GRID_BITS = _U32((127 - LOG2_M) << 23)   # 2^-24, the least positive fine q
_MANTISSA = _U32(0x007FFFFF)
_HIDDEN = _U32(0x00800000)
_ZERO = _U32(0)
_NOT_FINE = np.int64(-1)

_TOKEN_OUT_OF_RANGE = np.int32(Code.TOKEN_OUT_OF_RANGE)
_MISSING_Q = np.int32(Code.MISSING_Q)
_ID_OUT_OF_RANGE = np.int32(Code.ID_OUT_OF_RANGE)
_DUPLICATE_ID = np.int32(Code.DUPLICATE_ID)
_UNSORTED_IDS = np.int32(Code.UNSORTED_IDS)
_NON_FINITE = np.int32(Code.NON_FINITE)
_NEGATIVE = np.int32(Code.NEGATIVE)
_WRONG_MASS = np.int32(Code.WRONG_MASS)
_NON_DYADIC = np.int32(Code.NON_DYADIC)
_ZERO_Q_AT_TOKEN = np.int32(Code.ZERO_Q_AT_TOKEN)
_SAMPLING_MISMATCH = np.int32(Code.SAMPLING_MISMATCH)
_OK = np.int32(0)
# An entry's class, numbered in the row verdict's order (`qrows`'s NAN ..
# NON_DYADIC, FINE last): the row's class is the least over its entries.
(_C_NAN, _C_INF, _C_NEGATIVE, _C_ABOVE_ONE, _C_NON_DYADIC,
 _C_FINE) = range(6)

@numba.njit(cache=True, boundscheck=False, nogil=True, inline="always")
def _count(b: np.uint32) -> np.int64:   # pragma: no cover
  """A fine entry's count (0 for +-0.0), else -1."""
  if (b & _MAGNITUDE) == _ZERO:
    return np.int64(0)
  if b < _GRID_BITS or b > _ONE_BITS:
    return _NOT_FINE
  shift = _U32(127) - (b >> _U32(23))           # 0..24
  sig2 = ((b & _MANTISSA) | _HIDDEN) << _U32(1)
  c = sig2 >> shift
  return np.int64(c) if (c << shift) == sig2 else _NOT_FINE


@numba.njit(cache=True, boundscheck=False, nogil=True, inline="always")
def _class(b: np.uint32) -> int:   # pragma: no cover
  """`qrows.classify`'s class of an entry that is not fine."""
  mag = b & _MAGNITUDE
  if mag > _INF_BITS:
    return _C_NAN
  if mag == _INF_BITS:
    return _C_INF
  if b != mag:            # a sign with a nonzero magnitude
    return _C_NEGATIVE
  if mag > _ONE_BITS:
    return _C_ABOVE_ONE
  return _C_NON_DYADIC


@numba.njit(cache=True, boundscheck=False, nogil=True)
def _ids(ids: np.ndarray, r: int, n: int,
         vocab: int) -> np.int32:   # pragma: no cover
  """The ids' verdict of row r's n live ids (1 <= n <= k), or OK."""
  ascending = True
  for i in range(n):
    x = ids[r, i]
    if x < 0 or x >= vocab:
      return _ID_OUT_OF_RANGE
    if i and x <= ids[r, i - 1]:
      ascending = False
  if ascending:
    return _OK
  keys = np.sort(ids[r, :n])    # a copy; rare (a refused row)
  for i in range(1, n):
    if keys[i] == keys[i - 1]:
      return _DUPLICATE_ID
  return _UNSORTED_IDS


def _verdict(bits: np.ndarray, ids: np.ndarray, n: np.ndarray,
             tokens: np.ndarray, draws: np.ndarray, audit: bool,
             vocab: int) -> tuple[np.ndarray, np.ndarray]:   # pragma: no cover
  rows, k = bits.shape
  counts = np.zeros((rows, k), np.int32)
  codes = np.zeros(rows, np.int32)
  for r in range(rows):
    token, live = tokens[r], n[r]
    if token < 0 or token >= vocab:
      codes[r] = _TOKEN_OUT_OF_RANGE
      continue
    if live < 1 or live > k:
      codes[r] = _MISSING_Q
      continue
    code = _ids(ids, r, live, vocab)
    if code:
      codes[r] = code
      continue
    least = _C_FINE
    total = np.int64(0)
    before = np.int64(-1)    # the counts before the token's place
    at = np.int64(0)         # the count at it
    for i in range(live):
      b = bits[r, i]
      c = _count(b)
      if c < 0:
        least = min(least, _class(b))
        continue
      if ids[r, i] == token:
        before, at = total, c
      total += c
      counts[r, i] = np.int32(c)
    if least != _C_FINE:
      code = (_NON_FINITE if least <= _C_INF else _NEGATIVE
              if least == _C_NEGATIVE else _WRONG_MASS
              if least == _C_ABOVE_ONE else _NON_DYADIC)
    elif total != M:
      code = _WRONG_MASS
    elif at == 0:            # no live id is the token, or its q is 0
      code = _ZERO_Q_AT_TOKEN
    if code:
      codes[r] = code
      counts[r, :live] = 0
    elif audit:
      u = np.int64(draws[r])
      if u >= 2 ** 31:       # base.audit's int32 view of the uint32 draw
        u -= 2 ** 32
      if not before <= u < before + at:
        codes[r] = _SAMPLING_MISMATCH
  return counts, codes


def _array(dtype: types.Type, ndim: int) -> types.Array:
  return types.Array(dtype, ndim, "A", readonly=True, aligned=False)


# One signature: any layout, read-only or writable, any alignment (a view of
# a received message or a staging slot) converts to it; eager, so no first
# call pays the compile (it is cached on disk).
_compiled = numba.njit(
    types.Tuple((types.Array(types.int32, 2, "C"),
                 types.Array(types.int32, 1, "C")))(
        _array(types.uint32, 2), _array(types.int32, 2),
        _array(types.int32, 1), _array(types.int32, 1),
        _array(types.uint32, 1), types.boolean, types.int64),
    cache=True, boundscheck=False, nogil=True)(_verdict)
_NO_DRAWS = np.zeros(0, np.uint32)


def verdict(rows: base.Rows, draws: ArrayLike | None,
            vocab: int) -> base.Verdict:
  """The Verdict of sparse rows [..., D, k] (see the module docstring).

  rows: int32 tokens, n and ids and float32 values (`base.checked_rows`);
  draws: uint32[..., D] PROPOSAL draws (None: no audit).
  """
  tokens, n, ids, values = rows
  assert ids is not None and values is not None    # sparse rows
  if values.dtype != np.float32 or not (
      tokens.dtype == n.dtype == ids.dtype == np.int32):
    # The loop reads bits and ids by one k (no bounds checks): no other
    # width may reach it.
    raise TypeError(f"sparse_host.verdict: rows must be int32 tokens, n and "
                    f"ids and float32 values, got {tokens.dtype}, {n.dtype},"
                    f" {ids.dtype}, {values.dtype}")
  shape, k = tokens.shape, values.shape[-1]
  if n.shape != shape or ids.shape != values.shape or (
      values.shape[:-1] != shape):
    raise ValueError(f"sparse_host.verdict: rows of shapes tokens "
                     f"{tokens.shape}, n {n.shape}, ids {ids.shape}, values "
                     f"{values.shape}")
  audit = draws is not None
  u = np.asarray(draws, np.uint32).reshape(-1) if audit else _NO_DRAWS
  if audit and u.shape[0] != tokens.size:
    raise ValueError(f"sparse_host.verdict: {u.shape[0]} draws for "
                     f"{tokens.size} rows")
  counts, codes = _compiled(values.reshape(-1, k).view(np.uint32),
                            ids.reshape(-1, k), n.reshape(-1),
                            tokens.reshape(-1), u, audit, int(vocab))
  return base.Verdict(counts.reshape(shape + (k,)), codes.reshape(shape))
