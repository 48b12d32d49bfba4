"""Benchmarks (issue 7): ``python -m tests.bench [NAME ...] [--quick]``; see docs/benchmarks.md."""
