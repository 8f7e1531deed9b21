"""Tests of sharding."""
