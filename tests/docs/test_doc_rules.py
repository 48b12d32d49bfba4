"""The rules the executed docs keep, checked without running them (part of make test).

- every shell block of tests/docs/blocks.py's DOCS is run by make docs-test or marked
  with the reason it cannot run here, and every fence has a language (an untagged one
  could hide a command); a doc that breaks the rule fails here, naming the block;
- the figures cloudinit/README.md states about the tree (each variant's user-data size,
  the installer's size) are what the generator and the tree say now;
- every TOML config example loads through the agent's own validator.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from guest_agent.config import settings_from_mapping
from tests.docs import blocks

REPO = blocks.REPO
SCRIPT = Path(sys.executable).with_name("imex-guest-agent")


def test_every_shell_block_is_run_or_marked() -> None:
    assert blocks.problems() == []


def test_the_rule_fails_on_what_it_must(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                        ) -> None:
    doc = tmp_path / "doc.md"
    monkeypatch.setattr(blocks, "REPO", tmp_path)
    monkeypatch.setattr(blocks, "DOCS", ("doc.md",))
    doc.write_text("# a doc\n\n```sh\nrm -rf build\n```\n\n```\nuntagged\n```\n\n"
                   "<!-- not run: a real KubeVirt, which this machine has not -->\n"
                   "```yaml\na: 1\n```\n\n"
                   "<!-- not run: a real KubeVirt, which this machine has not -->\n"
                   "```sh\nkubectl apply -k x\n```\n\n"
                   "<!-- not run: a real KubeVirt, which this machine has not -->\n\n"
                   "```sh\ntrue\n```\n")
    assert blocks.problems() == [
        "doc.md:7: a fence without a language (sh, text, yaml, ...)",
        "doc.md:12: a marker on a yaml block",
    ]
    # unmarked shell blocks run; a marker counts only on the line right above its fence
    assert [(b.line, b.run) for b in blocks.plan()] == [(3, True), (23, True)]
    doc.write_text("<!-- not run: too short -->\n```sh\ntrue\n```\n")
    (err,) = blocks.problems()
    assert err.startswith("doc.md:2: not run needs a reason of 20+ characters")
    doc.write_text("<!-- run: cwd=/tmp -->\n```sh\ntrue\n```\n")
    assert blocks.problems() == ["doc.md:2: cwd= takes only root, not '/tmp'"]
    # a typo in a marker must not turn a block that cannot run into one that runs
    doc.write_text("<!-- not-run: a real KubeVirt, which this machine has not -->\n"
                   "```sh\ntrue\n```\n")
    (err,) = blocks.problems()
    assert err.startswith("doc.md:2: '<!-- not-run: a real KubeVirt")
    # neither run nor marked: what the runner would leave out fails the rule
    monkeypatch.setattr(blocks, "plan", lambda: [])
    doc.write_text("```sh\ntrue\n```\n")
    assert blocks.problems() == [
        "doc.md:1: a shell block neither run nor marked <!-- not run: REASON -->"]


def test_markers_parse_their_options() -> None:
    (b,) = [b for b in blocks.shell_blocks("docs/install.md") if b.id == "install-remove"]
    assert b.run and b.options["cwd"] == "root" and b.timeout == 300
    skipped = [b for d in blocks.DOCS for b in blocks.shell_blocks(d) if b.marked]
    assert all(len(b.reason) >= blocks.MIN_REASON and not b.run for b in skipped)
    assert any(b.instead == "kubectl apply -k manifests/base" for b in skipped)


def _size_rows() -> list[tuple[str, int, str]]:
    text = (REPO / "cloudinit" / "README.md").read_text()
    section = text[text.index("## Inline user-data or a Secret"):
                   text.index("## A wheelhouse for find-links")]
    rows = re.findall(r"^\| `([^`]+)`[^|]*\| (\d+) \| (\w+) \|$", section, re.M)
    return [(flags, int(size), output) for flags, size, output in rows]


def test_user_data_sizes_are_what_the_generator_prints() -> None:
    rows = _size_rows()
    assert len(rows) == 5
    subs = {"$R": "http://imex-host-agent.imex-system.svc.cluster.local:8080",
            "$T": "0123456789abcdef" * 4}
    for flags, size, output in rows:
        argv = flags.split()
        argv = [subs.get(a, a) for a in argv]
        name = ["--ensemble", "train", "--namespace", "ml"] if "--max-members 8" in flags \
            else ["--ensemble", "gb200", "--namespace", "gpu-jobs"]
        proc = subprocess.run([str(SCRIPT), "cloudinit", *name, *argv], capture_output=True,
                              text=True, timeout=60, check=False)
        assert proc.returncode == 0, proc.stderr
        said = re.search(r"user-data is (\d+) bytes", proc.stderr)
        assert said, proc.stderr
        assert int(said[1]) == size, f"{flags}: the generator prints {said[1]}, the doc {size}"
        assert ("Secret" in proc.stderr) == (output == "Secret"), (flags, proc.stderr)


def test_the_installer_size_the_readme_states() -> None:
    text = (REPO / "cloudinit" / "README.md").read_text()
    stated = re.search(r"\(([\d,]+) bytes, `guest_agent/installer/bootstrap\.py`", text)
    assert stated, "cloudinit/README.md no longer states the installer's size"
    real = (REPO / "guest_agent" / "installer" / "bootstrap.py").stat().st_size
    assert int(stated[1].replace(",", "")) == real


@pytest.mark.parametrize("doc", ["README.md", "docs/guest-agent.md", "docs/design.md"])
def test_toml_config_examples_load(doc: str) -> None:
    for b in blocks.blocks(doc):
        if b.lang == "toml" and re.search(r"^ensemble\s*=", b.text, re.M):
            settings_from_mapping(tomllib.loads(b.text), b.where)


def test_every_block_id_has_a_check() -> None:
    """An id names a block whose stated output make docs-test checks: no id without its
    check (a typo would check nothing), no check without its block."""
    from tests.docs.test_docs_run import CHECKS

    ids = {b.id for d in blocks.DOCS for b in blocks.shell_blocks(d) if b.id}
    assert ids == set(CHECKS)
