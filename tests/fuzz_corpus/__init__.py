"""Seed corpora for the fuzz harnesses (tests/fuzz_*.py)."""
