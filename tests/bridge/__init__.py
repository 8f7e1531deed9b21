"""Tests of bridge."""
