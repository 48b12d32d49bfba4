"""Discovery: who the ensemble's members are, from the registry's long-poll and from cluster
DNS, handed on as validated Views (``discovery.py``); pure decisions (``discovery.py``,
``registry.py``, ``dns.py``) beside the I/O that drives them (``*_io.py``). May import
only the base modules (``config``, ``http``, ``eventloop``) and ``imex_shared``: it knows
nothing of pins, files, IMEX or reports, and ``net`` is a sibling it never imports.
"""
