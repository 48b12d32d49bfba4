"""Issue 18: the manual recipe beside ours, through real CoreDNS and the real EndpointSlice
controller (``python -m tests.bench.peers``; docs/benchmarks.md, "Beside the manual recipe")."""
