"""`python -m tests.sandbox demo` (`make demo`): a 4-VM ensemble on this machine, end to end.

TEST STAND-IN, never product code. Steps, each timed until it has converged:

1. boot: the ensemble is declared as an ImexEnsemble (the host agent creates its
   Service), the virt-controller creates 4 VMIs; every VM's guest agent pins all slots
   in its /etc/hosts and its IMEX stand-in sees every peer CONNECTED;
2. crash: one VM dies (VMI Failed); its peers pin its slot to 127.0.0.2;
3. restore: the pool recreates it with a new IP; everyone is CONNECTED again.

While a step converges the registry table (``?format=table``) is printed whenever the
membership or a guest's reported IMEX state changes, under a one-line legend of the IMEX
column's transient states. After each step: ``kubectl get imexens`` as the API double's
Table form prints it (the CRD's printer columns: MEMBERS, IMEX-READY, READY, DOMAIN) and
the Events the agent wrote about the ensemble during the step (demo_views.py). At the
end: the IMEX stand-ins' own view (``nvidia-imex-ctl -N -j`` inside each VM), the step
times, teardown, and one verdict line. Exit 0 only when every step converged.

Without root the demo re-runs itself inside an unprivileged user namespace (``unshare
--user --map-root-user --net --mount``), where it may build the same namespaces, bridge and
per-VM /etc/hosts without touching the machine, and says so on its first line. Loopback
aliases cannot stand in for VMs: the agents refuse loopback addresses by design (peers
cannot reach them), and IMEX resolves slot names through one /etc/hosts per VM.

Teardown runs on success, failure, Ctrl-C and SIGTERM (the sandbox's context manager).
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TextIO

from tests.sandbox.demo_views import IMEX_LEGEND, event_lines, imexens_table, new_events
from tests.sandbox.ensemble import (
    EnsembleSpec,
    NotConverged,
    Sandbox,
    SandboxSettings,
    Vm,
    wait_for,
)

NAMESPACE = "demo"
NAME = "gb200"


@dataclass
class Step:
    name: str
    seconds: float | None = None
    note: str = ""

    @property
    def ok(self) -> bool:
        return self.seconds is not None


class TableWatcher:
    """Prints the registry table whenever membership or a guest's IMEX state changes."""

    def __init__(self, sbx: Sandbox, spec: EnsembleSpec, out: TextIO) -> None:
        self.sbx = sbx
        self.spec = spec
        self.out = out
        self.last: Any = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def key(self) -> Any:
        doc = self.sbx.registry_json(self.spec)
        if not doc:
            return None
        return (doc.get("generation"),
                tuple((m.get("index"), m.get("ip"), m.get("phase"), m.get("ready"),
                       (m.get("guest") or {}).get("imex_state"))
                      for m in doc.get("members", [])))

    def check(self) -> None:
        key = self.key()
        if key is not None and key != self.last:
            self.last = key
            table = self.sbx.registry_table(self.spec)
            self.out.write("\n" + "\n".join("    " + ln for ln in table.rstrip().splitlines())
                           + "\n\n")
            self.out.flush()

    def __enter__(self) -> TableWatcher:
        def loop() -> None:
            while not self._stop.wait(0.5):
                try:
                    self.check()
                except Exception as e:
                    logging.getLogger("demo").debug("table: %s", e)

        self._thread = threading.Thread(target=loop, name="demo-table", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        self.check()


def imex_view(vm: Vm) -> str:
    """One line of IMEX's own view of the domain, from ``nvidia-imex-ctl -N -j``."""
    doc = vm.domain()
    if not doc:
        return f"  {vm.vmi:<10} {vm.ip:<15} (nvidia-imex-ctl: no answer)"
    own = str(vm.imex_state().get("node_id"))
    node = (doc.get("nodes") or {}).get(own) or {}
    conns = node.get("connections") or {}
    peers = "  ".join(f"{i}:{c.get('status')}" for i, c in sorted(conns.items(),
                                                                    key=lambda kv: int(kv[0]))
                      if vm.hosts_block() is None or (vm.hosts_block() or {}).get(int(i))
                      != "127.0.0.2")
    return (f"  {vm.vmi:<10} {vm.ip:<15} node {own:<2} {node.get('status', '?'):<8} "
            f"domain {doc.get('status', '?'):<8} peers {peers}")


def run_demo(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    from tests.sandbox.virt_controller import VirtController

    t_start = time.monotonic()

    def say(text: str) -> None:
        out.write(f"[{time.monotonic() - t_start:6.1f}s] {text}\n")
        out.flush()

    steps = [Step("boot"), Step("crash"), Step("restore")]
    failure = ""
    settings = SandboxSettings(prefix="demo", keep_workdir=args.keep)
    who = ("not root: inside an unprivileged user namespace" if os.environ.get(ROOTLESS_ENV)
           else "running as root")
    say(f"imex-ensemble demo: {args.vms} VMs as network namespaces on a bridge ({who}), "
        "the Kubernetes API double, the DNS stand-in (TTL 5), the real host agent "
        "and registry, the real guest agents with IMEX stand-ins")
    try:
        with Sandbox(settings) as sbx:
            say(f"sandbox up: API {sbx.api.url if sbx.api else '?'}, DNS {sbx.dns_address}, "
                f"registry {sbx.registry_url}, VM subnet "
                f"{sbx.fabric.subnet if sbx.fabric else '?'}, files in {sbx.workdir}")
            ctl = VirtController(sbx)
            try:
                spec = ctl.create_ensemble(NAMESPACE, NAME, max_members=args.vms, form="cr")
                pool = ctl.pool(spec)
                failure = _steps(sbx, spec, pool, steps, args, say, out,
                                 CrView(sbx, ctl, spec, out))
                out.write("\nIMEX stand-ins' own view (nvidia-imex-ctl -N -j in each VM):\n")
                for vm in sbx.vms_of(spec):
                    out.write(imex_view(vm) + "\n")
                all_up = all(vm.domain().get("status") == "UP" for vm in sbx.vms_of(spec))
                if not all_up and not failure:
                    failure = "not every IMEX stand-in reports its domain UP"
            finally:
                ctl.close()
            say("tearing down (VMs, namespaces, bridge, host agent, DNS, API double)")
    except KeyboardInterrupt:
        say("interrupted; torn down")
        failure = failure or "interrupted"
    except Exception as e:
        failure = failure or f"{type(e).__name__}: {e}"
    total = time.monotonic() - t_start
    out.write("\nstep        converged in\n")
    for st in steps:
        out.write(f"  {st.name:<9} {f'{st.seconds:.1f} s' if st.ok else 'NOT CONVERGED':<14}"
                  f" {st.note}\n")
    ok = not failure and all(st.ok for st in steps)
    times = ", ".join(f"{st.name} {st.seconds:.1f} s" for st in steps if st.ok)
    if ok:
        out.write(f"VERDICT: PASS - every step converged ({times}); total {total:.0f} s\n")
        return 0
    reason = " ".join((failure or "a step did not converge").split())  # one line
    out.write(f"VERDICT: FAIL - {reason}; total {total:.0f} s\n")
    return 1


class CrView:
    """After a step: the ImexEnsemble as `kubectl get imexens` shows it, and its new Events."""

    def __init__(self, sbx: Sandbox, ctl: Any, spec: EnsembleSpec, out: TextIO) -> None:
        self.sbx, self.ctl, self.spec, self.out = sbx, ctl, spec, out
        self.seen: set[str] = set()

    def show(self, what: str, want: Callable[[dict[str, Any]], bool],
             want_events: tuple[str, ...] = (), timeout: float = 30.0) -> str:
        """Print the table once the CR's status says ``want`` (the status writer follows
        the registry, coalescing to one write a second) and every reason of
        ``want_events`` is among the Events since the last call, then those Events.
        Returns "" or what never came (the table and Events are printed either way)."""
        deadline = time.monotonic() + timeout
        fresh: list[dict[str, Any]] = []
        while True:
            fresh += new_events(self.ctl.events(self.spec), self.seen)
            status = self.ctl.get_ensemble(self.spec).get("status") or {}
            missing = [r for r in want_events if r not in {e["reason"] for e in fresh}]
            if (want(status) and not missing) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        self.out.write(f"\n  $ kubectl get imexens -n {self.spec.namespace}    # {what}\n")
        for line in imexens_table(self.sbx, self.spec).splitlines():
            self.out.write(f"    {line}\n")
        self.out.write(f"  $ kubectl describe imexens {self.spec.name} -n "
                       f"{self.spec.namespace}    # its Events during this step\n")
        for line in event_lines(fresh) if fresh else ["(none)"]:
            self.out.write(f"    {line}\n")
        self.out.write("\n")
        self.out.flush()
        if not want(status):
            return f"{what}: the ImexEnsemble's status did not follow in {timeout:.0f} s"
        return f"{what}: no {', '.join(missing)} Event" if missing else ""


def ready(n: int, of: int) -> Callable[[dict[str, Any]], bool]:
    """The status that says ``n`` of ``of`` members are published and IMEX READY, and
    Ready is True and the domain UP when all are (Ready False otherwise)."""
    def check(status: dict[str, Any]) -> bool:
        cond: dict[str, Any] = next(
            (c for c in status.get("conditions") or () if c["type"] == "Ready"), {})
        return (status.get("publishedSummary") == f"{n}/{of}"
                and status.get("imexReady") == n
                and cond.get("status") == ("True" if n == of else "False")
                and (n < of or status.get("domainStatus") == "UP"))
    return check


def _steps(sbx: Sandbox, spec: EnsembleSpec, pool: Any, steps: list[Step],
           args: argparse.Namespace, say: Callable[[str], None], out: TextIO,
           cr: CrView) -> str:
    timeout = args.timeout
    out.write(f"  {IMEX_LEGEND}\n")
    with TableWatcher(sbx, spec, out):
        say(f"step 1/3 boot: ImexEnsemble {spec.key} (max-members {spec.max_members}; "
            f"the host agent creates its Service) and VMIs {pool.name}-0..{args.vms - 1}: "
            "Pending -> Scheduled -> Running")
        t0 = time.monotonic()
        # the Service is the agent's: the VMs' reports need it to exist (the e2e does so)
        wait_for("the ImexEnsemble's Service", lambda: sbx.registry_json(spec), timeout, 0.1)
        pool.scale(args.vms)
        try:
            sbx.wait_converged(spec, timeout)
        except NotConverged as e:
            return f"boot: {e}"
        steps[0].seconds = time.monotonic() - t0
        steps[0].note = f"{args.vms} VMs: every slot pinned, every IMEX peer CONNECTED"
        say(f"converged in {steps[0].seconds:.1f} s")
    if failure := cr.show("after boot", ready(args.vms, args.vms),
                          ("ServiceCreated", "MemberJoined"), timeout):
        return failure

    victim = min(args.vms - 1, 2)
    vm = sbx.vm(spec, pool.vmi_name(victim))
    old_ip = vm.ip
    with TableWatcher(sbx, spec, out):
        say(f"step 2/3 crash: {vm.vmi} ({old_ip}) loses every process; VMI -> Failed")
        t0 = time.monotonic()
        pool.crash(victim)
        expect = {v.index: v.ip for v in sbx.vms_of(spec)}
        try:
            sbx.wait_converged(spec, timeout, expect=expect)
        except NotConverged as e:
            return f"crash: {e}"
        steps[1].seconds = time.monotonic() - t0
        steps[1].note = f"peers pin slot {victim} to 127.0.0.2"
        say(f"converged in {steps[1].seconds:.1f} s")
    if failure := cr.show("after the crash", ready(args.vms - 1, args.vms),
                          ("MemberLeft",), timeout):
        return failure

    with TableWatcher(sbx, spec, out):
        say(f"step 3/3 restore: the pool deletes and recreates {vm.vmi}; the new VM gets a "
            "new IP")
        t0 = time.monotonic()
        pool.restore(victim)
        new_ip = sbx.vm(spec, pool.vmi_name(victim)).ip
        try:
            sbx.wait_converged(spec, timeout)
        except NotConverged as e:
            return f"restore: {e}"
        steps[2].seconds = time.monotonic() - t0
        steps[2].note = f"slot {victim}: {old_ip} -> {new_ip}, every IMEX peer CONNECTED"
        say(f"converged in {steps[2].seconds:.1f} s")
    if failure := cr.show("after the restore", ready(args.vms, args.vms),
                          ("MemberJoined",), timeout):
        return failure
    return ""


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--vms", type=int, default=4, help="number of VMs (2-18, default 4)")
    parser.add_argument("--timeout", type=float, default=90.0,
                        help="seconds each step may take to converge (default 90)")
    parser.add_argument("--keep", action="store_true",
                        help="keep the work directory (agent logs, configs) after teardown")
    parser.add_argument("-v", "--verbose", action="store_true", help="sandbox debug logging")


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if not 2 <= args.vms <= 18:
        print(f"demo: --vms {args.vms}: must be between 2 and 18", file=sys.stderr)
        return 2
    if os.geteuid() != 0:
        return rootless(args)
    return run_demo(args)


#: set in the re-executed demo inside the user namespace (and says so on its first line)
ROOTLESS_ENV = "IMEX_SANDBOX_ROOTLESS"
# Inside a new user + network + mount namespace we are root for that namespace only: a
# private /run for `ip netns`, a private copy of /etc so /etc/netns/<vm>/hosts can exist,
# loopback up. Nothing outside the namespaces is touched.
_ROOTLESS_SETUP = (
    "set -e; mount -t tmpfs imex-sandbox-run /run; mkdir -p /run/netns; "
    'etc=$(mktemp -d); mount -t tmpfs imex-sandbox-etc "$etc"; '
    'cp -a /etc/. "$etc"/ 2>/dev/null || true; mount --bind "$etc" /etc; '
    'mkdir -p /etc/netns; ip link set lo up; exec "$@"'
)


def rootless_argv(argv: list[str]) -> list[str]:
    return ["unshare", "--user", "--map-root-user", "--net", "--mount",
            "--propagation", "private", "sh", "-c", _ROOTLESS_SETUP, "sh", *argv]


def userns_available() -> bool:
    """Can this user create a user namespace with its own network and mounts?"""
    try:
        probe = subprocess.run(rootless_argv(["ip", "netns", "list"]), capture_output=True,
                               timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probe.returncode == 0


def rootless(args: argparse.Namespace) -> int:
    """Not root: run the same demo inside an unprivileged user namespace, saying so."""
    if os.environ.get(ROOTLESS_ENV):
        print("demo: still not root inside the user namespace", file=sys.stderr)
        return 2
    if not userns_available():
        print("demo: not root, and this machine does not allow unprivileged user namespaces "
              "(the VMs need their own network stack and /etc/hosts); run it as root "
              "(sudo make demo)", file=sys.stderr)
        return 2
    print("demo: not root: running inside an unprivileged user namespace (its own network "
          "stack, /run and /etc copy); nothing outside it is touched", flush=True)
    argv = [sys.executable, "-m", "tests.sandbox", "demo", *sys.argv[2:]]
    env = {**os.environ, ROOTLESS_ENV: "1"}
    try:
        return subprocess.run(rootless_argv(argv), env=env, check=False).returncode
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    p = argparse.ArgumentParser(prog="python -m tests.sandbox.demo")
    configure(p)
    sys.exit(main(p.parse_args()))
