"""Shared test helpers for the host agent's unit and integration tests."""
