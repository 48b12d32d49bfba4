"""The guest's credentials against a real registry: first certificate, file modes, the pin
check (direct, via the cross-signature, refused), renewal on a rotation, backoff.

The registry is the real app under uvicorn on loopback with a CA from host_agent.ca.authority;
the keeper is guest_agent.tls.keeper_io.CertKeeper, whose child writes real files.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import os
import stat
from pathlib import Path

import pytest
from cryptography import x509

from guest_agent.tls import creds as tls
from guest_agent.tls import keeper_io
from guest_agent.tls.imex_config import merge_imex_config
from guest_agent.tls.keeper import CertFacts, KeeperError, expiring, renew_at
from host_agent.ca import authority as ca_mod
from host_agent.ca.secret_io import CaUnavailable
from host_agent.state.snapshot import EnsembleSpec
from host_agent.state.store import State
from imex_shared.model import EnsembleId, Member
from tests.host_support.ca import end_overlap
from tests.integration.registry.registry_harness import SPEC, TOKEN, serve

ENS = EnsembleId("gpu", "tls")


class MutableCa:
    def __init__(self, state: ca_mod.CaState | None) -> None:
        self.state = state
        self.calls = 0

    async def load(self, ens: EnsembleId) -> ca_mod.CaState:
        self.calls += 1
        if self.state is None:
            raise CaUnavailable("not yet")
        return self.state


def registry_state() -> State:
    state = State()
    spec = EnsembleSpec(ENS, 4, 50000, token_sha256=SPEC.token_sha256, auth_encryption=True)
    state.set(spec, [Member(0, "10.213.0.10")], [], {0: frozenset({"10.213.0.10", "127.0.0.1"})})
    state.mark_synced()
    return state


def keeper(url: str, tls_dir: Path, pin: str, renewed: list[int]) -> keeper_io.CertKeeper:
    base = f"{url}/v1/ensembles/gpu/tls"
    token = tls_dir.parent / "token"
    token.write_text(TOKEN + "\n")
    k = keeper_io.CertKeeper(tls_dir=str(tls_dir), ca_sha256=pin,
                             url_for=lambda i: f"{base}/members/{i}/certificate",
                             token_file=str(token), on_renewed=lambda: renewed.append(1))
    k.set_slot(0, ENS.slot(0))
    return k


def mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


async def until(cond: object, within: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + within
    while not cond():  # type: ignore[operator]
        assert loop.time() < end, "not reached in time"
        await asyncio.sleep(0.02)


async def test_first_certificate_files_modes_and_rotation(tmp_path: Path) -> None:
    now = dt.datetime.now(dt.UTC)
    first = ca_mod.first_state(ENS, now)
    source = MutableCa(first)
    tls_dir = tmp_path / "tls"
    renewed: list[int] = []
    async with serve(registry_state(), ca_source=source) as reg:
        k = keeper(reg.url, tls_dir, first.sha256, renewed)
        await k.start()
        # the key exists (0600) before anything was asked
        assert mode(tls_dir / "imex.key") == 0o600 and not k.ready.is_set()
        key_bytes = (tls_dir / "imex.key").read_bytes()
        task = asyncio.create_task(k.run())
        try:
            await until(lambda: renewed)
            assert k.ready.is_set()
            assert mode(tls_dir / "imex.key") == 0o600
            assert mode(tls_dir / "imex.crt") == 0o644 and mode(tls_dir / "ca.crt") == 0o644
            assert (tls_dir / "imex.key").read_bytes() == key_bytes  # the key never changes
            cert = x509.load_pem_x509_certificate((tls_dir / "imex.crt").read_bytes())
            assert cert.issuer == first.current.cert.subject
            assert k.status.ca_sha256 == first.sha256 and k.status.renewals == 1
            assert k.due(dt.datetime.now(dt.UTC)) is None
            assert k.obtained is not None
            assert k.cert is not None and k.cert.not_after == cert.not_valid_after_utc
            at = renew_at(k.cert, k.obtained)
            assert at == k.obtained + (cert.not_valid_after_utc - k.obtained) * 2 / 3
            assert k.due(at - dt.timedelta(seconds=1)) is None
            assert k.due(at) == "two thirds of its lifetime have passed"
            before = k.creds_digest()
            # a rotation: the registry publishes a new bundle digest, the guest renews at once
            trust = ca_mod.rotate(first, ENS, "r1", now, dt.timedelta(hours=1))
            steps = [trust, ca_mod.advance(trust, now + dt.timedelta(minutes=30)),
                     end_overlap(trust, now + dt.timedelta(hours=2))]
            signers = [first.current.cert, trust.current.cert, trust.current.cert]
            held = [[first, trust], [trust, first], [trust]]
            for n, (state, signer, cas) in enumerate(zip(steps, signers, held, strict=True)):
                source.state = state
                k.set_registry_bundle(state.bundle_sha256())
                await until(lambda n=n: len(renewed) == n + 2)
                cert2 = x509.load_pem_x509_certificate((tls_dir / "imex.crt").read_bytes())
                assert cert2.issuer == signer.subject, n
                trusted = x509.load_pem_x509_certificates((tls_dir / "ca.crt").read_bytes())
                assert [ca_mod.fingerprint(c) for c in trusted] == [
                    c.current.sha256 for c in cas], n
                # the new CA is pinned as soon as the cross-signature vouches for it
                assert (tls_dir / "pinned-ca.sha256").read_text().strip() == \
                    trust.current.sha256
            assert k.creds_digest() != before
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def test_a_bundle_from_another_ca_is_refused_and_the_files_stay(tmp_path: Path) -> None:
    now = dt.datetime.now(dt.UTC)
    first = ca_mod.first_state(ENS, now)
    source = MutableCa(first)
    tls_dir = tmp_path / "tls"
    renewed: list[int] = []
    async with serve(registry_state(), ca_source=source) as reg:
        k = keeper(reg.url, tls_dir, first.sha256, renewed)
        await k.request()
        kept = {n: (tls_dir / n).read_bytes() for n in ("imex.key", "imex.crt", "ca.crt")}
        # someone swaps the CA (a Secret replaced by hand, a registry impostor)
        impostor = ca_mod.first_state(ENS, now)
        source.state = impostor
        with pytest.raises(KeeperError, match="pinned fingerprint") as err:
            await k.request()
        assert err.value.refused
        # a "rotation" whose cross certificate was signed by a stranger is refused too
        stranger = ca_mod.first_state(EnsembleId("x", "y"), now)
        forged = ca_mod.rotate(stranger, ENS, "r1", now, dt.timedelta(hours=1))
        source.state = ca_mod.CaState(forged.current, first.current.cert, forged.cross, "r1",
                                      forged.overlap_until)
        with pytest.raises(KeeperError, match="does not chain to the pinned CA") as err:
            await k.request()
        assert err.value.refused
    assert {n: (tls_dir / n).read_bytes() for n in kept} == kept
    assert not (tls_dir / "pinned-ca.sha256").exists()
    assert len(renewed) == 1


async def test_registry_unreachable_keeps_the_certificate_and_backs_off(tmp_path: Path) -> None:
    now = dt.datetime.now(dt.UTC)
    first = ca_mod.first_state(ENS, now)
    renewed: list[int] = []
    async with serve(registry_state(), ca_source=MutableCa(first)) as reg:
        url = reg.url
        k = keeper(url, tmp_path / "tls", first.sha256, renewed)
        await k.request()
    cert = (tmp_path / "tls" / "imex.crt").read_bytes()
    # the registry is gone; force a renewal and watch it fail, keep the file, and retry
    k.started = True
    k.set_registry_bundle("0" * 64)
    task = asyncio.create_task(k.run())
    try:
        await until(lambda: k.status.failures >= 1)
        assert "certificate request failed" in (k.status.last_error or "")
        assert k.status.waiting == "retrying in 2 s"
        assert (tmp_path / "tls" / "imex.crt").read_bytes() == cert
        assert len(renewed) == 1
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def test_csr_names_exactly_the_slot_and_the_config_merge_keeps_other_lines() -> None:
    key = tls.make_key()
    csr = x509.load_pem_x509_csr(tls.make_csr(key, ENS.slot(3)).encode())
    ca_mod.check_csr_names(csr, ENS.slot(3))  # what the registry accepts
    text = "SERVER_PORT=50000\n# comment\nIMEX_ENABLE_AUTH_ENCRYPTION=0\nDAEMONIZE=1\n"
    merged = merge_imex_config(text, [("IMEX_ENABLE_AUTH_ENCRYPTION", "1"),
                                      ("IMEX_AUTH_SOURCE", "FILE")])
    assert merged == ("SERVER_PORT=50000\n# comment\nIMEX_ENABLE_AUTH_ENCRYPTION=1\n"
                      "DAEMONIZE=1\nIMEX_AUTH_SOURCE=FILE\n")
    assert merge_imex_config(merged, [("IMEX_AUTH_SOURCE", "FILE")]) == merged


DOC = Path(__file__).resolve().parents[3] / "docs" / "guest-agent.md"


async def test_the_documented_paths_and_modes_are_what_the_keeper_writes(
        tmp_path: Path) -> None:
    import re

    from guest_agent.config import Settings

    rows = re.findall(r"^\| `(/[^`]+)` \| (0[0-7]{3}) \|", DOC.read_text(), re.M)
    documented = {Path(p).name: int(m, 8) for p, m in rows}
    default_dir = Settings(ensemble="e", namespace="n").tls_dir
    assert {str(Path(default_dir) / n) for n in documented} == {p for p, _ in rows}
    now = dt.datetime.now(dt.UTC)
    first = ca_mod.first_state(ENS, now)
    rotated = ca_mod.rotate(first, ENS, "r", now, dt.timedelta(hours=1))
    renewed: list[int] = []
    async with serve(registry_state(), ca_source=MutableCa(rotated)) as reg:
        k = keeper(reg.url, tmp_path / "tls", first.sha256, renewed)
        await k.request()  # a rotation in progress: the pin file is written too
    written = {p.name: mode(p) for p in (tmp_path / "tls").iterdir()}
    assert written == documented
    assert mode(tmp_path / "tls") == 0o700


def test_renewal_counts_from_when_the_certificate_came_not_from_the_backdated_start() -> None:
    now = dt.datetime(2026, 12, 1, 12, 0, tzinfo=dt.UTC)
    state = ca_mod.first_state(ENS, now)
    key = tls.make_key()
    csr = x509.load_pem_x509_csr(tls.make_csr(key, ENS.slot(0)).encode())
    short = ca_mod.issue_leaf(state.current, csr, ENS.slot(0), now, dt.timedelta(seconds=90))
    assert short.not_valid_before_utc == now - dt.timedelta(minutes=5)
    facts = CertFacts((ENS.slot(0),), short.not_valid_before_utc, short.not_valid_after_utc)
    # from notBefore, 2/3 of 390 s would be 40 s *before* issue: a renewal loop
    assert renew_at(facts) < now
    assert renew_at(facts, now) == now + dt.timedelta(seconds=60)
    assert expiring(facts, now)  # 90 s left: within 24 h


async def test_a_404_is_said_once_and_asked_again_only_slowly(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A registry that answers the certificate request 404 (here: a member it does not
    publish) is not an error loop: said once, asked again every BACKOFF_MAX."""
    import logging

    from guest_agent.tls.keeper import BACKOFF_MAX

    caplog.set_level(logging.DEBUG, logger="guest_agent.certkeeper")
    now = dt.datetime.now(dt.UTC)
    first = ca_mod.first_state(ENS, now)
    async with serve(registry_state(), ca_source=MutableCa(first)) as reg:
        k = keeper(reg.url, tmp_path / "tls", first.sha256, [])
        k.set_slot(3, ENS.slot(3))  # not published there: 404
        k.started = True
        sleeps: list[float] = []
        real_sleep = asyncio.sleep

        async def recorded(seconds: float) -> None:
            if seconds >= 1:  # the keeper's waits (the test's own polls are shorter)
                sleeps.append(seconds)
                seconds = 0  # the test does not wait five minutes
            await real_sleep(seconds)

        keeper_io.asyncio.sleep = recorded  # type: ignore[attr-defined]
        task = asyncio.create_task(k.run())
        try:
            await until(lambda: k.status.failures >= 2, within=60)  # a child each
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            keeper_io.asyncio.sleep = real_sleep  # type: ignore[attr-defined]
    assert "404" in (k.status.last_error or "")
    assert sleeps and all(s >= BACKOFF_MAX * 0.8 for s in sleeps), sleeps  # slow at once
    said = [r for r in caplog.records if "keeping the current credentials" in r.getMessage()]
    assert [r.levelname for r in said[:2]] == ["WARNING", "DEBUG"]
