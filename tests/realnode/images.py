"""Images for the realnode tier, made here and imported into containerd: nothing is pulled.

* ``pause``: the static ``pause`` binary build_node.sh compiles from the Kubernetes
  module's build/pause sources, as a one-layer image under the sandbox image name
  containerd is configured with (``SANDBOX_IMAGE``).
* the host agent's image, ``localhost/imex-host-agent:<version>`` as ``make image``
  (tools/image.py) leaves it in podman's store, exported with ``podman save``.

Both go in as docker-archive tars through ``ctr -n k8s.io images import``; every pod of
the tier uses ``imagePullPolicy: Never``.
"""

from __future__ import annotations

import hashlib
import io
import json
import subprocess
import tarfile
from pathlib import Path

#: the sandbox image name containerd's CRI is configured with (pinned_images.sandbox);
#: the tag is build/pause's TAG (build_node.sh writes it beside the binary)
SANDBOX_REPO = "localhost/imex-realnode/pause"
AGENT_REPO = "localhost/imex-host-agent"


class ImageError(Exception):
    """An image could not be made, found or imported."""


def _tar_member(tar: tarfile.TarFile, name: str, data: bytes, mode: int = 0o644) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = mode
    info.mtime = 0
    tar.addfile(info, io.BytesIO(data))


def single_binary_archive(binary: Path, ref: str, out: Path,
                          entrypoint: tuple[str, ...] = ("/pause",), user: str = "65535",
                          ) -> Path:
    """A docker-archive tar at ``out`` holding one image, ``ref``: one layer with
    ``binary`` at ``entrypoint[0]``; reproducible (fixed times, no owner names)."""
    layer_buf = io.BytesIO()
    with tarfile.open(fileobj=layer_buf, mode="w", format=tarfile.PAX_FORMAT) as layer:
        _tar_member(layer, entrypoint[0].lstrip("/"), binary.read_bytes(), 0o755)
    layer_bytes = layer_buf.getvalue()
    diff_id = "sha256:" + hashlib.sha256(layer_bytes).hexdigest()
    config = json.dumps({
        "architecture": "amd64", "os": "linux",
        "config": {"Entrypoint": list(entrypoint), "User": user, "WorkingDir": "/"},
        "rootfs": {"type": "layers", "diff_ids": [diff_id]},
        "history": [{"created_by": f"imex-ensemble tests/realnode: {binary.name}"}],
    }, sort_keys=True).encode()
    config_name = hashlib.sha256(config).hexdigest() + ".json"
    manifest = json.dumps([{"Config": config_name, "RepoTags": [ref],
                            "Layers": ["layer.tar"]}]).encode()
    with tarfile.open(out, "w") as tar:
        _tar_member(tar, "layer.tar", layer_bytes)
        _tar_member(tar, config_name, config)
        _tar_member(tar, "manifest.json", manifest)
    return out


def sandbox_ref(bin_dir: Path) -> str:
    tag = (bin_dir / "pause.tag").read_text().strip()
    return f"{SANDBOX_REPO}:{tag}"


def agent_version() -> str:
    from importlib.metadata import version

    return version("imex-ensemble")


def require_agent_image(ref: str) -> None:
    """A clear error naming ``make image`` when podman's store has no ``ref``."""
    exists = subprocess.run(["podman", "image", "exists", ref], check=False)
    if exists.returncode != 0:
        raise ImageError(f"{ref} is not in podman's image store: build it first with "
                         "`make image` (tools/image.py)")


def save_agent_image(ref: str, out: Path) -> Path:
    """``podman save`` of ``ref`` (docker-archive)."""
    require_agent_image(ref)
    proc = subprocess.run(["podman", "save", "--format", "docker-archive", "-o", str(out), ref],
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise ImageError(f"podman save {ref} failed: {proc.stderr.strip()}")
    return out


def ctr_import(ctr: Path, address: Path, archive: Path) -> None:
    """Import ``archive`` into containerd's CRI namespace (k8s.io)."""
    proc = subprocess.run(
        [str(ctr), "--address", str(address), "-n", "k8s.io", "images", "import",
         str(archive)],
        capture_output=True, text=True, check=False, timeout=600)
    if proc.returncode != 0:
        raise ImageError(f"ctr images import {archive} failed: {proc.stderr.strip()}")


def ctr_images(ctr: Path, address: Path) -> list[str]:
    proc = subprocess.run([str(ctr), "--address", str(address), "-n", "k8s.io", "images",
                           "ls", "-q"], capture_output=True, text=True, check=True)
    return proc.stdout.split()
