"""Helpers of the e2e domain tests: a one-way link loss, the registry's domain view, a browser.

The link loss follows FACTS.md ("More facts"): dropping packets one way kills a TCP
connection both ways (the ACKs are lost too), so member A's *own* dials to B's IMEX port
are refused with a TCP reset by an nftables rule inside A's namespace, and A's existing
connection to B is killed with ``ss -K``. B's connection to A (B dials A's port) is
untouched, so A->B is lost and B->A stays CONNECTED.

The browser is Debian's chromium driven by Selenium through Debian's chromium-driver, both
at explicit paths: Selenium Manager is never asked to download anything.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tests.sandbox.ensemble import EnsembleSpec, Sandbox, Vm

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = Path(os.environ.get("IMEX_TEST_ARTIFACTS", REPO / "test-artifacts")) / "domain"
CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
TABLE = "imex_e2e_oneway"


def block_dials(a: Vm, b: Vm, port: int) -> None:
    """A's new connections to B's IMEX port: TCP reset; A's open one to it: killed."""
    rules = (f"table inet {TABLE} {{\n chain out {{\n  type filter hook output priority 0;\n"
             f"  ip daddr {b.ip} tcp dport {port} reject with tcp reset\n }}\n}}\n")
    a.node.run(["nft", "-f", "-"], input=rules)
    a.node.run(["ss", "-K", "-t", "dst", b.ip, "dport", "=", str(port)], check=False)


def unblock_dials(a: Vm) -> None:
    a.node.run(["nft", "delete", "table", "inet", TABLE], check=False)


def domain(sbx: Sandbox, spec: EnsembleSpec) -> dict[str, Any]:
    status, body = sbx.registry_get(f"/v1/ensembles/{spec.key}/domain")
    if status != 200:
        return {}
    doc = json.loads(body)
    return doc if isinstance(doc, dict) else {}


def wait_domain(sbx: Sandbox, spec: EnsembleSpec, want: Any, timeout: float,
                every: float = 0.2) -> tuple[dict[str, Any], float]:
    """Poll ``/domain`` until ``want(doc)``; (doc, seconds it took). AssertionError after."""
    t0 = time.monotonic()
    doc: dict[str, Any] = {}
    while True:
        doc = domain(sbx, spec)
        if doc and want(doc):
            return doc, time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"domain not as wanted within {timeout:g}s: status "
                                 f"{doc.get('status')}, missing {doc.get('missing_links')}, "
                                 f"problems {doc.get('problems')}")
        time.sleep(every)


def browser_missing() -> str | None:
    """Why no browser test can run here (None: it can)."""
    for path in (CHROMIUM, CHROMEDRIVER):
        if not os.access(path, os.X_OK):
            return f"{path} is not installed (Debian: apt-get install chromium chromium-driver)"
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install selenium)"
    return None


@contextlib.contextmanager
def browser() -> Iterator[Any]:
    """Headless Debian chromium under Selenium, explicit driver path, no downloads."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    os.environ["SE_OFFLINE"] = "true"  # Selenium Manager, should it run at all: no network
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1280,1400", "--no-first-run", "--disable-extensions",
                "--disable-background-networking", "--disable-component-update"):
        opts.add_argument(arg)
    profile = ARTIFACTS / "chromium-profile"
    shutil.rmtree(profile, ignore_errors=True)
    opts.add_argument(f"--user-data-dir={profile}")
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=opts)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def screenshot(driver: Any, name: str) -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    driver.save_screenshot(str(path))
    return path


def wait_page(driver: Any, what: str, probe: Any, timeout: float) -> float:
    """Poll the live page (no reload) until ``probe(driver)``; seconds it took."""
    t0 = time.monotonic()
    while not probe(driver):
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"the page did not show {what} within {timeout:g}s")
        time.sleep(0.1)
    return time.monotonic() - t0
