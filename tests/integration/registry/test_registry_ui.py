"""The operator's page over real HTTP: whole without JavaScript, escaped, self-contained."""

from __future__ import annotations

import base64
import hashlib
import re

import httpx

from host_agent.state.snapshot import EnsembleSpec
from host_agent.state.store import State
from imex_shared.model import EnsembleId, Member
from tests.integration.registry.registry_harness import SPEC, serve
from tests.integration.registry.test_registry_domain import TRUSTED, put, state_of, view_of

BASE = "/v1/ensembles/gpu/nvl"


async def test_the_ensemble_page_is_rendered_on_the_server() -> None:
    async with serve(state_of(18), TRUSTED) as reg, httpx.AsyncClient(base_url=reg.url) as c:
        for i in range(18):
            await put(c, i, view_of(i, 18, {(4, 9)}))
        r = await c.get("/ui/ensembles/gpu/nvl")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    page = r.text
    assert len(r.content) < 100_000
    assert len(re.findall(r'<tr id="m-\d+">', page)) == 18
    assert '<div id="status" class="status st-DEGRADED">DEGRADED</div>' in page
    cell = re.search(r'<td class="cell ([^"]+)" data-from="4" data-to="9">(.)</td>', page)
    assert cell is not None and cell.groups() == ("s-D", "D")  # colour class and letter
    assert '<td class="cell s-C" data-from="9" data-to="4">C</td>' in page
    assert len(re.findall(r'<td class="cell', page)) == 18 * 18
    assert "<li>1 links not CONNECTED: 4-&gt;9</li>" in page
    # self-contained: no external script, style, font, image or frame
    assert not re.search(r'(src|href)="(https?:)?//', page)
    assert "@import" not in page and "url(" not in page


async def test_csp_allows_exactly_the_inline_script() -> None:
    async with serve(state_of(2), TRUSTED) as reg, httpx.AsyncClient(base_url=reg.url) as c:
        r = await c.get("/ui/ensembles/gpu/nvl")
        listing = await c.get("/ui/")
    scripts = re.findall(r"<script>(.*?)</script>", r.text, flags=re.S)
    assert len(scripts) == 1
    digest = base64.b64encode(hashlib.sha256(scripts[0].encode()).digest()).decode()
    csp = r.headers["content-security-policy"]
    assert f"script-src 'sha256-{digest}'" in csp and "default-src 'none'" in csp
    assert "connect-src 'self'" in csp
    assert listing.headers["content-security-policy"] == csp
    assert r.headers["x-content-type-options"] == "nosniff"


async def test_problems_and_names_are_escaped() -> None:
    state = State()
    spec = EnsembleSpec(EnsembleId("gpu", "nvl"), 4, 50000, token_sha256=SPEC.token_sha256)
    state.set(spec, [Member(0, "10.213.0.10", vmi="gb200-0")],
              ['annotation imex-ensemble.io/port=\'<script>alert(1)</script>\' is bad'])
    state.mark_synced()
    async with serve(state) as reg, httpx.AsyncClient(base_url=reg.url) as c:
        page = (await c.get("/ui/ensembles/gpu/nvl")).text
    assert "<script>alert(1)</script>" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page


async def test_the_list_page_and_its_refresh_source() -> None:
    async with serve(state_of(18), TRUSTED) as reg, httpx.AsyncClient(base_url=reg.url) as c:
        for i in range(18):
            await put(c, i, view_of(i, 18, set()), **({} if i else {"imex_state": "WAITING"}))
        page = (await c.get("/ui/")).text
        data = (await c.get("/ui/ensembles.json")).json()
        moved = await c.get("/ui", follow_redirects=False)
        refused = await c.post("/ui/ensembles/gpu/nvl")
        unknown = await c.get("/ui/ensembles/gpu/none")
    assert '<tr id="e-gpu/nvl">' in page and 'href="/ui/ensembles/gpu/nvl"' in page
    assert '<td class="members">18/18</td>' in page
    assert '<span class="domain badge st-DEGRADED">DEGRADED</span>' in page
    assert '<td class="ready">17</td>' in page
    assert data == {"items": [{"namespace": "gpu", "name": "nvl", "generation":
                               data["items"][0]["generation"], "members": 18,
                               "max_members": 18, "domain_status": "DEGRADED",
                               "imex_ready": 17}]}
    assert moved.status_code == 308 and moved.headers["location"] == "/ui/"
    assert refused.status_code == 405  # read-only
    assert unknown.status_code == 404
