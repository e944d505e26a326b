"""Benchmarks behind ``warmlink bench``: each seed's table, pool on vs off vs the usual alternative."""
