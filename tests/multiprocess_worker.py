"""One rank of the two-process test (tests/system/test_multiprocess.py).

    python -m tests.multiprocess_worker PROCESS_ID PORT OUT_JSON

Joins a 2-process jax.distributed job on 127.0.0.1 (gloo collectives on
CPU, one device per process), forms a 2-device vocabulary mesh across the
processes, runs the sharded ops on inputs every rank builds from the same
seed, and writes the replicated results (tokens, sparse allocations,
statuses) and whether its own dense-count block matches the single-device
op.
"""

import json
import sys


def main(process_id, port, out_path):
  import jax  # pylint: disable=g-import-not-at-top
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.config.update("jax_num_cpu_devices", 1)
  jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2,
                             process_id=process_id,
                             initialization_timeout=60)
  import numpy as np  # pylint: disable=g-import-not-at-top
  import dyadic_jax as dj  # pylint: disable=g-import-not-at-top
  import sharding  # pylint: disable=g-import-not-at-top
  from tests import multiprocess_case  # pylint: disable=g-import-not-at-top

  mesh = jax.sharding.Mesh(np.asarray(jax.devices()), (sharding.VOCAB_AXIS,),
                           axis_types=(jax.sharding.AxisType.Auto,))
  case = multiprocess_case.build()
  out = multiprocess_case.run(case, mesh=mesh)
  # The dense counts stay sharded: compare this rank's block locally.
  counts, _ = sharding.allocate_dense(case["weights"], mesh=mesh)
  local, _ = dj.allocate_dense(case["weights"])
  block_ok = True
  for shard in counts.addressable_shards:
    cols = shard.index[-1]
    want = np.asarray(local)[..., cols.start:min(cols.stop, local.shape[-1])]
    got = np.asarray(shard.data)[..., :want.shape[-1]]
    block_ok &= bool(np.array_equal(got, want))
  out["dense_block_equal"] = block_ok
  out["devices"] = jax.device_count()
  with open(out_path, "w") as f:
    json.dump(out, f)
  jax.distributed.shutdown()


if __name__ == "__main__":
  main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
