"""The IMEX daemon: what to do about it (``supervisor.py``: signal, start or restart, a pure
decision), the one task that does it (``supervisor_io.py``) and the three ways to reach
the daemon, systemd, a child process or none (``control.py``). May import the stages
below (``pins``, ``files``, ``peers``, ``net``), the base modules and ``imex_shared``;
never ``report`` or ``tls``, its siblings.
"""
