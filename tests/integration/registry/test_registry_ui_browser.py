"""The page in a real browser (Debian's chromium under Selenium) against a real registry.

The registry runs in this test's event loop on loopback; 18 members report over HTTP as
guests do. One member's report then loses its link to another: without a reload the
cell turns to a non-connected letter and colour and the status text follows, and back.
Screenshots of each state are kept (``test-artifacts/domain/registry-*.png``). The
18-VM sandbox version of the same scenario is in tests/e2e/test_ensemble.py.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest

from tests.e2e.domain_support import browser, browser_missing, screenshot
from tests.integration.registry.registry_harness import serve
from tests.integration.registry.test_registry_domain import TRUSTED, put, state_of, view_of
from tests.timing import measured

pytestmark = pytest.mark.skipif(browser_missing() is not None,
                                reason=browser_missing() or "")


async def poll_page(driver: Any, probe: Any, timeout: float) -> float:
    """Wait for the live page (the browser runs its own script) to satisfy ``probe``."""
    t0 = time.monotonic()
    while not await asyncio.to_thread(probe, driver):
        assert time.monotonic() - t0 < timeout, "the page did not follow in time"
        await asyncio.sleep(0.1)
    return time.monotonic() - t0


def cell(driver: Any, a: int, b: int) -> tuple[str, str]:
    el = driver.find_element("css selector", f'#matrix td[data-from="{a}"][data-to="{b}"]')
    return el.text, el.get_attribute("class")


async def test_a_lost_link_shows_up_and_goes_away_without_a_reload() -> None:
    async with serve(state_of(18), TRUSTED) as reg, httpx.AsyncClient(base_url=reg.url) as c:
        for i in range(18):
            await put(c, i, view_of(i, 18, set()))
        with browser() as driver:
            await asyncio.to_thread(driver.get, f"{reg.url}/ui/ensembles/gpu/nvl")
            rows = await asyncio.to_thread(driver.find_elements, "css selector",
                                           "#members tbody tr")
            assert len(rows) == 18
            await asyncio.to_thread(driver.execute_script, "window.__same = 1;")
            assert cell(driver, 3, 7) == ("C", "cell s-C")
            assert driver.find_element("id", "status").text == "UP"
            screenshot(driver, "registry-1-up")

            await put(c, 3, view_of(3, 18, {(3, 7)}))  # 3 lost its link to 7
            took = await poll_page(driver, lambda d: cell(d, 3, 7)[0] == "D"
                                   and d.find_element("id", "status").text == "DEGRADED", 3)
            # the page refreshes every 0.4 s: measured max 0.62 s, 0.97 s beside stress-ng
            # (8 runs each, 2026-12-02; the 1.5 s this had was 1.5x that): bound 2 s
            assert measured("registry.ui.refresh", took) < 2.0
            assert cell(driver, 3, 7) == ("D", "cell s-D")
            assert cell(driver, 7, 3) == ("C", "cell s-C")
            problems = driver.find_element("id", "problems").text
            assert "1 links not CONNECTED: 3->7" in problems
            screenshot(driver, "registry-2-degraded")

            await put(c, 3, view_of(3, 18, set()))
            await poll_page(driver, lambda d: cell(d, 3, 7)[0] == "C"
                            and d.find_element("id", "status").text == "UP", 3)
            assert driver.execute_script("return window.__same") == 1  # never reloaded
            screenshot(driver, "registry-3-up-again")
