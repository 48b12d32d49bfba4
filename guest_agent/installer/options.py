"""What the operator asks of ``imex-guest-agent cloudinit``: :class:`Options`.

The generator's input, checked as it is built: the install source
(:class:`InstallSource`), the patterns the command line checks its flags against, and
:class:`CloudInitError`, the one error every part of the generator raises (naming the
flag). The command line (:mod:`guest_agent.installer.cli`) builds Options from the
flags; the rest of the installer only reads them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final, Literal
from urllib.parse import urlsplit

from imex_shared.model import DEFAULT_MAX_MEMBERS, DEFAULT_PORT, EnsembleId

DEFAULT_IMEX_CMD_PORT: Final = 50005

InstallKind = Literal["pip-index", "wheel", "find-links", "preinstalled"]
_URL_KINDS: Final[dict[str, InstallKind]] = {
    "pip-index": "pip-index",
    "wheel": "wheel",
    "find-links": "find-links",
}

# RFC 6750 b64token: what an Authorization: Bearer header can carry verbatim.
TOKEN_PATTERN = re.compile(r"^[A-Za-z0-9\-._~+/]+=*$")
# A PEP 508 name with optional extras, then an optional version spec.
REQUIREMENT_PATTERN = re.compile(
    r"^([A-Za-z0-9][A-Za-z0-9._-]*(\[[A-Za-z0-9._,-]*\])?)([<>=!~][ -~]*)?$"
)
K8S_NAME_PATTERN = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")


class CloudInitError(ValueError):
    """Bad generator input; the message names the flag and what is wrong."""


@dataclass(frozen=True, slots=True)
class InstallSource:
    """Where the guest gets the agent: a package index, a wheel, a wheelhouse, or the image."""

    kind: InstallKind
    url: str | None = None

    def __post_init__(self) -> None:
        if (self.kind == "preinstalled") != (self.url is None):
            raise CloudInitError(
                f"install source {self.kind!r}: a URL is needed for every "
                "kind but preinstalled, and only there"
            )

    @classmethod
    def parse(cls, text: str) -> InstallSource:
        if text == "preinstalled":
            return cls("preinstalled")
        name, _, url = text.partition(":")
        kind = _URL_KINDS.get(name)
        if kind is None or not url:
            raise CloudInitError(
                f"--install {text!r}: expected pip-index:URL, wheel:URL, find-links:URL "
                "or preinstalled"
            )
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https", "file") or not (parts.netloc or parts.path):
            raise CloudInitError(f"--install {text!r}: {url!r} is not an http(s) or file URL")
        if not _printable_ascii(url):
            raise CloudInitError(
                f"--install {text!r}: the URL must be printable ASCII without spaces "
                "(percent-encode anything else)"
            )
        return cls(kind, url)


@dataclass(frozen=True, slots=True)
class Options:
    """Everything the generator needs; ``options_from_args`` builds it from the flags."""

    ensemble: str
    namespace: str
    max_members: int = DEFAULT_MAX_MEMBERS
    cluster_domain: str | None = None
    registry_url: str | None = None
    token: str | None = None
    install: InstallSource = InstallSource("preinstalled")
    package: str | None = None
    mode: Literal["names", "ips"] = "names"
    imex_port: int = DEFAULT_PORT
    imex_cmd_port: int = DEFAULT_IMEX_CMD_PORT
    wait_for_quorum: Literal["RECOVERY", "NONE"] = "RECOVERY"
    own_slot: Literal["auto", "published", "local"] = "auto"
    nameservers: tuple[str, ...] = ()
    restart_imex: bool = True
    output_secret: str | None = None
    raw: bool = False
    #: IMEX mutual TLS (issue 19): the config keys, and the CA fingerprint guests pin.
    auth_encryption: bool = False
    ca_sha256: str | None = None
    #: the registry CA's fingerprint an https registry is pinned to (0.2)
    registry_ca_sha256: str | None = None
    #: modprobe.d: NVreg_CreateImexChannel0=1 (channel 0 only, at the next module load)
    imex_channel0_module_param: bool = False
    #: the agent's expected_members (wait --for domain); None: max_members
    expected_members: int | None = None

    @property
    def ens(self) -> EnsembleId:
        return EnsembleId(self.namespace, self.ensemble)


def _printable_ascii(text: str) -> bool:
    return all(0x21 <= ord(c) <= 0x7E for c in text)
