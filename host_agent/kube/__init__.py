"""Kubernetes I/O: the API client (the one place requests are made), the informers and
their cache, Leases and leader election, the write gate every writer checks, and the
start-up checks readiness waits for (``preflight.py`` decides what to ask,
``preflight_io.py`` asks).

Pure parts are named apart from their drivers (``election.py`` decides, ``election_io.py``
talks to the Lease; ``objects.py`` and ``cache.py`` do no I/O). May import crd/ (the
CRD's names) and the base modules (settings, metrics, backoff); nothing above.
"""
