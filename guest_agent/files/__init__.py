"""The managed files on disk: the nodes file and the hosts block rendered and written
(``apply.py``) with the safe writer (``safewrite.py``), and re-asserted when another
writer changes them (``filewatch.py``). May import ``peers`` and ``net``, the base
modules and ``imex_shared``; never ``pins``, its sibling: it is handed pins, not Views.
"""
