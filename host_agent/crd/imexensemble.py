"""The ImexEnsemble custom resource: its one source of truth (issue 15).

Everything about the CRD is written here once, as data: fields, types,
bounds, defaults, CEL rules, list-map keys, printer columns. From it
``tools/crd_generate.py`` writes the CRD manifest
(``manifests/crds/crd-imexensembles.yaml``), the field table
(``docs/imexensemble.md``) and the spec facts the guest agent applies itself
(``imex_shared/ensemble_crd.py``, which may not import host_agent); a test
fails when any of them differs from what this module generates. The host
agent imports the constants below directly.

The numbers come from ``imex_shared/model.py`` (``MAX_MEMBERS_LIMIT``,
``DEFAULT_MAX_MEMBERS``, ``DEFAULT_PORT``, ``MODES``), the one place every
path (CR, Service annotation, guest config) takes them from.

CEL (``x-kubernetes-validations``) is used only where a schema cannot say
it: immutability (transition rules ``self == oldSelf``), authEncryption
refused with mode ``ips``, and the label selector's operator/values pairing.
Every string and list a rule can reach is bounded (maxLength, maxItems,
maxProperties) so the apiserver's CEL cost estimator accepts the CRD.
"""

from __future__ import annotations

from typing import Final

from host_agent.crd.schema import CustomResource, Field, PrinterColumn, Rule
from imex_shared.model import (
    DEFAULT_MAX_MEMBERS,
    DEFAULT_MODE,
    DEFAULT_PORT,
    MAX_MEMBERS_LIMIT,
    MODES,
    SHA256_HEX_PATTERN,
)

GROUP: Final = "imex-ensemble.io"
VERSION: Final = "v1alpha1"
API_VERSION: Final = f"{GROUP}/{VERSION}"
KIND: Final = "ImexEnsemble"
PLURAL: Final = "imexensembles"
SINGULAR: Final = "imexensemble"
SHORT_NAME: Final = "imexens"

#: Condition types the host agent writes (metav1.Condition, list-map keyed by type).
CONDITION_READY: Final = "Ready"
CONDITION_DEGRADED: Final = "Degraded"
CONDITION_PUBLISHED: Final = "Published"
CONDITION_DOMAIN_UP: Final = "DomainUp"
#: the guests' preflight checks: False when any member's check FAILs (issue 28)
CONDITION_GUEST_CHECKS: Final = "GuestChecks"
#: members of this and another ensemble report one NVLink clique (informational)
CONDITION_CLIQUE_SHARED: Final = "CliqueShared"
#: ``status.domainStatus``: ``nvidia-imex-ctl -N -j``'s domain status, or UNKNOWN.
DOMAIN_STATUSES: Final = ("UP", "DEGRADED", "DOWN", "UNKNOWN")

#: Bounds of what the agent writes into status; a longer value makes the status
#: write fail with 422, so the writer clips to these.
MAX_CONDITIONS: Final = 16
MAX_PROBLEMS: Final = 64
MAX_PROBLEM_LENGTH: Final = 1024
MAX_CONDITION_MESSAGE: Final = 32768
MAX_SELECTOR_TERMS: Final = 32

SHA256_HEX: Final = SHA256_HEX_PATTERN
DOMAIN_ID_HEX: Final = "^[0-9a-f]{8}$"
#: KubeVirt network names (spec.networks[].name), as the Service annotation accepts them.
NETWORK_NAME: Final = "^[A-Za-z0-9]([-A-Za-z0-9_.]{0,251}[A-Za-z0-9])?$"
#: A label key: optional DNS-subdomain prefix and "/", then a name of at most 63
#: characters (apimachinery's IsQualifiedName, each DNS label at most 63).
LABEL_KEY: Final = (r"^([a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?"
                    r"(\.[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?)*/)?"
                    r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
LABEL_VALUE: Final = r"^(([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9])?$"
SELECTOR_OPERATORS: Final = ("In", "NotIn", "Exists", "DoesNotExist")
#: ``spec.registryTLS``: whether the token may cross the network in clear
REGISTRY_TLS_MODES: Final = ("Optional", "Required")

_CONDITION_TYPE = (r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                   r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])$")
_CONDITION_REASON = "^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$"

_SELECTOR = Field(
    "memberSelector", "object",
    "Narrows the members further (metav1.LabelSelector). Always ANDed with the label "
    "imex-ensemble.io/ensemble=<name>, so a VMI is never in two ensembles.",
    map_type="atomic",
    fields=(
        Field("matchLabels", "map", "Labels a member VMI must carry, key to value.",
              max_properties=MAX_SELECTOR_TERMS,
              values=Field("value", "string", "A label value.", max_length=63,
                           pattern=LABEL_VALUE),
              rules=(Rule("self.all(k, k.matches('" + LABEL_KEY.replace("\\", "\\\\") + "'))",
                          "memberSelector.matchLabels: every key must be a valid label key "
                          "(an optional DNS prefix and '/', then at most 63 characters of "
                          "[A-Za-z0-9-_.])"),)),
        Field("matchExpressions", "array", "Label requirements a member VMI must meet.",
              max_items=MAX_SELECTOR_TERMS, list_type="atomic",
              items=Field(
                  "requirement", "object", "One label requirement.",
                  fields=(
                      Field("key", "string", "The label key.", required=True,
                            max_length=317, pattern=LABEL_KEY),
                      Field("operator", "string", "How the key's value is compared.",
                            required=True, enum=SELECTOR_OPERATORS),
                      Field("values", "array", "Values for In and NotIn; empty otherwise.",
                            max_items=MAX_SELECTOR_TERMS, list_type="atomic",
                            items=Field("value", "string", "A label value.", max_length=63,
                                        pattern=LABEL_VALUE)),
                  ),
                  rules=(Rule("self.operator in ['In', 'NotIn'] ? "
                              "(has(self.values) && size(self.values) > 0) : "
                              "(!has(self.values) || size(self.values) == 0)",
                              "memberSelector.matchExpressions: values must be non-empty for "
                              "operator In and NotIn, and empty for Exists and DoesNotExist",
                              field_path=".values"),))),
    ),
)

SPEC: Final = Field(
    "spec", "object", "What the ensemble is: written by the user.",
    default={},
    rules=(Rule("!(has(self.authEncryption) && self.authEncryption && "
                "has(self.mode) && self.mode == 'ips')",
                "authEncryption needs mode names: IMEX checks peer certificates against "
                "host names, which mode ips does not write",
                field_path=".authEncryption"),),
    fields=(
        Field("maxMembers", "integer",
              "Slots in the ensemble: every guest's nodes_config.cfg has exactly this many "
              "lines. One IMEX domain on an NVL72 rack holds at most 18 nodes.",
              fmt="int32", default=DEFAULT_MAX_MEMBERS, minimum=1, maximum=MAX_MEMBERS_LIMIT,
              immutable=True,
              immutable_why="it fixes every guest's nodes file; create a new ImexEnsemble "
                            "to change the size"),
        Field("port", "integer", "IMEX's SERVER_PORT, published as the slice's imex port.",
              fmt="int32", default=DEFAULT_PORT, minimum=1, maximum=65535),
        Field("network", "string",
              "The VMI network (spec.networks[].name) whose IP is published; default the "
              "pod network, else the VMI's first interface.",
              max_length=253, pattern=NETWORK_NAME),
        Field("mode", "string",
              "nodes_config.cfg holds slot names (names, IMEX 570.158.01+) or the members' "
              "IPs (ips, restarting IMEX on every change).",
              default=DEFAULT_MODE, enum=MODES),
        Field("tokenSHA256", "string",
              "Lowercase hex sha256 of the token guests present when they report status; "
              "the token itself reaches guests through the cloud-init Secret.",
              max_length=64, pattern=SHA256_HEX),
        _SELECTOR,
        Field("authEncryption", "boolean",
              "IMEX authentication and encryption (IMEX_ENABLE_AUTH_ENCRYPTION) with a "
              "per-ensemble CA. Needs mode names.",
              default=False, immutable=True,
              immutable_why="every member must agree on it, so it is chosen at creation"),
        Field("caRotation", "string",
              "Any change starts a rotation of the ensemble's CA (a date or a counter "
              "serves well).",
              max_length=63),
        Field("registryTLS", "string",
              "Required: the registry refuses this ensemble's token over plain HTTP (status "
              "reports, certificate requests, long-polls with a token); its guests must use "
              "the registry's https:// URL and pin registryCASHA256. Optional (or absent): "
              "both.",
              enum=REGISTRY_TLS_MODES),
    ),
)

_MEMBER = Field(
    "member", "object", "One published slot, as the agent last saw it.",
    fields=(
        Field("index", "integer", "The slot index.", fmt="int32", required=True, minimum=0,
              maximum=MAX_MEMBERS_LIMIT - 1),
        Field("slot", "string", "The slot name, imex-<domainID>-<index>.", max_length=63),
        Field("vmi", "string", "The VMI holding the slot.", max_length=253),
        Field("node", "string", "The node the VMI runs on.", max_length=253),
        Field("ip", "string", "The published address.", max_length=45),
        Field("phase", "string", "The VMI's phase.", max_length=32),
        Field("ready", "boolean", "The VMI's Ready condition."),
        Field("imexState", "string",
              "The guest's last reported IMEX state (nvidia-imex-ctl -q), empty before its "
              "first report, GuestSilent past --report-stale-after.", max_length=64),
        Field("generationApplied", "integer",
              "The membership generation the guest last applied.", fmt="int64", minimum=0),
        Field("clique", "string", "The member's NVLink clique (<clusterUUID>.<cliqueID>).",
              max_length=128),
        Field("since", "string",
              "When the slot got its current IP (the leader's clock, milliseconds): persisted "
              "with membershipGeneration, so every replica serves the same; it moves only "
              "with ip.", fmt="date-time", max_length=32),
    ),
)

_CONDITION = Field(
    "condition", "object", "A metav1.Condition.",
    fields=(
        Field("type", "string", "Ready, Degraded, Published or DomainUp.", required=True,
              max_length=316, pattern=_CONDITION_TYPE),
        Field("status", "string", "True, False or Unknown.", required=True,
              enum=("True", "False", "Unknown")),
        Field("observedGeneration", "integer", "metadata.generation the condition is about.",
              fmt="int64", minimum=0),
        Field("lastTransitionTime", "string", "When the status last changed.",
              required=True, fmt="date-time"),
        Field("reason", "string", "CamelCase reason, e.g. DuplicateIndex or GuestSilent.",
              required=True, min_length=1, max_length=1024, pattern=_CONDITION_REASON),
        Field("message", "string", "Human-readable details.", required=True,
              max_length=MAX_CONDITION_MESSAGE),
    ),
)

STATUS: Final = Field(
    "status", "object", "What the host agent observes: written through /status only.",
    fields=(
        Field("observedGeneration", "integer", "The metadata.generation this status is about.",
              fmt="int64", minimum=0),
        Field("membershipGeneration", "integer",
              "The registry's generation: grows on every change of what a guest writes. With "
              "members[].ip and since, caBundleSHA256 and cliquesSplit it is the membership "
              "every replica of the host agent serves.",
              fmt="int64", minimum=0),
        Field("publishedSummary", "string", "Published members / maxMembers, e.g. 3/18.",
              max_length=16),
        Field("domainID", "string", "First 8 hex digits of sha256(<namespace>/<name>).",
              max_length=8, pattern=DOMAIN_ID_HEX),
        Field("membersPublished", "integer", "Members in the EndpointSlice.", fmt="int32",
              minimum=0, maximum=MAX_MEMBERS_LIMIT),
        Field("imexReady", "integer", "Members whose guest reports IMEX READY.", fmt="int32",
              minimum=0, maximum=MAX_MEMBERS_LIMIT),
        Field("domainStatus", "string", "The IMEX domain's status (nvidia-imex-ctl -N).",
              enum=DOMAIN_STATUSES),
        Field("caSHA256", "string", "sha256 of the ensemble CA certificate guests trust.",
              max_length=64, pattern=SHA256_HEX),
        Field("registryCASHA256", "string",
              "sha256 of the registry's TLS CA certificate: what guests pin as "
              "registry_ca_sha256 (the generator's --registry-ca-sha256 or --from-ensemble). "
              "Absent while the registry serves no HTTPS.",
              max_length=64, pattern=SHA256_HEX),
        Field("caBundleSHA256", "string",
              "sha256 of the CA bundle guests trust (authEncryption): part of what "
              "membershipGeneration describes.", max_length=64, pattern=SHA256_HEX),
        Field("cliquesSplit", "boolean",
              "The members span two or more NVLink cliques, so each guest pins only its own "
              "clique's peers (members[].clique): part of what membershipGeneration "
              "describes."),
        Field("members", "array",
              "Every published slot. Transitions only: nothing here moves with time alone.",
              max_items=MAX_MEMBERS_LIMIT, list_type="map", list_map_keys=("index",),
              items=_MEMBER),
        Field("conditions", "array", "Ready, Degraded, Published, DomainUp, GuestChecks "
              "(the guests' preflight checks), CliqueShared (informational: another "
              "ensemble's members report one of this ensemble's NVLink cliques).",
              max_items=MAX_CONDITIONS, list_type="map", list_map_keys=("type",),
              items=_CONDITION),
        Field("problems", "array", "The registry's problems for this ensemble.",
              max_items=MAX_PROBLEMS, list_type="atomic",
              items=Field("problem", "string", "One problem.", max_length=MAX_PROBLEM_LENGTH)),
    ),
)

COLUMNS: Final = (
    PrinterColumn("MEMBERS", "string", ".status.publishedSummary",
                  "Published members / maxMembers."),
    PrinterColumn("IMEX-READY", "integer", ".status.imexReady",
                  "Members whose guest reports IMEX READY."),
    PrinterColumn("READY", "string", '.status.conditions[?(@.type=="Ready")].status',
                  "The Ready condition."),
    PrinterColumn("DOMAIN", "string", ".status.domainStatus", "The IMEX domain's status."),
    PrinterColumn("AGE", "date", ".metadata.creationTimestamp", "Time since creation."),
    PrinterColumn("MODE", "string", ".spec.mode", "nodes_config.cfg mode.", priority=1),
    PrinterColumn("DOMAIN-ID", "string", ".status.domainID", "The domain id in slot names.",
                  priority=1),
)

VERSIONING: Final = """\
`v1alpha1` is the only version served and stored in 0.2.0, and it stays so for every
0.2.x. A later `v1beta1` will be added beside it, not instead of it:

1. **One release serves both.** The CRD lists `v1beta1` (served, and from then on the
   storage version) and `v1alpha1` (still served, `deprecated: true` with a warning
   naming `v1beta1`). Conversion strategy `None`: `v1beta1` keeps every field of
   `v1alpha1` under the same name, type and meaning, so the API server converts by
   changing `apiVersion` alone and no conversion webhook (another thing to run and
   secure) is needed. A field whose shape would have to change is not changed in
   place: the new shape gets a new name, the old one stays until `v1alpha1` goes.
2. **Upgrade order.** The CRD is applied first (it serves both), then the host agent
   (which reads and writes `v1beta1` from then on); a host agent one release older keeps
   working through `v1alpha1`, as docs/install.md "Upgrades" allows.
3. **`v1alpha1` goes** no earlier than one minor release later, after every stored
   object has been rewritten in `v1beta1` (a no-op update of each ImexEnsemble, or the
   storage version migrator) and `v1alpha1` is gone from the CRD's
   `status.storedVersions`.

Fixed from now on (they will be in `v1beta1` as they are): `spec.maxMembers`, `port`,
`network`, `mode`, `tokenSHA256`, `memberSelector`, `authEncryption`, `caRotation`;
`status.observedGeneration`, `membershipGeneration`, `domainID`, `caSHA256`,
`caBundleSHA256`, `registryCASHA256`, `members[]` (its keys and fields) and the
condition types `Ready`, `Degraded`, `Published`, `DomainUp`.

May still change before `v1beta1`: `spec.registryTLS` (new in 0.2; more values may
come), the words of `status.domainStatus`, `members[].imexState` and the condition
reasons (more may come; software must treat unknown ones as unknown), `status.problems`
(text for people, never parsed), `publishedSummary` and the printer columns. Fields may
be added to `v1alpha1` in any minor release; none is renamed or removed without a new
version.
"""

IMEX_ENSEMBLE: Final = CustomResource(
    group=GROUP, version=VERSION, kind=KIND, plural=PLURAL, singular=SINGULAR,
    short_names=(SHORT_NAME,), categories=(),
    doc="An IMEX ensemble of KubeVirt VMs: one headless Service and EndpointSlice, the "
        "registry's membership, and each member's IMEX state.",
    spec=SPEC, status=STATUS, columns=COLUMNS, versioning=VERSIONING,
)
