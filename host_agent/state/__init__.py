"""The ensembles as this replica serves them: immutable snapshots (``snapshot.py``) and
the ``State`` that holds the latest of each and parks long-polls (``store.py``).

Everything downstream (slices, registry, status, Events) reads the same snapshot. May
import kube/ (label selectors) and imex_shared; nothing above.
"""
