"""The guest's own network: its local and default-route addresses and their changes, over
netlink (``netwatch.py``, through ``rtnl_import.py``'s lean pyroute2 import), and IMEX's
port kept out of the kernel's ephemeral range (``portreserve.py``). May import only the
base modules and ``imex_shared``; ``peers`` is a sibling it never imports.
"""
