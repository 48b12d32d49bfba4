"""The guest agent: keeps an IMEX ensemble's ``nodes_config`` and ``/etc/hosts`` true inside a
VM. Data flows one way, discovery -> pins -> files -> IMEX -> report, and each stage is a
folder that imports only what lies below it (pyproject.toml's import-linter contract,
top to bottom): ``installer``; ``cli``; ``commands``; ``agent``; ``report | tls | imex``;
``pins | files``; ``peers | net``; ``registry_trust``; ``config | daemon | eventloop |
http`` (``|``: siblings
that never import each other). Every stage may use ``imex_shared``, the model both agents
share. docs/guest-agent.md walks through the house.
"""
