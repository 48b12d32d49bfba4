"""``python -m guest_agent.tls inspect|request ...``: the keeper's short-lived child.

The command the keeper runs (keeper_io.py) names this package, not a module inside it,
so the command line stays the same however the package is laid out."""

from guest_agent.tls.creds_io import main

raise SystemExit(main())
