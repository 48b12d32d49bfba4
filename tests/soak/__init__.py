"""The soak (issue 30): a seeded schedule of overlapping faults over the namespace sandbox,
with the invariants checked throughout. TEST CODE, never imported by product code.

``python -m tests.soak --duration SECONDS --seed N [--vms N]``; see ``__main__.py``.
"""
