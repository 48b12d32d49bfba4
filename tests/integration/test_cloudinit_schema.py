"""Generated user-data against the real cloud-init: its schema and its write_files module.

Every variant is produced by the installed ``imex-guest-agent cloudinit``
command (a real process), checked by ``cloud-init schema --config-file`` from
Debian's package, then written into a throwaway root by cloud-init's own
``cc_write_files`` module running under the system Python that package
belongs to. The files that land must be byte for byte what the renderers
produce, with the requested modes, and the agent config must load through the
agent's own loader.
"""

from __future__ import annotations

import functools
import os
import shutil
import stat
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from guest_agent.config import load_settings
from guest_agent.installer import cli, guest_files, setup_script
from guest_agent.installer import options as opt
from guest_agent.installer import userdata as ci

CLOUD_INIT = "/usr/bin/cloud-init"
SYSTEM_PYTHON = "/usr/bin/python3"
TOKEN = "s3cr3t-Token_0123456789abcdef0123456789abcdef"

pytestmark = pytest.mark.skipif(
    not Path(CLOUD_INIT).exists(),
    reason="Debian's cloud-init is not installed (.ci/run installs it: apt-get install cloud-init)",
)

# Runs under the system Python with cloud-init's own modules: load the YAML the
# way cloud-init does, point every path into ROOT, and call the module.
WRITE_FILES = """
import sys
from cloudinit import util
from cloudinit.config import cc_write_files
root, src = sys.argv[1], sys.argv[2]
cfg = util.load_yaml(open(src, encoding="utf-8").read())
files = cfg.get("write_files") or []
for f in files:
    f["path"] = root + f["path"]
cc_write_files.write_files("write_files", files, "root:root")
"""


@dataclass(frozen=True)
class Variant:
    id: str
    argv: tuple[str, ...]
    secret: bool


BASE = ("--ensemble", "gb200", "--namespace", "gpu-jobs")
REG = ("--registry-url", "http://imex-host-agent.imex-system.svc.cluster.local:8080")
VARIANTS = [
    Variant("preinstalled-minimal", (*BASE, "--raw"), False),  # 2816 bytes: --raw keeps it plain
    Variant("preinstalled-token", (*BASE, *REG, "--token", TOKEN), True),
    Variant(
        "find-links",
        (*BASE, *REG, "--token", TOKEN, "--install", "find-links:http://wheels.internal/imex/"),
        True,
    ),
    Variant(
        "pip-index-ips",
        (
            "--ensemble=train",
            "--namespace=ml",
            "--max-members=4",
            *REG,
            "--token",
            TOKEN,
            "--install=pip-index:https://mirror.internal/simple/",
            "--mode=ips",
            "--own-slot=published",
            "--imex-port=50100",
            "--imex-cmd-port=50105",
            "--wait-for-quorum=NONE",
            "--nameserver=10.96.0.10",
            "--nameserver=[fd00::10]:53",
            "--cluster-domain=corp.local",
        ),
        True,
    ),
    Variant(
        "wheel-raw",
        (
            *BASE,
            "--install=wheel:https://files.internal/imex_ensemble-0.1.0-py3-none-any.whl",
            "--raw",
            "--no-restart-imex",
        ),
        False,
    ),
    Variant("one-member-forced-secret", (*BASE, "--max-members=1", "--output-secret=ud"), True),
]


@functools.cache
def generate(variant: Variant) -> tuple[str, str]:
    """(stdout, stderr) of the real command (once per variant and session)."""
    proc = subprocess.run(
        [sys.executable, "-m", "guest_agent.cli", "cloudinit", *variant.argv],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout, proc.stderr


def options(variant: Variant) -> opt.Options:
    return cli.options_from_args(cli.build_parser().parse_args(list(variant.argv)))


def user_data_of(stdout: str, secret: bool) -> str:
    if not secret:
        return stdout
    doc = yaml.safe_load(stdout)
    assert doc["kind"] == "Secret"
    return str(doc["stringData"]["userdata"])


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.id)
def test_variant_passes_cloud_init_schema(variant: Variant, tmp_path: Path) -> None:
    stdout, stderr = generate(variant)
    user_data = user_data_of(stdout, variant.secret)
    assert user_data.startswith("#cloud-config\n")
    # The size rule: inline only when it fits; a Secret is announced on stderr.
    fits = len(user_data.encode()) <= ci.INLINE_USERDATA_LIMIT
    if not variant.secret and "--raw" not in variant.argv:
        assert fits
    if variant.secret:
        assert "Secret" in stderr
    path = tmp_path / "user-data"
    path.write_text(user_data, encoding="utf-8")
    proc = subprocess.run(
        [CLOUD_INIT, "schema", "--config-file", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Valid cloud-config" in proc.stdout


def test_schema_check_is_not_a_rubber_stamp(tmp_path: Path) -> None:
    stdout, _ = generate(VARIANTS[0])
    path = tmp_path / "user-data"
    path.write_text(stdout.replace("manage_etc_hosts: false", "manage_etc_hosts: 7"))
    proc = subprocess.run(
        [CLOUD_INIT, "schema", "--config-file", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode != 0
    assert "manage_etc_hosts" in proc.stdout + proc.stderr


def mode_of(path: Path) -> str:
    return f"{stat.S_IMODE(path.stat().st_mode):04o}"


@pytest.mark.skipif(os.geteuid() != 0, reason="cc_write_files chowns to root:root")
@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.id)
def test_cloud_init_writes_the_expected_files(variant: Variant, tmp_path: Path) -> None:
    if not Path(SYSTEM_PYTHON).exists():
        pytest.skip(f"{SYSTEM_PYTHON} (the Python Debian's cloud-init belongs to) is missing")
    stdout, _ = generate(variant)
    src = tmp_path / "user-data"
    src.write_text(user_data_of(stdout, variant.secret), encoding="utf-8")
    root = tmp_path / "root"
    root.mkdir()
    subprocess.run(
        [SYSTEM_PYTHON, "-c", WRITE_FILES, str(root), str(src)],
        check=True,
        timeout=60,
        capture_output=True,
    )
    opts = options(variant)
    unit = None if opts.install.kind == "preinstalled" else cli.load_unit()
    expected = {f.path: (f.content, f.permissions) for f in guest_files.render_files(opts, unit)}
    written = {
        "/" + str(p.relative_to(root)): (p.read_bytes(), mode_of(p))
        for p in root.rglob("*")
        if p.is_file()
    }
    assert written == expected
    settings = load_settings(root / "etc/imex-guest-agent/config.toml")
    assert (settings.namespace, settings.ensemble) == (opts.namespace, opts.ensemble)
    if opts.token is not None:
        assert (root / "etc/imex-guest-agent/token").read_text() == opts.token
        assert settings.token_file == "/etc/imex-guest-agent/token"
    shutil.rmtree(root)


SEMAPHORES = """
import sys, yaml
from cloudinit import helpers, settings
cfg = yaml.safe_load(open("/etc/cloud/cloud.cfg"))
stage = {m if isinstance(m, str) else m[0]: s
         for s in ("cloud_init_modules", "cloud_config_modules", "cloud_final_modules")
         for m in cfg[s]}
order = [m if isinstance(m, str) else m[0] for m in cfg["cloud_init_modules"]]
sems = helpers.FileSemaphores(sys.argv[1])
for name in sys.argv[2:]:
    # modules.py runs each module as "config-<name>" under a per-instance semaphore
    key = helpers.canon_sem_name("config-" + name)
    mod = name.replace("_", "-")
    print(sems._get_path(key, settings.PER_INSTANCE), stage.get(mod) or stage.get(name))
print("bootcmd-first", order.index("bootcmd") < order.index("write-files"))
"""


@pytest.mark.skipif(not Path("/etc/cloud/cloud.cfg").exists(),
                    reason="no /etc/cloud/cloud.cfg: cloud-init's module list is not here")
def test_bootcmd_names_the_semaphores_real_cloud_init_uses() -> None:
    """The bootcmd removes cloud-init's own semaphore files, by path: check them against
    the installed cloud-init (22.4, as in the Debian 12 guests), and that bootcmd runs
    before write_files in the same stage, so a re-armed write_files runs in that boot."""
    proc = subprocess.run(
        [SYSTEM_PYTHON, "-c", SEMAPHORES, setup_script.CLOUD_INIT_SEM_DIR,
         *setup_script.SETUP_MODULES],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    got = proc.stdout.splitlines()
    assert got == [
        f"{setup_script.CLOUD_INIT_SEM_DIR}/config_write_files cloud_init_modules",
        f"{setup_script.CLOUD_INIT_SEM_DIR}/config_runcmd cloud_config_modules",
        f"{setup_script.CLOUD_INIT_SEM_DIR}/config_scripts_user cloud_final_modules",
        "bootcmd-first True",
    ]
    bootcmd = setup_script.render_bootcmd(opt.Options(ensemble="gb200", namespace="gpu-jobs"), None)
    bootcmd = bootcmd.replace("$imex_sem", setup_script.CLOUD_INIT_SEM_DIR)
    for line in got[:3]:
        assert line.split()[0] in bootcmd


EXAMPLES = Path(__file__).resolve().parents[2] / "cloudinit" / "examples"


def test_committed_examples_are_current(tmp_path: Path) -> None:
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    subprocess.run(
        [str(EXAMPLES / "regenerate.sh"), str(tmp_path)],
        check=True,
        env=env,
        capture_output=True,
        timeout=60,
    )
    fresh = {p.name: p.read_text() for p in tmp_path.iterdir()}
    committed = {p.name: p.read_text() for p in EXAMPLES.glob("*.yaml")}
    assert fresh.keys() == committed.keys()
    for name, text in committed.items():
        assert text == fresh[name], f"regenerate with {EXAMPLES / 'regenerate.sh'}"


@pytest.mark.parametrize("name", sorted(p.name for p in EXAMPLES.glob("*.yaml")))
def test_committed_example_passes_schema(name: str, tmp_path: Path) -> None:
    text = (EXAMPLES / name).read_text()
    secret = name.endswith(".secret.yaml")
    user_data = user_data_of(text, secret)
    assert secret == (len(user_data.encode()) > ci.INLINE_USERDATA_LIMIT)
    path = tmp_path / "user-data"
    path.write_text(user_data)
    proc = subprocess.run(
        [CLOUD_INIT, "schema", "--config-file", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
