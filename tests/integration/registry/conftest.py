"""Fixtures of the registry tests (the harness lives in registry_harness.py)."""

from tests.integration.registry.registry_harness import registry

__all__ = ["registry"]
