"""What an ensemble is, from the objects that declare it: a Service or an ImexEnsemble
parsed into one spec (``service_spec.py``, ``cr_spec.py``), VMIs turned into members
(``members.py``), the EndpointSlices to publish (``slices.py``) and a CR's own Service
(``owned_service.py``), each with its applier (``*_io.py``).

May import state/, kube/, crd/ and the base modules; never persist/, ca/ or above.
"""
