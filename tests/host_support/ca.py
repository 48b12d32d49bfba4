"""CA helpers the tests share (the agent itself takes one step per pass)."""

from __future__ import annotations

import datetime as dt

from host_agent.ca.authority import CaState, advance


def end_overlap(state: CaState, now: dt.datetime) -> CaState:
    """Every rotation step due at ``now`` taken (the rotation over when its overlap is)."""
    while (nxt := advance(state, now)) is not state:
        state = nxt
    return state
