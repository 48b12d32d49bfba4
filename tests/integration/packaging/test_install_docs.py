"""docs/install.md step 4, pasted: each ``sh`` block as it stands, in order, in one shell.

A fresh virtualenv (its ``bin`` first on PATH, as an activated one is) and a copy of the
repository: the first block's ``pip install '.[cloudinit]'`` (from the package index
configured for pip on this machine) must bring everything the YAML path needs, 4a must
put the new token's hash into the copy's ImexEnsemble, and 4b must write the Secret that
``kubectl kustomize`` then includes. The order the issue found broken (generating before
the hash is in) must fail loudly and leave the old file as it was.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.integration.packaging.test_build import copy_tree

REPO = Path(__file__).resolve().parents[3]
INSTALL_MD = REPO / "docs" / "install.md"


def step_blocks(doc: str, heading: str, until: str) -> list[str]:
    """The ``sh`` blocks between two headings, in order."""
    section = doc[doc.index(heading):doc.index(until)]
    return re.findall(r"```sh\n(.*?)```", section, re.S)


def test_step_4_has_the_blocks_the_test_pastes() -> None:
    doc = INSTALL_MD.read_text()
    blocks = step_blocks(doc, "## 4.", "## 5.")
    assert len(blocks) == 3
    assert "pip install '.[cloudinit]'" in blocks[0]
    assert "tokenSHA256" in blocks[1] and "generate-userdata.sh" not in blocks[1]
    assert "./generate-userdata.sh" in blocks[2]
    section = doc[doc.index("## 4."):doc.index("## 5.")]
    assert "### 4a. Put your token's hash in the ImexEnsemble" in section
    assert "### 4b. Generate the user-data" in section
    # no block redirects the generator into the file it replaces
    for block in blocks:
        assert not re.search(r"generate-userdata\.sh[^\n]*>", block), block
        assert not re.search(r"cloudinit[^\n]*>", block), block


@pytest.fixture(scope="module")
def workstation(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """(a copy of the repository, the environment of a shell with a fresh venv active)."""
    root = tmp_path_factory.mktemp("workstation")
    repo = root / "repo"
    repo.mkdir()
    copy_tree(repo)
    shutil.copytree(REPO / "manifests", repo / "manifests")
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    env = {k: v for k, v in os.environ.items()
           if k not in ("VIRTUAL_ENV", "PYTHONPATH", "TOKEN_FILE", "ENSEMBLE", "OUTPUT")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env['PATH']}"
    env["VIRTUAL_ENV"] = str(venv)
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return repo, env


def paste(block: str, cwd: Path, env: dict[str, str]) -> tuple[subprocess.CompletedProcess[str],
                                                                Path]:
    """Run one block as an interactive shell would (each line; a failing line stops the
    test here, not the shell) and return the result and the directory it ends in."""
    marker = "__imex_pwd__="
    proc = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", f"{block}\necho {marker}$PWD"],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=900,
                          check=False)
    where = cwd
    for line in proc.stdout.splitlines():
        if line.startswith(marker):
            where = Path(line.removeprefix(marker))
    return proc, where


def test_step_4_pasted_into_a_fresh_workstation(workstation: tuple[Path, dict[str, str]],
                                                machine_kubectl: str) -> None:
    repo, env = workstation
    env = dict(env, PATH=f"{env['PATH']}{os.pathsep}{Path(machine_kubectl).parent}")
    install, hash_in, generate = step_blocks(INSTALL_MD.read_text(), "## 4.", "## 5.")

    proc, rack = paste(install, repo, env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert rack == repo / "my-rack"
    shipped = (rack / "secret-userdata.yaml").read_text()

    # the order the issue found broken: generating before the hash is in fails, loudly,
    # and the old file (the example's Secret) is still there for kustomize
    (rack / "gb200.token").write_text("ab" * 32 + "\n")
    early, _ = paste("TOKEN_FILE=gb200.token ./generate-userdata.sh", rack, env)
    assert early.returncode == 2
    assert "tokenSHA256" in early.stderr and "secret-userdata.yaml is unchanged" in early.stderr
    assert (rack / "secret-userdata.yaml").read_text() == shipped
    assert not [p.name for p in rack.iterdir() if p.name.endswith(".imex-tmp")]

    proc, where = paste(hash_in, rack, env)
    assert proc.returncode == 0, proc.stderr
    assert where == rack
    token = (rack / "gb200.token").read_text().strip()
    assert re.fullmatch(r"[0-9a-f]{64}", token)
    want = hashlib.sha256(token.encode()).hexdigest()
    (cr,) = [d for d in yaml.safe_load_all((rack / "imexensemble.yaml").read_text()) if d]
    assert cr["spec"]["tokenSHA256"] == want
    assert f"tokenSHA256: {want}" in proc.stdout
    shipped_names = {p.name for p in (REPO / "manifests/examples/gb200-ensemble").iterdir()}
    assert {p.name for p in rack.iterdir()} == shipped_names | {"gb200.token"}  # no .orig

    proc, _ = paste(generate, rack, env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0] == "1"  # the Secret is in the kustomization's output
    secret_file = rack / "secret-userdata.yaml"
    assert stat.S_IMODE(secret_file.stat().st_mode) == 0o600
    (secret,) = [d for d in yaml.safe_load_all(secret_file.read_text()) if d]
    assert secret["metadata"]["name"] == "gb200-userdata"
    assert f'content: "{token}"' in secret["stringData"]["userdata"]
