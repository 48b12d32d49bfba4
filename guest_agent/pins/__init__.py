"""Which address every slot is pinned to: the Views merged into what the guest knows, the own
slot (``ownslot.py``), and the plan of what the files pin and what IMEX is told
(``merge.py``). Pure. May import ``peers`` (the View it folds), the base modules and
``imex_shared``; never ``files``, its sibling, which writes what this decides.
"""
