"""Benchmarks that ship with the package (the scripts in benchmarks/ call these)."""
