"""The main job, `python -m experiments.pp1_pipeline`, as a package.

`flags` (every flag and its cross-flag checks; absl only), `stopwatch`
(the wall clock and its phases), `supervisor` (the worker's and the
follower ranks' processes), `verifier` (JAX on a rank, the mesh, the
compiled bridge `Verifier`), `rounds` (generation, the distribution
check), `drills` (the killed worker, the fault proxy), `report` (the
JSON record, the summary table, the plot) and `main` (the leader and a
follower rank). Importing this package imports nothing.
"""
