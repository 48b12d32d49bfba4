"""The operator-side cloud-init generator (``imex-guest-agent cloudinit``): user-data that
installs and configures the agent on a fresh VM, from the flags (``options.py``) through
the files and the setup script to the document (``userdata.py``); ``bootstrap.py`` is
embedded verbatim and runs on the guest's own python3 (standard library only, 3.8+). The
top of the house: it may import anything below it (``config``, ``tls.imex_config``), and
only ``cli.py`` imports it, lazily, for that one command; the daemon never does.
"""
