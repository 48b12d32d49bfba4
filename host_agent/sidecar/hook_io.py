"""KubeVirt hook-sidecar handshake: answer virt-launcher's ``Info`` call on a unix socket.

Why: a container requested through ``hooks.kubevirt.io/hookSidecars`` counts
as a hook sidecar. virt-launcher will not start the VM until it has found, in
its hooks directory, one socket per requested sidecar that answers
``kubevirt.hooks.info.Info/Info`` with a hook version it supports
(``v1alpha3``, ``v1alpha2`` or ``v1alpha1``); an ``Info`` error or a list
with none of these fails the VMI. The host agent changes nothing in the
domain, so it says ``v1alpha3`` and ``v1alpha2`` and subscribes to one hook
point only, ``Shutdown`` (v1alpha3): virt-launcher calls it when it is done
with the VM, so that a sidecar does not keep a finished launcher pod (such as
a live migration's source) running. The agent then stops after
``shutdown_linger`` seconds, long enough for its watch to see the VMI's final
state and remove its slice. ``OnDefineDomain`` and ``PreCloudInitIso`` are
served too, returning their input unchanged, but are not subscribed, so
virt-launcher does not call them.

Socket rules: the path is created by this server (the directory must exist:
KubeVirt mounts its hooks emptyDir at ``/var/run/kubevirt-hooks`` in every
sidecar container). Nothing else is ever written to that directory, because
virt-launcher dials every entry it finds there. A socket left by a previous
run of this container (the emptyDir outlives a container restart) is
replaced; a live server on the path, or a file that is not a socket, is an
error. The socket is made connectable by any user in the pod (0666): the
launcher may run as a different user. On stop the socket is removed (grpc
unlinks the path when its listener closes; ``stop`` also removes it if that
did not happen and it is still the file this server created).

Concurrency: one ``grpc.aio`` server in the agent's event loop. Handlers never
raise to grpc: a malformed message is answered ``INVALID_ARGUMENT`` naming
the field, an unknown method ``UNIMPLEMENTED`` (grpc's own), and the agent
goes on. ``on_shutdown`` is called from the event loop after the answer is
built; it must not block.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import stat
from collections.abc import Awaitable, Callable
from typing import Final, TypeVar

import grpc
import grpc.aio

from host_agent.sidecar import hook as hp

log = logging.getLogger("imex.host.hook")

T = TypeVar("T")

HOOK_NAME: Final = "imex-host-agent"
Handler = Callable[[bytes, grpc.aio.ServicerContext[bytes, bytes]], Awaitable[bytes]]


def info_result() -> hp.InfoResult:
    """What the agent tells virt-launcher: no domain changes, only the Shutdown hook."""
    return hp.InfoResult(
        name=HOOK_NAME,
        versions=(hp.V1ALPHA3, hp.V1ALPHA2),
        hook_points=(hp.HookPoint(hp.SHUTDOWN, 0),),
    )


def _prepare_path(path: str) -> None:
    directory = os.path.dirname(path)
    if not os.path.isdir(directory):
        raise hp.HookSidecarError(
            f"hook socket {path!r}: directory {directory!r} does not exist "
            f"(KubeVirt mounts {hp.HOOKS_DIR} into hook sidecar containers)")
    _clear_stale_socket(path)


def _remove_if_same(path: str, inode: tuple[int, int]) -> None:
    """Unlink ``path`` only if it is still the socket we created (same device and inode)."""
    try:
        st = os.lstat(path)
        if (st.st_dev, st.st_ino) == inode:
            os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("cannot remove hook socket %s: %s", path, exc)


def _clear_stale_socket(path: str) -> None:
    """Remove a socket nobody answers on; refuse a live one or a non-socket."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise hp.HookSidecarError(
            f"hook socket {path!r}: exists and is not a socket; not touching it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(path)
    except OSError:
        log.info("removing stale hook socket %s (nothing listens on it)", path)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        return
    finally:
        probe.close()
    raise hp.HookSidecarError(f"hook socket {path!r}: another server is listening on it")


class HookServer:
    """The Info server on one unix socket; ``start`` then ``stop`` (both idempotent-safe)."""

    def __init__(self, path: str, on_shutdown: Callable[[], None] | None = None) -> None:
        hp.check_socket_path(path)
        self.path = path
        self._on_shutdown = on_shutdown
        self._server: grpc.aio.Server | None = None
        self._inode: tuple[int, int] | None = None
        self.info_calls = 0

    # --- handlers (raw bytes in, raw bytes out) ---

    async def _info(self, request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
        await _decode_or_abort(context, "InfoParams", hp.check_empty_message, request)
        self.info_calls += 1
        result = info_result()
        log.info("KubeVirt hook Info answered: versions %s, hook points %s",
                 ",".join(result.versions), ",".join(p.name for p in result.hook_points))
        return result.encode()

    async def _on_define_domain(
        self, request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]
    ) -> bytes:
        params = await _decode_or_abort(
            context, "OnDefineDomainParams", hp.OnDefineDomainParams.decode, request)
        return hp.OnDefineDomainResult(params.domain_xml).encode()

    async def _pre_cloud_init_iso(
        self, request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]
    ) -> bytes:
        params = await _decode_or_abort(
            context, "PreCloudInitIsoParams", hp.PreCloudInitIsoParams.decode, request)
        return hp.PreCloudInitIsoResult(
            params.cloud_init_no_cloud_source, params.cloud_init_data).encode()

    async def _shutdown(
        self, request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]
    ) -> bytes:
        await _decode_or_abort(context, "ShutdownParams", hp.check_empty_message, request)
        log.info("KubeVirt hook Shutdown: virt-launcher is done with the VM")
        if self._on_shutdown is not None:
            self._on_shutdown()
        return b""

    def _handlers(self) -> list[grpc.GenericRpcHandler]:
        def unary(fn: Handler) -> grpc.RpcMethodHandler[bytes, bytes]:
            return grpc.unary_unary_rpc_method_handler(fn)

        callbacks = {hp.ON_DEFINE_DOMAIN: unary(self._on_define_domain),
                     hp.PRE_CLOUD_INIT_ISO: unary(self._pre_cloud_init_iso)}
        return [
            grpc.method_handlers_generic_handler(hp.INFO_SERVICE, {"Info": unary(self._info)}),
            grpc.method_handlers_generic_handler(
                hp.CALLBACKS_SERVICE.format(version=hp.V1ALPHA2), dict(callbacks)),
            grpc.method_handlers_generic_handler(
                hp.CALLBACKS_SERVICE.format(version=hp.V1ALPHA3),
                {**callbacks, hp.SHUTDOWN: unary(self._shutdown)}),
        ]

    async def start(self) -> None:
        """Create the socket and answer on it; HookSidecarError if that cannot be done."""
        _prepare_path(self.path)
        server = grpc.aio.server()
        server.add_generic_rpc_handlers(self._handlers())
        try:
            bound = server.add_insecure_port("unix:" + self.path)
        except RuntimeError as exc:
            raise hp.HookSidecarError(f"hook socket {self.path!r}: cannot bind: {exc}") from exc
        if not bound:
            raise hp.HookSidecarError(f"hook socket {self.path!r}: cannot bind")
        try:
            os.chmod(self.path, 0o666)
            st = os.lstat(self.path)
            self._inode = (st.st_dev, st.st_ino)
            await server.start()
        except OSError as exc:
            await server.stop(None)
            raise hp.HookSidecarError(f"hook socket {self.path!r}: {exc}") from exc
        self._server = server
        log.info("KubeVirt hook server listening on %s", self.path)

    async def stop(self, grace: float = 1.0) -> None:
        """Stop answering (in-flight calls get ``grace`` seconds) and remove our socket."""
        server, self._server = self._server, None
        if server is not None:
            await server.stop(grace)
        if self._inode is not None:
            _remove_if_same(self.path, self._inode)
            self._inode = None


async def _decode_or_abort(
    context: grpc.aio.ServicerContext[bytes, bytes],
    what: str,
    decode: Callable[[bytes], T],
    request: bytes,
) -> T:
    try:
        return decode(request)
    except hp.ProtoError as exc:
        log.warning("malformed %s from hook client: %s", what, exc)
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed {what}: {exc}")
        raise AssertionError("context.abort returned") from exc  # abort always raises
