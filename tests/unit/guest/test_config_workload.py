"""The workload keys of the guest config: imex_channels, imex_channel_mode,
imex_channel_group, expected_members, and the deprecated imex_channel_device."""

from __future__ import annotations

import pytest

from guest_agent.config import ConfigError, settings_from_mapping

BASE = {"ensemble": "e", "namespace": "ns"}


def test_defaults_keep_channel_zero_for_everyone() -> None:
    s = settings_from_mapping(BASE)
    assert s.imex_channels == (0,) and s.imex_channel_mode == "0666"
    assert s.channel_mode == 0o666 and s.imex_channel_group is None
    assert s.members_expected == s.max_members == 18 and s.warnings == ()


def test_channels_are_sorted_and_an_empty_list_turns_the_feature_off() -> None:
    assert settings_from_mapping({**BASE, "imex_channels": [5, 0, 2047]}).imex_channels == (
        0, 5, 2047)
    assert settings_from_mapping({**BASE, "imex_channels": []}).imex_channels == ()


@pytest.mark.parametrize(("value", "says"), [
    ([2048], "channel 2048 is out of range 0-2047"),
    ([-1], "out of range"),
    ([1, 1], "channel 1 is listed twice"),
    (["0"], "'0' is not a channel number"),
    ([True], "True is not a channel number"),
    (0, "expected a list of channel numbers"),
])
def test_bad_channel_lists_are_refused_by_name(value: object, says: str) -> None:
    with pytest.raises(ConfigError, match="imex_channels") as err:
        settings_from_mapping({**BASE, "imex_channels": value})
    assert says in str(err.value)


@pytest.mark.parametrize("mode", ["666", "0660", "0600"])
def test_octal_modes(mode: str) -> None:
    assert settings_from_mapping({**BASE, "imex_channel_mode": mode}).channel_mode == int(mode, 8)


@pytest.mark.parametrize("mode", ["4666", "0888", "rw-rw-rw-", "", "06666", 438])
def test_bad_modes_are_refused(mode: object) -> None:
    with pytest.raises(ConfigError, match="imex_channel_mode"):
        settings_from_mapping({**BASE, "imex_channel_mode": mode})


def test_group_names() -> None:
    assert settings_from_mapping({**BASE, "imex_channel_group": "imex"}).imex_channel_group \
        == "imex"
    with pytest.raises(ConfigError, match="imex_channel_group: 'a b' is not a group name"):
        settings_from_mapping({**BASE, "imex_channel_group": "a b"})


def test_the_deprecated_device_key_still_works_and_names_the_new_keys() -> None:
    s = settings_from_mapping({**BASE, "imex_channel_device":
                               "/dev/nvidia-caps-imex-channels/channel3"}, "c.toml")
    assert s.imex_channels == (3,)
    [warning] = s.warnings
    assert warning.startswith("c.toml: imex_channel_device is deprecated: use imex_channels")
    assert "imex_channel_mode and imex_channel_group" in warning
    s = settings_from_mapping({**BASE, "imex_channel_device": "/dev/other"})
    assert s.imex_channels == (0,) and "is ignored" in s.warnings[0]
    s = settings_from_mapping({**BASE, "imex_channels": [1], "imex_channel_device":
                               "/dev/nvidia-caps-imex-channels/channel3"})
    assert s.imex_channels == (1,) and "imex_channels is set too and wins" in s.warnings[0]
    with pytest.raises(ConfigError, match="out of range"):
        settings_from_mapping({**BASE, "imex_channel_device":
                               "/dev/nvidia-caps-imex-channels/channel4096"})


def test_expected_members() -> None:
    s = settings_from_mapping({**BASE, "max_members": 4, "expected_members": 3})
    assert s.members_expected == 3
    with pytest.raises(ConfigError, match="expected_members: 5 is more than max_members = 4"):
        settings_from_mapping({**BASE, "max_members": 4, "expected_members": 5})
