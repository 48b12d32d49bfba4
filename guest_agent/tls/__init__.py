"""IMEX's credentials with authEncryption: when to ask for a certificate (``keeper.py``) and
the task that asks (``keeper_io.py``, crypto-free), the trust rules (``creds.py``) and the
short-lived child that makes the key, requests the certificate and writes the files
(``creds_io.py``, run as ``python -m guest_agent.tls``), and IMEX's TLS config keys
(``imex_config.py``). May import the stages below (``files`` for the safe writer), the
base modules and ``imex_shared``; never ``report`` or ``imex``, its siblings.
"""
