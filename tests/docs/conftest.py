"""make docs-test runs on the realk8s tier's control plane: the same session fixture
(tests/realk8s/conftest.py), binaries from tests/realk8s/build.sh's cache."""

from tests.realk8s.conftest import control_plane

__all__ = ["control_plane"]
