"""An ImexEnsemble's status and every ensemble's Events: the desired status and the
Events to record, pure (``status.py``, ``events.py``), and their writers
(``status_io.py``, the one writer of the status and the Events' one source;
``events_io.py``).

May import registry/ (the domain view), ensembles/, state/, kube/, crd/ and the base
modules; never reconcile/, main or cli.
"""
