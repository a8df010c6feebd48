"""Benchmarks: unitvisor against systemd's own limit (`make bench`; see docs/benchmarks.md)."""
