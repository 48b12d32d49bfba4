"""The ensemble's shared contract, imported by both agents: names and the member model,
the rendered files (nodes_config, the hosts block), cliques, IMEX's domain view and
fabric as the guest parses them, the ImexEnsemble facts, and the --json log format.

Standard library only, so a guest needs nothing more to render its files; it imports
neither agent (import-linter and tests/unit/test_layout.py hold both rules).
"""
