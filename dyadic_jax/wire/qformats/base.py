"""What every q format provides, and the rows it lays out in a REPLY.

A q format is one representation of the D q rows of one request on the
wire (dense, sparse, greedy tokens). It owns, in one place:

* the REPLY payload layout after the REPLY body (`payload_bytes`, `rows`):

      tokens int32[D] | n int32[D] | [ids int32[D, w]] | [values float32[D, w]]

  w is the format's row width (V dense, k sparse, 0 greedy); n[i] is the
  number of live entries of row i (the rest of a sparse row is padding and
  is never read);
* validation (`validate`): the core's one kernel per format
  (`dyadic_jax.qrows`, on bit patterns), statuses mapped to `Code`s by
  `dyadic_jax.wire.status`, plus the sampling audit when draws are given;
* the staging buffers of a batch (`staging`);
* the conversion of validated counts to what verification takes
  (`to_q`: `DenseQ` or `SparseQ`);
* what a session negotiates about it (`name`, `mode`, `width`: the row
  width HELLO carries, `shardable`: whether rank links may split its rows
  by vocabulary block, `uses_support`: whether k means anything to it);
* the worker's row (`propose`: one drafted position's q row and token,
  from the core's `propose_dense` / `propose_sparse`);
* rows from a support and counts (`put`), a valid q of a session's shapes
  for compile warm-up (`example_q`), and the seed's size estimate
  (`seed_bytes`).

Nothing outside this package branches on which format a session uses: it
asks the session's format. A new representation is one module with a
`QFormat` subclass and one line in `dyadic_jax/wire/qformats/__init__.py`.
"""

from __future__ import annotations   # JAX's types, without importing JAX

import math
import types
import typing

import numpy as np
from numpy.typing import ArrayLike, DTypeLike

from dyadic_jax.constants import M
from dyadic_jax.wire import layouts
from dyadic_jax.wire.layouts import Mode
from dyadic_jax.wire.refusals import Code

if typing.TYPE_CHECKING:   # types only: this module runs without JAX
  import jax

  from dyadic_jax import rowops
  from dyadic_jax.verification import DenseQ, SparseQ

# Validated counts: numpy, or a JAX array from a device verdict.
Counts: typing.TypeAlias = "np.ndarray | jax.Array"
# One array kind throughout a call: numpy on the host, JAX under jit.
ArrayT = typing.TypeVar("ArrayT", np.ndarray, "jax.Array")
# What verification takes for one request's rows (None: greedy, no q).
Q: typing.TypeAlias = "DenseQ | SparseQ | None"
# One drafted position (`QFormat.propose`): token, status, values, ids, n.
Proposed: typing.TypeAlias = (
    "tuple[jax.Array, jax.Array, jax.Array | None, jax.Array | None, "
    "jax.Array]")


class Rows(typing.NamedTuple):
  """The rows of one request (or a batch: leading axes), as arrays.

  One record from the draw to verification: the worker's proposal (the
  proposer's host arrays), the views of a REPLY frame or a staging
  buffer (writable when that buffer is), a verifier plan's rows.
  """
  tokens: np.ndarray               # int32[..., D] drafted tokens
  n: np.ndarray                    # int32[..., D] live entries per row
  ids: np.ndarray | None = None    # int32[..., D, w] sparse global ids
  values: np.ndarray | None = None  # float32[..., D, w] q values

  def take(self, index: np.ndarray) -> "Rows":
    """The rows of batch entries `index` (an int array; a copy)."""
    return Rows(self.tokens[index], self.n[index],
                None if self.ids is None else self.ids[index],
                None if self.values is None else self.values[index])


class Verdict(typing.NamedTuple):
  """Validated rows: counts where a row is OK, a Code per row."""
  counts: Counts | None            # int32[..., D, w]; None without q
  codes: np.ndarray                # int32[..., D]: 0 OK, else a Code value


_INT32 = np.iinfo(np.int32)


def _int32_field(caller: str, name: str, a: typing.Any) -> typing.Any:
  """`a` as int32, its values unchanged: the wire's fields are int32, and
  a wider integer cast down would wrap (2^32 + 3 -> 3) into a valid id."""
  dtype = getattr(a, "dtype", None)
  if dtype == np.int32:
    return a                  # the wire's views and staging: no copy
  a = np.asarray(a)
  if a.dtype.kind not in "iu":
    raise TypeError(f"{caller}: rows.{name} must be int32, got {a.dtype}")
  if a.size and (int(a.min()) < _INT32.min or int(a.max()) > _INT32.max):
    bad = int(a.max()) if int(a.max()) > _INT32.max else int(a.min())
    raise ValueError(f"{caller}: rows.{name} holds {bad}, outside int32 "
                     f"[{_INT32.min}, {_INT32.max}]: no wire field carries it")
  return a.astype(np.int32)


def checked_rows(caller: str, rows: Rows) -> Rows:
  """`rows` with int32 tokens, n and ids (each range-checked before the
  cast: ValueError) and float32 values (validation reads their bits; any
  other dtype is a TypeError), as `QFormat.validate` requires."""
  values = rows.values
  if values is not None and getattr(values, "dtype", None) != np.float32:
    raise TypeError(f"{caller}: rows.values must be float32 (q is judged "
                    f"on its bits), got {getattr(values, 'dtype', None)}")
  return Rows(_int32_field(caller, "tokens", rows.tokens),
              _int32_field(caller, "n", rows.n),
              None if rows.ids is None else _int32_field(caller, "ids",
                                                         rows.ids),
              values)


def aligned_empty(shape: int | typing.Sequence[int], dtype: DTypeLike,
                  alignment: int = 64) -> np.ndarray:
  """An uninitialized numpy array whose data starts on `alignment` bytes.

  64-byte alignment lets JAX on CPU read it without a copy (dlpack).
  """
  dtype = np.dtype(dtype)
  shape = (tuple(typing.cast(typing.Sequence[int], shape))
           if np.iterable(shape) else (typing.cast(int, shape),))
  nbytes = math.prod(shape) * dtype.itemsize
  raw = np.empty(nbytes + alignment, np.uint8)
  # The address without ctypes (np.prod and .ctypes cost ~100 us a call;
  # the sessions fuzz target makes several arrays per input).
  start = (-raw.__array_interface__["data"][0]) % alignment
  return raw[start:start + nbytes].view(dtype).reshape(shape)


def audit(counts: ArrayT, position: ArrayT, draws: ArrayT,
          xp: types.ModuleType) -> ArrayT:
  """Sampling audit: is each drafted token the one its draw selects?

  counts: int[..., w] validated counts; position: int[...] index of the
  drafted token in the row (its id, or its place in a sparse support);
  draws: uint32[...] 24-bit PROPOSAL draws. The token a draw u selects is
  the first index whose inclusive cumulative count exceeds u
  (`dyadic_jax.sample_counts`), so the drafted one is right exactly when
  sum(counts[:position]) <= u < sum(counts[:position + 1]).

  int32 arithmetic, exact where it is used: the verdict only counts on a
  row that is otherwise valid (`with_audit`), whose counts are >= 0 and
  sum to M = 2^24, so every prefix and prefix + count is <= 2^25. On a
  refused row the sum may wrap, harmlessly. (int32 because XLA CPU runs
  the masked float64 or int64 sum of a 10 MB batch about 4x slower: the
  audit then cost more than the whole validation; bench_bridge `audit`.)
  """
  index = xp.arange(counts.shape[-1], dtype=xp.int32)
  before = xp.where(index < position[..., None], counts, 0)
  prefix = xp.sum(before, axis=-1, dtype=xp.int32)
  at = xp.take_along_axis(
      counts, xp.clip(position, 0, counts.shape[-1] - 1)[..., None],
      axis=-1)[..., 0].astype(xp.int32)
  u = draws.astype(xp.int32)       # 24-bit draws
  return (prefix <= u) & (u < prefix + at)


def support_position(ids: ArrayT, n: ArrayT, tokens: ArrayT,
                     xp: types.ModuleType) -> ArrayT:
  """Index of each row's token in its live support (0 if absent)."""
  live = xp.arange(ids.shape[-1]) < n[..., None]
  return xp.argmax(live & (ids == tokens[..., None]), axis=-1)


def with_audit(codes: ArrayLike, audit_ok: ArrayLike) -> np.ndarray:
  """Codes with SAMPLING_MISMATCH where an otherwise valid row failed."""
  codes = np.asarray(codes, np.int32)
  return np.where((codes == 0) & ~np.asarray(audit_ok, bool),
                  np.int32(Code.SAMPLING_MISMATCH), codes).astype(np.int32)


class QFormat:
  """One representation of q rows (see the module docstring)."""
  name: str                  # the pipeline's --q value
  representation: int        # layouts.Representation
  mode: int = Mode.SAMPLED   # layouts.Mode of a session that carries it
  entry_bytes: int           # bytes per entry on the wire
  has_ids = False
  has_values = True
  uses_support = False       # the width is the configured k
  shardable = False          # rows are vocabulary-aligned: rank links split
                             # them into contiguous blocks, one per rank

  @property
  def sampled(self) -> bool:
    """Rows carry q (a SAMPLED session) rather than tokens alone."""
    return self.mode == Mode.SAMPLED

  @property
  def mass(self) -> int:
    """The REPLY's declared mass: 2^24, or 0 without q."""
    return M if self.sampled else 0

  def width(self, vocab: int, support: int, shards: int = 1) -> int:
    """Entries per row for a session of vocabulary V, configured sparse
    support k and `shards` rank links (what HELLO carries as
    `max_support`). Raises ValueError for a k the format cannot use."""
    raise NotImplementedError

  def payload_bytes(self, depth: int, width: int) -> int:
    return 8 * depth + self.entry_bytes * depth * width

  def seed_bytes(self, depth: int, vocab: int, support: int) -> int:
    """The seed's size estimate of one request's q: entries x bytes, no
    tokens, n or framing (dense 4 V D, sparse 8 k D)."""
    return self.entry_bytes * depth * self.width(vocab, support)

  def rows(self, buf: layouts.Buffer, offset: int, depth: int,
           width: int) -> Rows:
    """Views of the payload of one REPLY at `offset` of `buf`."""
    tokens = np.frombuffer(buf, "<i4", depth, offset)
    n = np.frombuffer(buf, "<i4", depth, offset + 4 * depth)
    offset += 8 * depth
    ids = values = None
    if self.has_ids:
      ids = np.frombuffer(buf, "<i4", depth * width, offset).reshape(
          depth, width)
      offset += 4 * depth * width
    if self.has_values:
      values = np.frombuffer(buf, "<f4", depth * width, offset).reshape(
          depth, width)
    return Rows(tokens, n, ids, values)

  def staging(self, requests: int, depth: int, width: int) -> Rows:
    """Zeroed, aligned staging arrays of a batch: Rows of [R, D, ...]."""
    shape = (requests, depth, width)
    ids = aligned_empty(shape, np.int32) if self.has_ids else None
    values = aligned_empty(shape, np.float32) if self.has_values else None
    for a in (ids, values):
      if a is not None:
        a.fill(0)
    return Rows(np.zeros((requests, depth), np.int32),
                np.zeros((requests, depth), np.int32), ids, values)

  def validate(self, rows: Rows, *, vocab: int,
               draws: ArrayLike | None = None,
               device: bool = False) -> Verdict:
    """Verdict of rows [..., D, w]: counts and a Code per row.

    draws: uint32[..., D] 24-bit PROPOSAL draws: a valid row whose token is
    not the one its draw selects gets SAMPLING_MISMATCH (None: no audit).
    device: the verifier's staged batch: the format's fast path (dense:
    one jitted call, counts a JAX array; sparse: one compiled host loop
    when small or on CPU, else one jitted call) instead of the loose numpy
    kernel.

    Raises:
      TypeError: values not float32, or a non-integer tokens, n or ids.
      ValueError: an integer field with a value outside int32 (a wider
        array is range-checked, then cast; `checked_rows`).
    """
    raise NotImplementedError

  def to_q(self, counts: Counts | None, rows: Rows) -> Q:
    """What verification takes for one request's validated rows [D, ...]."""
    raise NotImplementedError

  def put(self, rows: Rows, ids: ArrayLike, counts: ArrayLike) -> None:
    """Writes q rows given by their support into `rows` (the views of a
    REPLY, `codec.begin_reply`, or of a staging buffer), n included.

    ids: int[..., s] ascending global ids; counts: int[..., s] their counts
    (summing to 2^24 per row; zeros allowed). Tokens are not touched.
    """
    raise NotImplementedError

  def propose(self, logits: jax.Array, draw: jax.Array | None, width: int,
              executor: rowops.Executor) -> Proposed:
    """One drafted position, jax-traceable: (token, status, values, ids, n).

    logits: float32[V] draft logits (this rank's block under a mesh
    `executor`); draw: the position's 24-bit PROPOSAL draw (None unless
    `sampled`); width: the session's row width. values: float32[w] q row
    (None without q), ids: int32[w] (None without ids), n: live entries.
    """
    raise NotImplementedError

  def example_q(self, depth: int, vocab: int, support: int) -> Q:
    """A valid q of a session's shapes, as verification takes it (host
    arrays), for compile warm-up: M split evenly over ids 0..w-1 of each
    row (the remainder on id 0), laid out, validated and converted as a
    received REPLY is. None without q."""
    if not self.sampled:
      return None
    w = self.width(vocab, support)
    counts = np.full((depth, w), M // w, np.int64)
    counts[:, 0] += M - counts[0].sum()
    batch = self.staging(1, depth, w)
    rows = Rows(batch.tokens[0], batch.n[0],
                None if batch.ids is None else batch.ids[0],
                None if batch.values is None else batch.values[0])
    self.put(rows, np.broadcast_to(np.arange(w, dtype=np.int32), counts.shape),
             counts)
    verdict = self.validate(rows, vocab=vocab)
    return self.to_q(verdict.counts, rows)
