"""What two rounds in flight hide: one leg with one round in flight, one
with two, of the same work (bench_pair's bridge legs, bench_bridge's
overlap rounds).

A leg is {"units": request-rounds or tokens, "wall_s": its time,
"waited_s": the verifier's waits for answers (`Verifier.waited_s`)}.
"""


def overlap(one: dict, two: dict) -> dict:
  """The overlap two in flight achieved, per unit of each leg.

  With one in flight the verifier waits out the worker's whole turn (its
  work and the link) every round: that wait per unit is the worker's
  busy time. With two it waits only for what is not hidden behind its
  own work. hidden: the share of the worker's turn hidden; busy: per
  unit, the verifier's own work (wall less its wait) and the worker's
  turn; wall_over_busier: the two-in-flight wall over the busier side's
  busy time (1: perfect overlap).
  """
  def per(leg, seconds):
    return seconds / max(leg["units"], 1)

  worker = per(one, one["waited_s"])
  verifier = per(two, two["wall_s"] - two["waited_s"])
  wall = per(two, two["wall_s"])
  return {"worker_ms": 1e3 * worker, "verifier_ms": 1e3 * verifier,
          "wall_ms": 1e3 * wall,
          "exposed_ms": 1e3 * per(two, two["waited_s"]),
          "hidden": 1.0 - per(two, two["waited_s"]) / max(worker, 1e-12),
          "wall_over_busier": wall / max(worker, verifier, 1e-12)}


def line(o: dict, unit: str) -> str:
  """`overlap`'s figures in one line, per `unit`."""
  return (f"overlap: per {unit} the worker's turn {o['worker_ms']:.2f} ms, "
          f"the verifier's own work {o['verifier_ms']:.2f} ms, the wall "
          f"{o['wall_ms']:.2f} ms ({o['wall_over_busier']:.2f}x the busier "
          f"side); {100 * o['hidden']:.0f}% of the worker's turn hidden")
