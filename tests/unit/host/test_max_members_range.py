"""One max-members range, 1..1000, for the guest config and the Service annotation."""

from __future__ import annotations

import pytest

from guest_agent.config import ConfigError, settings_from_mapping
from host_agent.ensembles.service_spec import parse_ensemble_service
from imex_shared.model import MAX_MEMBERS_LIMIT
from tests.host_support.kubevirt import service


def test_the_limit_is_what_one_endpointslice_holds() -> None:
    assert MAX_MEMBERS_LIMIT == 1000


@pytest.mark.parametrize(("value", "ok"), [(1, True), (1000, True), (0, False), (1001, False),
                                           (1024, False)])
def test_guest_config_and_service_agree(value: int, ok: bool) -> None:
    raw = {"ensemble": "gb200", "namespace": "rack1", "max_members": value}
    if ok:
        assert settings_from_mapping(raw).max_members == value
    else:
        with pytest.raises(ConfigError, match="max_members"):
            settings_from_mapping(raw)
    spec, _ = parse_ensemble_service(
        service(annotations={"imex-ensemble.io/max-members": str(value)}))
    assert (spec is not None) is ok
