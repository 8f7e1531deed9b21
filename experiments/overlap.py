"""Exact acceptance of real rows: sum_v min(p, q) for each q format.

No flags (train_pair and acceptance both import it). Given the target's
row p and the draft's weights w at one position, the standard rule accepts
a token drawn from q with probability

    alpha(p, q) = sum_v q_v min(1, p_v / q_v) = sum_v min(p_v, q_v)
                = 1 - TV(p, q),

so no sampling is needed: averaged over positions, alpha is the expected
per-position acceptance. q is what the wire carries: `dense` (the
`allocate_dense` counts / 2^24, within V 2^-25 of w in total variation)
or `kN` (`allocate_sparse` on w's top N, renormalized: it gives up about
w's mass outside its top N), or `ideal` (w itself, unrounded).

`held_out` scores a pair on held-out windows of text (teacher forcing:
every position's context is the text itself), at a sampling temperature
T: p = `target_probs`(target logits / T) (the verifier's float64
softmax), w = `draft_weights`(draft logits, temperature=T). It also
reports the mass outside the top k of w (what a sparse q truncates) and
of p (the ceiling of a sparse q: a q supported on k ids accepts at most
the p-mass of those ids, so at most p's top-k mass), and the forward KL
KL(p || w) that distillation minimizes.
"""

import math
import typing

import jax
import jax.numpy as jnp
import numpy as np

import dyadic_jax as dj
from dyadic_jax.models import transformer


def variants(ks: typing.Iterable[int], vocab: int) -> list[str]:
  """The q formats scored: dense, then kN for each k in [1, vocab)."""
  return ["dense"] + [f"k{k}" for k in ks if 1 <= k < vocab]


def dense_rows(ids: jax.typing.ArrayLike, counts: jax.typing.ArrayLike,
               vocab: int) -> np.ndarray:
  """float64[B, V] q = c / M of sparse rows (padding ids are -1)."""
  ids, counts = np.asarray(ids), np.asarray(counts)
  q = np.zeros((ids.shape[0], vocab))
  rows = np.broadcast_to(np.arange(ids.shape[0])[:, None], ids.shape)
  live = ids >= 0
  q[rows[live], ids[live]] = counts[live] / dj.M
  return q


def allocate(w: jax.Array, variant: str
             ) -> tuple[np.ndarray, jax.Array, jax.Array | None]:
  """(q float64[B, V], counts, ids) of weight rows for a dyadic variant."""
  if variant == "dense":
    counts, status = dj.allocate_dense(w)
    dj.raise_for_status("allocate_dense", status)
    return np.asarray(counts) / dj.M, counts, None
  ids, counts, _, status = dj.allocate_sparse(w, int(variant[1:]))
  dj.raise_for_status("allocate_sparse", status)
  return dense_rows(ids, counts, w.shape[-1]), counts, ids


def row_figures(p: np.ndarray, w: np.ndarray,
                q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Per row: alpha(p, q) = sum_x min(p, q) and TV(w, q) (float64)."""
  return np.minimum(p, q).sum(-1), 0.5 * np.abs(w - q).sum(-1)


def outside_top_k(rows: np.ndarray, k: int) -> np.ndarray:
  """float64[B]: each row's mass outside its k largest entries."""
  if k >= rows.shape[-1]:
    return np.zeros(rows.shape[:-1])
  top = np.partition(rows, rows.shape[-1] - k, axis=-1)[..., -k:]
  return np.maximum(rows.sum(-1) - top.sum(-1), 0.0)


def row_acceptance(target_logits: jax.typing.ArrayLike,
                   draft_logits: jax.typing.ArrayLike, ks: list[int],
                   temperature: float = 1.0) -> dict[str, np.ndarray]:
  """Per row, float64[B] each: alpha under `ideal` and every variant,
  `kl` = KL(p || w), and `outside_w_kN`, `outside_p_kN` (mass outside
  the top N of w and of p)."""
  p, status = dj.target_probs(jnp.asarray(target_logits, jnp.float32)
                              / jnp.float32(temperature))
  dj.raise_for_status("target_probs", status)
  w, status = dj.draft_weights(draft_logits, temperature=temperature)
  dj.raise_for_status("draft_weights", status)
  p_np, w_np = np.asarray(p, np.float64), np.asarray(w, np.float64)
  vocab = p_np.shape[-1]
  out = {"ideal": np.minimum(p_np, w_np).sum(-1)}
  for v in variants(ks, vocab):
    out[v] = row_figures(p_np, w_np, allocate(w, v)[0])[0]
  with np.errstate(divide="ignore", invalid="ignore"):
    terms = np.where(p_np > 0, p_np * (np.log(p_np) - np.log(w_np)), 0.0)
  out["kl"] = terms.sum(-1)
  for k in ks:
    if k < vocab:
      out[f"outside_w_k{k}"] = outside_top_k(w_np, k)
      out[f"outside_p_k{k}"] = outside_top_k(p_np, k)
  return out


def summary(rows: dict[str, np.ndarray], ks: list[int]
            ) -> dict[str, typing.Any]:
  """Means (and standard errors of alpha) of `row_acceptance`'s rows, with
  each sparse format's share of dense acceptance."""
  n = len(rows["dense"])
  record: dict[str, typing.Any] = {"positions": n}
  for name, values in rows.items():
    record[name] = float(values.mean())
    if not name.startswith(("outside", "kl")):
      record[f"{name}_se"] = (float(values.std(ddof=1) / math.sqrt(n))
                              if n > 1 else 0.0)
  for k in ks:
    if f"k{k}" in rows:
      record[f"k{k}_share_of_dense"] = record[f"k{k}"] / record["dense"]
  return record


def held_out(target: transformer.Params, draft: transformer.Params,
             windows: np.ndarray, *, ks: list[int], temperature: float = 1.0,
             batch: int = 8, chunk: int = 1024) -> dict[str, typing.Any]:
  """`summary` over every position of `windows` int32[N, L] (each
  position's rows are scored given the window's tokens up to it)."""
  forward = jax.jit(transformer.forward)
  parts: dict[str, list[np.ndarray]] = {}
  for i in range(0, len(windows), batch):
    tokens = jnp.asarray(windows[i:i + batch])
    tl = forward(target, tokens).reshape(-1, target.embed.shape[0])
    dl = forward(draft, tokens).reshape(-1, draft.embed.shape[0])
    for s in range(0, tl.shape[0], chunk):
      for name, values in row_acceptance(tl[s:s + chunk], dl[s:s + chunk],
                                         ks, temperature).items():
        parts.setdefault(name, []).append(values)
  return summary({n: np.concatenate(v) for n, v in parts.items()}, ks)


def table(records: dict[str, dict[str, typing.Any]], ks: list[int]
          ) -> list[str]:
  """Printed lines: one column per record (e.g. before, after)."""
  names = list(records)
  first = records[names[0]]
  lines = [f"  {'held out, ' + str(first['positions']) + ' positions':<34}"
           + "".join(f"{n:>10}" for n in names)]

  def row(label: str, key: str, fmt: str = "{:10.4f}") -> None:
    if all(key in r for r in records.values()):
      lines.append(f"  {label:<34}" + "".join(
          fmt.format(r[key]) for r in records.values()))

  row("KL(p || w), nats", "kl")
  row("sum min(p, q), ideal q = w", "ideal")
  row("sum min(p, q), dense q", "dense")
  for k in ks:
    row(f"sum min(p, q), sparse k={k}", f"k{k}")
    row(f"  k={k} share of dense", f"k{k}_share_of_dense")
  for k in ks:
    row(f"draft mass outside top {k}", f"outside_w_k{k}")
    row(f"target mass outside top {k}", f"outside_p_k{k}")
  return lines
