"""docs/cli.md and docs/guest-agent.md's config keys are what the code says.

Both are generated (tools/cli_reference.py) from the argparse definitions and from
``guest_agent.config.Settings``; a flag or a key added without rerunning the generator
fails here, naming the command to run.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys

from guest_agent import cli as guest_cli
from guest_agent import config
from guest_agent.config import Settings
from host_agent import cli as host_cli
from tools import cli_reference


def test_the_generated_pages_match_the_code() -> None:
    for path, text in cli_reference.wanted().items():
        assert path.read_text() == text, (
            f"{path.relative_to(cli_reference.REPO)} has drifted from the code: run "
            "python -m tools.cli_reference --write and commit the result")


def test_check_mode_says_what_to_run() -> None:
    out = subprocess.run([sys.executable, "-m", "tools.cli_reference", "--check"],
                         capture_output=True, text=True, cwd=cli_reference.REPO, timeout=60,
                         check=False)
    assert out.returncode == 0, out.stderr


def test_every_flag_and_command_is_on_the_page() -> None:
    page = cli_reference.CLI_MD.read_text()
    parsers = [guest_cli.build_parser(), host_cli.build_parser({})]
    for name, _help, sub in cli_reference._subcommands(parsers[0]):
        assert f"### imex-guest-agent {name}" in page
        parsers.append(sub)
    from guest_agent.installer import cli as cloudinit_cli

    parsers.append(cloudinit_cli.build_parser())
    for parser in parsers:
        for action in cli_reference._actions(parser):
            for option in action.option_strings:
                assert f"`{option}`" in page, option


def test_every_config_key_has_a_comment_and_a_row() -> None:
    comments = cli_reference._field_comments()
    page = cli_reference.GUEST_MD.read_text()
    for f in dataclasses.fields(Settings):
        if f.name not in config._CHECKS:  # not a key (source, warnings)
            continue
        assert comments.get(f.name), f"Settings.{f.name} has no #: comment"
        assert f"| `{f.name}` |" in page


def test_a_new_flag_shows_as_drift() -> None:
    """The check really compares: a page missing a row is stale."""
    text = cli_reference.render_cli()
    assert "`--cert-lifetime`" in text and "`--hook-socket`" in text
    assert "`--ca-overlap`" in text
    assert text.replace("`--ca-overlap`", "") != cli_reference.CLI_MD.read_text()
