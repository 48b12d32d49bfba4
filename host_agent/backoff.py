"""Full-jitter exponential backoff, the one retry delay of the host agent.

The informers, the reconciler and the status writer all back off with it (tenacity's
random exponential wait), so a fleet of replicas never retries in step.
"""

from __future__ import annotations

from tenacity import RetryCallState, wait_random_exponential


def backoff_delay(attempt: int, initial: float, maximum: float) -> float:
    """Full-jitter exponential delay for the ``attempt``-th consecutive failure."""
    state = RetryCallState(retry_object=None, fn=None, args=(), kwargs={})  # type: ignore[arg-type]
    state.attempt_number = max(1, attempt)
    return float(wait_random_exponential(multiplier=initial, max=maximum)(state))
