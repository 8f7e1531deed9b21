"""The dense verdict's host pass: one compiled sweep over the staged rows.

    sweep(values, tokens, counts) -> (total, before, at)   int64[rows] each

values: float32[rows, V], C-contiguous (a staged slot or a view of one);
tokens: int32[rows]; counts: int32[rows, V], written. For each entry the
sweep writes its count where it is fine and M + 1 elsewhere
(`qrows.fine_counts` with bad = M + 1, the same predicate), and per row it
returns the exact sum of what it wrote (total), the sum before the token
(before, the sampling audit's mass) and the entry at the token (at; 0 when
the token is outside [0, V)). A row is valid iff total == M and at > 0: one
entry that is not fine puts the total above M, since every written value is
>= 0. The sums are int64 and cannot wrap (V (M + 1) < 2^63).

Why a compiled kernel: XLA CPU runs row reductions (integer, or several at
once) far below memory speed, and numpy needs a pass per operation, so the
previous host path (one XLA pass that wrote the counts, numpy's segment
sums, then the running sums) read the batch three times. This is one read
of q and one write of the counts, the least the verifier needs since
verification takes the counts (experiments/bench_bridge.py, `validate`
against `rowsum` and `memcpy`).

The predicate, per entry, on its bit pattern b and float32 value q: fine
is +-0.0 (count 0), or b in [bits(2^-24), bits(1.0)] (no sign, no NaN or
INF, no subnormal, nothing above 1) with q 2^24 an integer. For such b, q
is normal and q 2^24 lies in [1, 2^24], so that product, its truncation to
int32 and back are exact whatever the FPU's denormal mode. The float value
is clamped to [0, 2^24] before the conversion so that it is defined for
every other entry too, whose result the bit tests then discard. numba
compiles it once per machine (cached beside this file, or in the user's
cache where that is read-only); tests/wire/test_dense_verdict.py holds it
to the previous host path, the device kernel, `qrows.dense` and the
oracle on every class of entry.
"""

import numba
import numpy as np

from dyadic_jax.constants import LOG2_M, M

_U32 = np.uint32
_GRID_BITS = _U32((127 - LOG2_M) << 23)   # 2^-24, the least positive fine q
_ONE_BITS = _U32(0x3F800000)              # 1.0
_MAGNITUDE = _U32(0x7FFFFFFF)
_ZERO = _U32(0)
_SCALE = np.float32(M)
_FLOOR = np.float32(0.0)
_BAD = np.int32(M + 1)
_NONE = np.int32(0)


@numba.njit(cache=True, inline="always", boundscheck=False)
def _entry(b: np.uint32, q: np.float32) -> np.int32:   # pragma: no cover
  y = q * _SCALE
  x = y if y <= _SCALE else _SCALE      # NaN too: the bit tests refuse it
  x = x if x >= _FLOOR else _FLOOR
  c = np.int32(x)
  fine = (b >= _GRID_BITS) & (b <= _ONE_BITS) & (np.float32(c) == y)
  zero = (b & _MAGNITUDE) == _ZERO
  return c if fine else (_NONE if zero else _BAD)


# A plain loop over one flat span: the shape LLVM vectorizes (a loop over
# a row of a 2-D array, or with the token split inside it, was not).
@numba.njit(cache=True, boundscheck=False)
def _span(bits: np.ndarray, q: np.ndarray, out: np.ndarray
          ) -> np.int64:   # pragma: no cover
  s = np.int64(0)
  for i in range(bits.shape[0]):
    v = _entry(bits[i], q[i])
    out[i] = v
    s += np.int64(v)
  return s


@numba.njit(cache=True, boundscheck=False)
def _sweep(bits: np.ndarray, q: np.ndarray, tokens: np.ndarray,
           out: np.ndarray
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:   # pragma: no cover
  rows = tokens.shape[0]
  vocab = bits.shape[0] // rows if rows else 0
  total = np.zeros(rows, np.int64)
  before = np.zeros(rows, np.int64)
  at = np.zeros(rows, np.int64)
  for r in range(rows):
    start = r * vocab
    token = tokens[r]
    split = start + min(max(token, 0), vocab)
    end = start + vocab
    before[r] = _span(bits[start:split], q[start:split], out[start:split])
    total[r] = before[r] + _span(bits[split:end], q[split:end],
                                 out[split:end])
    if 0 <= token < vocab:
      at[r] = out[start + token]
  return total, before, at


def sweep(values: np.ndarray, tokens: np.ndarray, counts: np.ndarray
          ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """(total, before, at) of float32 rows [rows, V]; writes `counts`
  (int32 [rows, V]). See the module docstring."""
  if values.dtype != np.float32 or values.ndim != 2:
    raise TypeError(f"dense_host.sweep: values must be float32[rows, V], "
                    f"got {values.dtype}{list(values.shape)}")
  if counts.shape != values.shape or counts.dtype != np.int32:
    raise TypeError(f"dense_host.sweep: counts must be int32"
                    f"{list(values.shape)}, got {counts.dtype}"
                    f"{list(counts.shape)}")
  if tokens.shape != values.shape[:1]:
    raise ValueError(f"dense_host.sweep: tokens of shape {tokens.shape} for "
                     f"{values.shape[0]} rows")
  flat = np.ascontiguousarray(values).reshape(-1)
  return _sweep(flat.view(np.uint32), flat, np.asarray(tokens, np.int32),
                counts.reshape(-1))
