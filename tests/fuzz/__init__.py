"""Property-based fuzzing of every input surface (issue 30): Hypothesis over the parsers
the agents feed with what they read (/etc/hosts, DNS answers, TOML, CSRs, IMEX's and
nvidia-smi's output, Kubernetes JSON), schemathesis over the registry's HTTP API.

Each property holds the three rules: never crash, never write a partial file, reject
with a message naming the part. ``budget.EXAMPLES`` sets the examples per property:
50 in ``make test`` (CI), 500 in ``make fuzz`` (IMEX_FUZZ_EXAMPLES).
"""
