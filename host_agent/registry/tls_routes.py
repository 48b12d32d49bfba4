"""``GET /v1/registry-ca.crt``: the registry CA's certificate, for guests to pin.

Public on purpose (no token): a guest with ``registry_ca_sha256`` fetches it once over TLS
without checking the server yet, believes it only if its sha256 is the pinned value, and
from then on verifies every connection against it (guest_agent/registry_trust.py). The
same fingerprint is every ImexEnsemble's ``status.registryCASHA256``. 404 when this
registry serves no HTTPS, or serves a certificate whose CA it does not know
(``--tls-cert-file`` without ``--tls-ca-file`` or a ``ca.crt`` beside it).
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi import FastAPI
from fastapi.responses import Response

from host_agent.registry.auth import RegistryError
from host_agent.registry.models import json_errors

CA_PATH = "/v1/registry-ca.crt"


def add_tls_routes(app: FastAPI, registry_ca: Callable[[], str | None] | None) -> None:
    @app.get(CA_PATH, summary="The registry CA's certificate (PEM), for guests to pin",
             responses={200: {"content": {"application/x-pem-file": {
                 "schema": {"type": "string"}}}}, **json_errors(404)})
    async def registry_ca_pem() -> Response:
        pem = registry_ca() if registry_ca is not None else None
        if pem is None:
            raise RegistryError(404, "this registry serves no HTTPS with a CA it knows (start "
                                "the host agent with --tls-self-issued, or --tls-cert-file "
                                "with --tls-ca-file)")
        return Response(pem, media_type="application/x-pem-file")
