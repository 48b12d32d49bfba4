"""What the leader persists so that every replica serves the same thing: the
(generation, GuestView) pair (``pair.py``, ``pair_io.py``), and the guests' reports in
ConfigMaps (``reports.py``, ``reports_io.py``).

May import state/, kube/ and the base modules; never ensembles/, ca/ or above.
"""
