"""The ImexEnsemble CRD: its one definition (``imexensemble.py``) in a small schema
vocabulary (``schema.py``), from which tools/crd_generate.py writes the manifest, the
field reference and imex_shared/ensemble_crd.py.

Pure data; imports only imex_shared.
"""
