"""The registry: the ensembles over HTTP for guests and operators. The app
(``app.py``) and its routes by what they serve (``*_routes.py``), request checks
(``auth.py``), bodies (``models.py``, ``domain_models.py``), the pure views
(``views.py``, ``domain_view.py``) and the operator's page (``page.py``).

May import state/, ca/ (certificates) and the base modules; never status/, reconcile/,
main or cli.
"""
