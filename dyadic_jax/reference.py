"""The exact rational oracle: every contract of the core, in `fractions`.

Pure Python on exact rationals (numpy only to accept arrays). Each function
mirrors one op of the library *as specified* (docs/numerics.md), so the
tests can demand bit-for-bit agreement, and it also computes the exact
output distributions of the implemented finite-precision verification
rules, so the total-variation bound is checked rather than assumed.

Float inputs are taken at their exact binary value (Fraction(float) is exact).
"""

from fractions import Fraction
import math
from typing import Any, Sequence

from dyadic_jax.constants import M, Status, TARGET_BITS

_TWO64 = 1 << 64
_FIXED_REMAINDER = 1 << 32


def _floats(xs):
  return [float(x) for x in (xs.tolist() if hasattr(xs, "tolist") else xs)]


_SMALLEST_NORMAL = 2.0 ** -1022


def weight_status(ws: Sequence[float]) -> Status:
  """Status of a weight row: NAN, INF, NEGATIVE, ZERO_MASS, else OK.

  On exact values: -1e-310 is NEGATIVE (-0.0 is not); a row whose only
  positive weights are subnormal is ZERO_MASS (they count as zero).
  """
  if any(math.isnan(w) for w in ws):
    return Status.NAN
  if any(math.isinf(w) for w in ws):
    return Status.INF
  if any(w < 0 for w in ws):
    return Status.NEGATIVE
  if all(w < _SMALLEST_NORMAL for w in ws):
    return Status.ZERO_MASS
  return Status.OK


def _normal_or_zero(ws):
  return [w if w >= _SMALLEST_NORMAL else 0.0 for w in ws]


def largest_remainder(weights: Any, total: int = M
                      ) -> tuple[list[int], Status]:
  """Floor + largest remainders of w * total; ties to the lowest index.

  Returns (counts list[int], Status). The consistency rule is the one of
  `allocate_dense`: R = total - sum floor(s_v) must satisfy 0 <= R <= #{r_v > 0}
  and |R 2^32 - sum floor(r_v 2^32)| < 2^32, and no weight may exceed 2.
  """
  ws = _floats(weights)
  n = len(ws)
  status = weight_status(ws)
  if status != Status.OK:
    return [0] * n, status
  ws = _normal_or_zero(ws)
  if any(w > 2.0 for w in ws):
    return [0] * n, Status.INCONSISTENT_MASS
  s = [Fraction(w) * total for w in ws]
  f = [math.floor(x) for x in s]
  r = [x - fx for x, fx in zip(s, f)]
  leftover = total - sum(f)
  positive = sum(1 for x in r if x > 0)
  r_fixed = sum(math.floor(x * _FIXED_REMAINDER) for x in r)
  if not (0 <= leftover <= positive
          and abs(leftover * _FIXED_REMAINDER - r_fixed) < _FIXED_REMAINDER):
    return [0] * n, Status.INCONSISTENT_MASS
  counts = list(f)
  for v in sorted(range(n), key=lambda v: (-r[v], v))[:leftover]:
    counts[v] += 1
  return counts, Status.OK


def allocate_dense(weights: Any) -> tuple[list[int], Status]:
  """Oracle of `dyadic_jax.allocate_dense` for one row."""
  return largest_remainder(weights, M)


def top_k_ids(weights: Any, k: int) -> list[int]:
  """Ascending ids of the top k by (weight desc, id asc)."""
  ws = _floats(weights)  # comparing floats is exact; no rounding involved
  return sorted(sorted(range(len(ws)), key=lambda v: (-ws[v], v))[:k])


def allocate_sparse(weights: Any, k: int
                    ) -> tuple[list[int], list[int], int, Status]:
  """Oracle of `dyadic_jax.allocate_sparse` for one row.

  Returns (ids, counts, n, Status) with padding (-1, 0) to length k.
  The support is renormalized with IEEE float64 arithmetic exactly as the
  contract states: W summed left to right in ascending-id order, then
  w_i * fl(1 / W).
  """
  ws = _floats(weights)
  status = weight_status(ws)
  if status != Status.OK:
    return [-1] * k, [0] * k, 0, status
  ws = _normal_or_zero(ws)
  ids = top_k_ids(ws, k)
  support = [ws[i] for i in ids]
  total = 0.0
  for w in support:
    total += w
  inverse = 1.0 / total  # IEEE: one rounding, then one per product
  counts, status = largest_remainder([w * inverse for w in support], M)
  if status != Status.OK:
    return [-1] * k, [0] * k, 0, status
  kept = [(i, c) for i, c in zip(ids, counts) if c > 0]
  pad = k - len(kept)
  return ([i for i, _ in kept] + [-1] * pad, [c for _, c in kept] + [0] * pad,
          len(kept), Status.OK)


def sample_counts(counts: Any, draw: int) -> int:
  """First index whose inclusive cumulative count is > draw (len if none)."""
  acc = 0
  for v, c in enumerate(int(c) for c in counts):
    acc += c
    if acc > draw:
      return v
  return len(counts)


def q_entry(x: float) -> tuple[Status, int]:
  """(Status, count) of one q value: its failing class, or OK and q M.

  On the exact value of the float (Python never flushes subnormals): NAN,
  INF, NEGATIVE (x < 0; -0.0 is zero), WRONG_MASS (x > 1), NON_DYADIC
  (x M not an integer), else (OK, x M).
  """
  x = float(x)
  if math.isnan(x):
    return Status.NAN, 0
  if math.isinf(x):
    return Status.INF, 0
  if x < 0:
    return Status.NEGATIVE, 0
  if x > 1:
    return Status.WRONG_MASS, 0
  s = Fraction(x) * M
  if s.denominator != 1:
    return Status.NON_DYADIC, 0
  return Status.OK, int(s)


_ENTRY_ORDER = (Status.NAN, Status.INF, Status.NEGATIVE, Status.WRONG_MASS,
                Status.NON_DYADIC)


def _first_entry_class(entries):
  classes = {status for status, _ in entries}
  for status in _ENTRY_ORDER:
    if status in classes:
      return status
  return Status.OK


def q_to_counts(q: Any, vocab_size: int | None = None,
                token: int | None = None) -> tuple[list[int], Status]:
  """Oracle of `dyadic_jax.q_to_counts` / `qrows.dense` for one float32 row.

  Order: TOKEN_OUT_OF_RANGE, NAN, INF, NEGATIVE, WRONG_MASS (a value above
  1), NON_DYADIC, PADDING_NONZERO, WRONG_MASS (sum), ZERO_Q_AT_TOKEN.
  """
  qs = _floats(q)
  n = len(qs)
  vocab = n if vocab_size is None else vocab_size
  zeros = [0] * n
  if token is not None and not 0 <= token < vocab:
    return zeros, Status.TOKEN_OUT_OF_RANGE
  entries = [q_entry(x) for x in qs]
  status = _first_entry_class(entries)
  if status != Status.OK:
    return zeros, status
  counts = [c for _, c in entries]
  if any(counts[v] for v in range(vocab, n)):
    return zeros, Status.PADDING_NONZERO
  if sum(counts) != M:
    return zeros, Status.WRONG_MASS
  if token is not None and counts[token] == 0:
    return zeros, Status.ZERO_Q_AT_TOKEN
  return counts, Status.OK


def sparse_q_counts(q: Any, ids: Any, n: int, vocab: int,
                    token: int | None = None) -> tuple[list[int], Status]:
  """Oracle of `qrows.sparse` for one row: (counts of all k entries, Status).

  The first n entries are live, the rest padding (count 0). Order:
  TOKEN_OUT_OF_RANGE, MISSING_Q (n outside [1, k]), ID_OUT_OF_RANGE,
  DUPLICATE_ID, UNSORTED_IDS, NAN, INF, NEGATIVE, WRONG_MASS (> 1),
  NON_DYADIC, WRONG_MASS (sum), ZERO_Q_AT_TOKEN. A live q of 0 is allowed
  (a wire row; the core's `SparseQ` is `sparse_q_status`).
  """
  qs = _floats(q)
  ids = [int(i) for i in (ids.tolist() if hasattr(ids, "tolist") else ids)]
  k, n = len(qs), int(n)
  zeros = [0] * k
  if token is not None and not 0 <= token < vocab:
    return zeros, Status.TOKEN_OUT_OF_RANGE
  if not 1 <= n <= k:
    return zeros, Status.MISSING_Q
  live = ids[:n]
  if any(not 0 <= i < vocab for i in live):
    return zeros, Status.ID_OUT_OF_RANGE
  if len(set(live)) != n:
    return zeros, Status.DUPLICATE_ID
  if live != sorted(live):
    return zeros, Status.UNSORTED_IDS
  entries = [q_entry(x) for x in qs[:n]]
  status = _first_entry_class(entries)
  if status != Status.OK:
    return zeros, status
  counts = [c for _, c in entries]
  if sum(counts) != M:
    return zeros, Status.WRONG_MASS
  if token is not None and dict(zip(live, counts)).get(token, 0) == 0:
    return zeros, Status.ZERO_Q_AT_TOKEN
  return counts + [0] * (k - n), Status.OK


def _ints(xs):
  return [int(x) for x in (xs.tolist() if hasattr(xs, "tolist") else xs)]


def _count_class(c):
  """The class of one exact integer count (the order of `_ENTRY_ORDER`)."""
  if c < 0:
    return Status.NEGATIVE
  if c > M:
    return Status.WRONG_MASS
  return Status.OK


_COUNT_ORDER = (Status.NEGATIVE, Status.WRONG_MASS, Status.PADDING_NONZERO)


def _first_count_class(classes):
  for status in _COUNT_ORDER:
    if status in classes:
      return status
  return Status.OK


def dense_q_status(counts: Any, vocab: int | None = None) -> Status:
  """Status of one `DenseQ` row of exact integer counts (any magnitude).

  The order of `verification.dense_q_status` (and of `q_to_counts` on
  q = c / M): NEGATIVE, WRONG_MASS (a count above M), PADDING_NONZERO (a
  nonzero count at an id >= vocab), WRONG_MASS (the sum is not M).
  """
  cs = _ints(counts)
  vocab = len(cs) if vocab is None else vocab
  classes = {_count_class(c) for c in cs}
  classes |= {Status.PADDING_NONZERO for c in cs[vocab:] if c != 0}
  status = _first_count_class(classes)
  if status != Status.OK:
    return status
  return Status.OK if sum(cs) == M else Status.WRONG_MASS


def sparse_q_status(ids: Any, counts: Any, n: int, vocab: int) -> Status:
  """Status of one `SparseQ` row of exact integers (any magnitude).

  The order of `qrows.sparse_counts`: MISSING_Q (n outside [1, k]),
  ID_OUT_OF_RANGE, DUPLICATE_ID, UNSORTED_IDS (live ids), then over every
  entry NEGATIVE, WRONG_MASS (a count above M), PADDING_NONZERO (an entry
  past n other than (id -1, count 0)), then WRONG_MASS (the live sum is not
  M), MISSING_Q (a live count of 0).
  """
  ids, cs, n = _ints(ids), _ints(counts), int(n)
  k = len(cs)
  if not 1 <= n <= k:
    return Status.MISSING_Q
  live = ids[:n]
  if any(not 0 <= i < vocab for i in live):
    return Status.ID_OUT_OF_RANGE
  if len(set(live)) != n:
    return Status.DUPLICATE_ID
  if live != sorted(live):
    return Status.UNSORTED_IDS
  classes = {_count_class(c) for c in cs}
  classes |= {Status.PADDING_NONZERO for i, c in zip(ids[n:], cs[n:])
              if (i, c) != (-1, 0)}
  status = _first_count_class(classes)
  if status != Status.OK:
    return status
  if sum(cs[:n]) != M:
    return Status.WRONG_MASS
  if 0 in cs[:n]:
    return Status.MISSING_Q
  return Status.OK


# ----------------------------------------------------------------------------
# Verification: exact distributions of the implemented integer rules.


def quantize_target(probs: Any) -> list[int]:
  """P_v = round(p_v 2^38), ties to even, for float64 probabilities p.

  With p from `dyadic_jax.target_probs`, these are the P of verification
  and of the target-only sampler.
  """
  return [round(Fraction(p) * (1 << TARGET_BITS)) for p in _floats(probs)]


def draw_below_cdf(a: int, n: int) -> Fraction:
  """P(u < a) for u = floor(U n / 2^64), U uniform on [0, 2^64), 0 <= a <= n."""
  return Fraction(-(-a * _TWO64 // n), _TWO64)


def categorical_int_distribution(weights: Sequence[int]) -> list[Fraction]:
  """Exact distribution of `verification.categorical` over nonnegative ints."""
  total = sum(weights)
  out, acc, prev = [], 0, Fraction(0)
  for w in weights:
    acc += w
    cdf = draw_below_cdf(acc, total)
    out.append(cdf - prev)
    prev = cdf
  return out


def acceptance_probability(p_x: int, total: int, c_x: int) -> Fraction:
  """Exact P(accept x) of the rule u < P_x M, u = draw_below(bits, T c_x)."""
  if c_x <= 0:
    return Fraction(0)
  n = total * c_x
  a = p_x * M
  return Fraction(1) if a >= n else draw_below_cdf(a, n)


def residual_weights(p_fixed: Sequence[int], counts: Sequence[int]
                     ) -> list[int]:
  """W_v = max(P_v M - c_v T, 0); the target row itself if that is all zero."""
  total = sum(p_fixed)
  w = [max(p * M - c * total, 0) for p, c in zip(p_fixed, counts)]
  return w if sum(w) > 0 else [p * M for p in p_fixed]


def output_given_draft(p_fixed: Sequence[int], counts: Sequence[int], x: int,
                       residual: Sequence[int] | None = None
                       ) -> list[Fraction]:
  """Exact output distribution of one verification step given draft x."""
  total = sum(p_fixed)
  a = acceptance_probability(p_fixed[x], total, counts[x])
  rho = categorical_int_distribution(
      residual if residual is not None else residual_weights(p_fixed, counts))
  out = [(1 - a) * r for r in rho]
  out[x] += a
  return out


def verify_step_distribution(p_fixed: Sequence[int], counts: Sequence[int]
                             ) -> list[Fraction]:
  """Exact output distribution of one position of `verify_chain`.

  x ~ counts / M (exact: the 24-bit proposal draw), then the ACCEPT test,
  then on rejection a CORRECTION draw from the residual.
  """
  total = sum(p_fixed)
  rho = categorical_int_distribution(residual_weights(p_fixed, counts))
  out = [Fraction(0)] * len(p_fixed)
  reject = Fraction(0)
  for x, c in enumerate(counts):
    if c:
      a = acceptance_probability(p_fixed[x], total, c)
      out[x] += Fraction(c, M) * a
      reject += Fraction(c, M) * (1 - a)
  return [o + reject * r for o, r in zip(out, rho)]


def ideal_step_distribution(p: Sequence[Any], q: Sequence[Any]
                            ) -> list[Fraction]:
  """Standard speculative step with exact rationals (should return p)."""
  p = [Fraction(x) for x in p]
  q = [Fraction(x) for x in q]
  residual = [max(a - b, 0) for a, b in zip(p, q)]
  mass = sum(residual)
  out = [b * min(Fraction(1), a / b) if b else Fraction(0)
         for a, b in zip(p, q)]
  reject = 1 - sum(out)
  return [o + (reject * r / mass if mass else 0) for o, r in zip(out, residual)]


def verify_chain_replay(p_rows: Sequence[Sequence[int]],
                        count_rows: Sequence[Sequence[int]],
                        draft: Sequence[int], accept_bits: Sequence[int],
                        correction_bits: Sequence[int], bonus_bits: int
                        ) -> tuple[int, int]:
  """Integer replay of `verify_chain` given its 64-bit draws.

  p_rows: D+1 rows of P (from `quantize_target`); count_rows: D rows of c;
  accept_bits / correction_bits: D uint64 draws each (ACCEPT / CORRECTION at
  positions 0..D-1); bonus_bits: the BONUS draw at position D.
  Returns (num_accepted, next_token).
  """
  depth = len(draft)
  accepted = 0
  for i in range(depth):
    total = sum(p_rows[i])
    x = int(draft[i])
    c_x = int(count_rows[i][x]) if 0 <= x < len(p_rows[i]) else 0
    if c_x <= 0 or (int(accept_bits[i]) * total * c_x) >> 64 >= p_rows[i][x] * M:
      break
    accepted += 1
  if accepted < depth:
    weights = residual_weights(p_rows[accepted], count_rows[accepted])
    bits = int(correction_bits[accepted])
  else:
    weights = [p * M for p in p_rows[depth]]
    bits = int(bonus_bits)
  return accepted, sample_counts(weights, (bits * sum(weights)) >> 64)


def target_distribution(p_fixed: Sequence[int]) -> list[Fraction]:
  """P / T: the target-only sampler's distribution under ideal draws."""
  total = sum(p_fixed)
  return [Fraction(p, total) for p in p_fixed]


def total_variation(a: Sequence[Any], b: Sequence[Any]) -> Fraction:
  return sum((abs(Fraction(x) - Fraction(y)) for x, y in zip(a, b)),
             Fraction(0)) / 2


# ----------------------------------------------------------------------------
# Admission: the selection-bias toy (docs/numerics.md section 7).


def selection_bias_toy() -> dict[str, list[Fraction]]:
  """q = p uniform on {0, 1}, exact output distributions of two admissions.

  'fixed_depth': x_1 is always verified (depth 1 fixed before the draw).
  'inspecting': x_1 is admitted only if it is 0; otherwise the proposal is
  dropped and the target-only sampler emits the token.
  Returns {'fixed_depth': [P(0), P(1)], 'inspecting': [P(0), P(1)]}.
  """
  half = 1 << (TARGET_BITS - 1)
  p_fixed, counts = [half, half], [M // 2, M // 2]
  fixed = verify_step_distribution(p_fixed, counts)
  target_only = categorical_int_distribution(p_fixed)
  given0 = output_given_draft(p_fixed, counts, 0)
  inspecting = [Fraction(1, 2) * g + Fraction(1, 2) * t
                for g, t in zip(given0, target_only)]
  return {"fixed_depth": fixed, "inspecting": inspecting}


def admission_cells(p_rows: Sequence[Sequence[int]],
                    count_rows: Sequence[Sequence[int]],
                    decide: Any, depth: int, start: int
                    ) -> dict[tuple[int, bool, int], list[Fraction]]:
  """Exact joint law of (admission event, committed token) per position.

  A bigram toy: the target's row after token v is P = p_rows[v] (integers,
  `quantize_target`), the draft's q = count_rows[v] / M. One round starts
  after the committed token `start`; position i's draft x_i ~ q(. | prev),
  then `decide(i, prefix, x_i)` (prefix = (start, x_1..x_{i-1})) admits it
  or stops. Admitted: the ideal speculative step (accept with min(1, p/q),
  else a correction from max(p - q, 0)), and on acceptance position i + 1
  follows. Stopped (or i = depth): the next token is drawn from p (the
  bonus row). An honest rule ignores x_i; a mutant may read it.

  Returns {(i, admitted, prev): [P(position i reached, that event, that
  previous token, committed token v) for v]}, exact Fractions (ideal
  draws: the implementation's 2^-64 draw error, section 6.4, is left out).
  """
  p = [target_distribution(row) for row in p_rows]
  q = [[Fraction(c, M) for c in row] for row in count_rows]
  vocab = len(p_rows)
  cells: dict[tuple[int, bool, int], list[Fraction]] = {}

  def add(cell, weight, dist):
    row = cells.setdefault(cell, [Fraction(0)] * vocab)
    for v in range(vocab):
      row[v] += weight * dist[v]

  def walk(prefix, weight):
    i, prev = len(prefix) - 1, prefix[-1]
    if i == depth:
      add((i, False, prev), weight, p[prev])
      return
    residual = [max(a - b, Fraction(0)) for a, b in zip(p[prev], q[prev])]
    mass = sum(residual)
    for x in range(vocab):
      if not q[prev][x]:
        continue
      w = weight * q[prev][x]
      if not decide(i, tuple(prefix), x):
        add((i, False, prev), w, p[prev])
        continue
      a = min(Fraction(1), p[prev][x] / q[prev][x])
      add((i, True, prev), w * a, [Fraction(v == x) for v in range(vocab)])
      if a < 1:
        add((i, True, prev), w * (1 - a), [r / mass for r in residual])
      walk(prefix + [x], w * a)

  walk([start], Fraction(1))
  return cells
