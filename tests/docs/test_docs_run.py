"""make docs-test: the docs' shell blocks, pasted in order against the real control plane.

Each doc of tests/docs/blocks.py's DOCS is read as a reader would: its shell blocks in
order, in one shell's worth of state (the directory a ``cd`` left, the variables a block
set), in a temporary copy of the tree, with ``kubectl`` and ``helm`` (the versions
tests/realk8s/build.sh built) and this tree's ``imex-guest-agent`` on PATH and the
control plane's admin kubeconfig in ``KUBECONFIG``. A block marked ``not run`` is left
out, or replaced by its ``instead``. Every command must succeed (``set -e -o pipefail``),
and what a block says it prints (a count in a comment, a hash, printer columns) is
checked from its output by ``CHECKS``, keyed by the block's ``id``.

The cluster has what a KubeVirt and Multus cluster serves that the docs apply: the VMI,
VirtualMachinePool and NetworkAttachmentDefinition kinds (tests/realk8s/crd.py builds
them from KubeVirt's published schema). It has no kubelet and no VMs, which is why the
blocks needing them are marked.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from tests.docs import blocks
from tests.realk8s.crd import kubevirt_openapi, network_attachment_definition_crd, pool_crd
from tests.realk8s.harness import ControlPlane

pytestmark = pytest.mark.realk8s

REPO = blocks.REPO
#: what a reader's clone has that a copy needs (no venv, no build output, no VCS)
_IGNORE = shutil.ignore_patterns(".git", ".venv", "build", "dist", "test-artifacts",
                                 "__pycache__", "*.egg-info", ".mypy_cache", ".ruff_cache")
_STATE = "__imex_docs_state__"


@dataclass
class Ran:
    """One block's run: its output and where the reader is afterwards."""

    block: blocks.Block
    stdout: str
    stderr: str
    cwd: Path
    root: Path


def _check_render(r: Ran) -> None:
    # the member from members.json by its name, the rest of the 18 slots parked
    assert re.search(r"^10\.0\.0\.1\timex-[0-9a-f]{8}-0$", r.stdout, re.M), r.stdout
    assert r.stdout.count("\timex-") == 18
    assert "# BEGIN imex-ensemble gpu/gb200" in r.stdout


def _check_token_hash(r: Ran) -> None:
    token = (r.cwd / "gb200.token").read_text().strip()
    want = hashlib.sha256(token.encode()).hexdigest()
    assert r.stdout.strip() == f"tokenSHA256: {want}"


def _check_userdata_secret(r: Ran) -> None:
    assert r.stdout.splitlines()[-1] == "1", r.stdout  # "# 1: the user-data Secret"
    (secret,) = [d for d in yaml.safe_load_all((r.cwd / "secret-userdata.yaml").read_text())
                 if d]
    assert secret["kind"] == "Secret" and secret["metadata"]["name"] == "gb200-userdata"


def _check_create(r: Ran) -> None:
    lines = r.stdout.splitlines()
    # "# MEMBERS, IMEX-READY, READY": the CRD's printer columns, in that order
    (at,) = [i for i, line in enumerate(lines) if re.match(r"NAME +MEMBERS", line)]
    assert lines[at].split()[:4] == ["NAME", "MEMBERS", "IMEX-READY", "READY"], lines[at]
    assert lines[at + 1].split()[0] == "gb200", r.stdout
    assert "imexensemble.imex-ensemble.io/gb200 created" in r.stdout
    assert "virtualmachinepool.pool.kubevirt.io/gb200 created" in r.stdout


def _check_removed(r: Ran) -> None:
    assert "imexensembles.imex-ensemble.io" in r.stdout + r.stderr  # step 3 said so
    assert 'namespace "imex-system" deleted' in r.stdout


def _check_cloudinit(r: Ran) -> None:
    said = re.search(r"user-data (?:is )?(\d+) bytes", r.stderr)
    assert said, r.stderr  # "the generator prints the size on stderr every time"
    (secret,) = [d for d in yaml.safe_load_all((r.cwd / "secret-userdata.yaml").read_text())
                 if d]
    assert secret["metadata"]["name"] == "gb200-userdata"
    assert len(secret["stringData"]["userdata"].encode()) == int(said[1])


#: what each block with an id states about its output (tests/docs/test_doc_rules.py
#: checks that every id has a check and every check an id)
CHECKS: dict[str, Callable[[Ran], None]] = {
    "readme-render": _check_render,
    "install-4a": _check_token_hash,
    "install-4b": _check_userdata_secret,
    "install-5": _check_create,
    "install-remove": _check_removed,
    "cloudinit-first": _check_cloudinit,
}


@pytest.fixture(scope="module")
def reader(control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory
           ) -> tuple[Path, dict[str, str]]:
    """(a copy of the tree, a reader's environment) on a cluster serving what the docs'
    manifests name besides the project's own kinds."""
    control_plane.apply_crd(pool_crd(json.loads(kubevirt_openapi().read_text())))
    control_plane.apply_crd(network_attachment_definition_crd())
    base = tmp_path_factory.mktemp("reader")
    root = base / "imex-ensemble"
    shutil.copytree(REPO, root, ignore=_IGNORE, symlinks=True)
    tools = base / "bin"
    tools.mkdir()
    for name in ("kubectl", "helm"):
        (tools / name).symlink_to(control_plane.bin_dir / name)
    home = base / "home"
    home.mkdir()
    keep = ("LANG", "LC_ALL", "TERM", "TMPDIR", "USER", "LOGNAME")
    env = {k: v for k, v in os.environ.items() if k in keep}
    env.update(HOME=str(home), KUBECONFIG=str(control_plane.admin_kubeconfig),
               PATH=os.pathsep.join([str(tools), str(Path(sys.executable).parent),
                                     "/usr/local/sbin", "/usr/local/bin", "/usr/sbin",
                                     "/usr/bin", "/sbin", "/bin"]))
    return root, env


def paste(block: blocks.Block, text: str, root: Path, state: Path, env: dict[str, str]
          ) -> Ran:
    """Run ``text`` where the last block left the reader, with its variables; save both
    for the next block. A failing command fails the block."""
    cwd = root if block.options.get("cwd") == "root" else Path(state.joinpath("cwd")
                                                                .read_text().strip())
    script = (f"set -a\n. {state / 'env'}\nset +a\ncd {cwd}\nset -e -o pipefail\n"
              f"trap 'pwd > {state / 'cwd'}; declare -px | grep -v \"^declare -[a-z]*x"
              f" \\(PWD\\|OLDPWD\\|SHLVL\\|_\\)=\" > {state / 'env'}' EXIT\n{text}\n")
    proc = subprocess.run(["bash", "--noprofile", "--norc", "-c", script], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=block.timeout, check=False)
    assert proc.returncode == 0, (
        f"{block.where} exited {proc.returncode}:\n{text}\n--- stdout\n{proc.stdout[-3000:]}"
        f"\n--- stderr\n{proc.stderr[-3000:]}")
    return Ran(block, proc.stdout, proc.stderr, Path(state.joinpath("cwd").read_text().strip()),
               root)


@pytest.mark.parametrize("doc", blocks.DOCS)
def test_doc_runs(doc: str, reader: tuple[Path, dict[str, str]], tmp_path: Path) -> None:
    root, env = reader
    state = tmp_path / _STATE
    state.mkdir()
    (state / "cwd").write_text(f"{root}\n")
    (state / "env").write_text("")
    planned = [b for b in blocks.plan() if b.doc == doc]
    ran = []
    for block in planned:
        t0 = time.monotonic()
        result = paste(block, block.text if block.run else block.instead, root, state, env)
        print(f"{block.where}: {'ran' if block.run else 'instead'} "
              f"{time.monotonic() - t0:.1f}s")
        if block.id:
            CHECKS[block.id](result)
        ran.append(block.where)
    everything = blocks.shell_blocks(doc)
    # the rule, as run: each shell block of the doc ran, or is marked with its reason
    assert sorted(ran + [b.where for b in everything if b.marked and not b.instead]) == \
        sorted(b.where for b in everything)
