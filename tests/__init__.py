"""The test suite; its layout mirrors the tree (core, wire, bridge, sharding,
experiments, system; repository-wide checks at the top)."""
