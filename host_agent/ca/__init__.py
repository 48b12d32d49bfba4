"""The per-ensemble CAs of authEncryption: the CA, its rotation and the leaves it signs
(``authority.py``), the CA as a Secret (``secret.py``), and the Secret read and written
(``secret_io.py``).

``cryptography`` is imported only where a CA is used (about 13 MB of RSS an agent
without authEncryption never pays). May import state/, kube/ and imex_shared.
"""
