"""Who sends a request, and what RBAC lets them do (TEST STAND-IN, never product code).

Imitates, for the identities a test mints, the apiserver's authentication of bound
ServiceAccount tokens and its RBAC authorizer (kubernetes plugin/pkg/auth/authorizer/rbac,
v1.37): checked against kube-apiserver by tests/realk8s/test_rbac_parity.py.

- **Identities.** The server's own token, and requests without credentials, are the
  superuser they always were (system:masters: everything allowed, as before). A token
  from the TokenRequest API (``POST .../serviceaccounts/NAME/token``) is that
  ServiceAccount: user ``system:serviceaccount:NS:NAME``, groups
  ``system:serviceaccounts``, ``system:serviceaccounts:NS``, ``system:authenticated``;
  it stops working (401) when the ServiceAccount it was minted for is gone.
- **RBAC**, evaluated on every request of such an identity and for every
  SelfSubjectAccessReview: ClusterRoleBindings, then RoleBindings of the request's
  namespace; a rule matches by verb, API group, resource (``*``, ``res/sub``,
  ``*/sub``) and resourceNames; subjects by User, Group or ServiceAccount (a
  RoleBinding's subject without a namespace means the binding's). The first
  allowing rule wins, and its binding is the reason (``RBAC: allowed by
  ClusterRoleBinding "b" of ClusterRole "r" to ServiceAccount "sa/ns"``); a binding
  of a missing role makes a denial's reason ``rbac: RBAC:
  clusterrole.rbac.authorization.k8s.io "r" not found`` (several: ``[a, b]``), else
  a denial has no reason. Aggregated ClusterRoles (``aggregationRule``) take the
  rules of the ClusterRoles their selectors match when evaluated (the real
  aggregation controller writes them into the object, moments later).
- **Built in**, not stored (so lists of ClusterRoles stay as tests wrote them):
  ``system:basic-user`` (every authenticated user may create
  SelfSubjectAccessReviews and SelfSubjectRulesReviews) and discovery: every
  non-resource path (``/api``, ``/apis``, ``/version``, ``/openapi``, health) is open to
  every identity, as system:discovery and system:public-info-viewer make it.
- **Refusals** as ``responsewriters.Forbidden`` words them: ``endpointslices.discovery.k8s.io
  "x" is forbidden: User "system:serviceaccount:ns:sa" cannot patch resource
  "endpointslices" in API group "discovery.k8s.io" in the namespace "ns"``.

Not imitated: nonResourceAttributes in reviews, impersonation, the Node and webhook
authorizers, escalation checks on writing RBAC objects (the superuser writes them).
"""

from __future__ import annotations

import datetime
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from . import resources as rt
from . import selectors
from .errors import ApiError, bad_request, details

JSON = dict[str, Any]
_RBAC = "rbac.authorization.k8s.io"
#: (binding name, role name, subject) of the built-in grants every cluster has
_BASIC_USER = ("system:basic-user", "system:basic-user",
               {"kind": "Group", "apiGroup": _RBAC, "name": "system:authenticated"})
_BASIC_USER_RULES: list[JSON] = [{
    "apiGroups": ["authorization.k8s.io"],
    "resources": ["selfsubjectaccessreviews", "selfsubjectrulesreviews"],
    "verbs": ["create"]}, {
    "apiGroups": ["authentication.k8s.io"], "resources": ["selfsubjectreviews"],
    "verbs": ["create"]}]


@dataclass(frozen=True)
class Identity:
    """Who sent a request; ``superuser`` skips authorization (system:masters)."""

    user: str
    groups: tuple[str, ...]
    superuser: bool = False
    #: the ServiceAccount a bound token speaks for: (namespace, name, uid)
    account: tuple[str, str, str] | None = None


SUPERUSER = Identity("sandbox-admin", ("system:masters", "system:authenticated"), True)


@dataclass(frozen=True)
class Attributes:
    """What a request asks (the apiserver's authorizer.Attributes, resource requests)."""

    verb: str
    group: str
    resource: str
    subresource: str = ""
    namespace: str = ""
    name: str = ""

    def describe(self, user: str) -> str:
        """``forbiddenMessage``'s words."""
        res = f"{self.resource}/{self.subresource}" if self.subresource else self.resource
        where = (f'in the namespace "{self.namespace}"' if self.namespace
                 else "at the cluster scope")
        return (f'User "{user}" cannot {self.verb} resource "{res}" in API group '
                f'"{self.group}" {where}')


@dataclass(frozen=True)
class Decision:
    allowed: bool
    reason: str


def service_account_identity(namespace: str, name: str, uid: str) -> Identity:
    return Identity(f"system:serviceaccount:{namespace}:{name}",
                    ("system:serviceaccounts", f"system:serviceaccounts:{namespace}",
                     "system:authenticated"), account=(namespace, name, uid))


class Tokens:
    """Bearer tokens the TokenRequest API minted, and whom each one is."""

    def __init__(self) -> None:
        self._by_token: dict[str, Identity] = {}

    def mint(self, namespace: str, name: str, uid: str) -> str:
        token = f"sandbox-sa.{secrets.token_urlsafe(24)}"
        self._by_token[token] = service_account_identity(namespace, name, uid)
        return token

    def identity(self, token: str, store: Any) -> Identity | None:
        """The token's ServiceAccount, while that ServiceAccount (same uid) exists."""
        who = self._by_token.get(token)
        if who is None or who.account is None:
            return None
        ns, name, uid = who.account
        entry = store.objects[rt.SERVICEACCOUNT.key].get((ns, name))
        if entry is None or entry.obj["metadata"].get("uid") != uid:
            return None
        return who


# -- matching (rbac/v1 helpers) ----------------------------------------------------


def _has(values: list[str] | None, want: str) -> bool:
    return bool(values) and ("*" in values or want in values)  # type: ignore[operator]


def rule_allows(attrs: Attributes, rule: JSON) -> bool:
    combined = f"{attrs.resource}/{attrs.subresource}" if attrs.subresource else attrs.resource
    resources = rule.get("resources") or []
    resource_ok = any(
        r == "*" or r == combined or (attrs.subresource and r == f"*/{attrs.subresource}")
        for r in resources)
    names = rule.get("resourceNames") or []
    return (_has(rule.get("verbs"), attrs.verb) and _has(rule.get("apiGroups"), attrs.group)
            and resource_ok and (not names or attrs.name in names))


def _subject_applies(who: Identity, subject: JSON, namespace: str) -> bool:
    kind = subject.get("kind")
    if kind == "User":
        return bool(who.user == subject.get("name"))
    if kind == "Group":
        return subject.get("name") in who.groups
    if kind == "ServiceAccount":
        sa_ns = subject.get("namespace") or namespace
        return bool(sa_ns) and who.user == f"system:serviceaccount:{sa_ns}:{subject.get('name')}"
    return False


def _describe_subject(subject: JSON, binding_ns: str) -> str:
    name = subject.get("name", "")
    if subject.get("kind") == "ServiceAccount":
        name = f"{name}/{subject.get('namespace') or binding_ns}"
    return f'{subject.get("kind")} "{name}"'


def _objects(store: Any, t: rt.ResourceType, namespace: str | None = None) -> list[JSON]:
    return [e.obj for (ns, _), e in sorted(store.objects[t.key].items())
            if namespace is None or ns == namespace]


def _cluster_role_rules(store: Any, name: str) -> list[JSON] | None:
    entry = store.objects[rt.CLUSTERROLE.key].get(("", name))
    if entry is None:
        return None
    role = entry.obj
    aggregation = role.get("aggregationRule")
    if not aggregation:
        return list(role.get("rules") or [])
    rules: list[JSON] = []
    for term in aggregation.get("clusterRoleSelectors") or []:
        reqs = _selector(term)
        for other in _objects(store, rt.CLUSTERROLE):
            labels = (other.get("metadata") or {}).get("labels") or {}
            if other["metadata"]["name"] != name and not other.get("aggregationRule") \
                    and selectors.labels_match(reqs, labels):
                rules += [r for r in other.get("rules") or [] if r not in rules]
    return rules


_OPS = {"In": "in", "NotIn": "notin", "Exists": "exists", "DoesNotExist": "!"}


def _selector(term: JSON) -> tuple[selectors.Requirement, ...]:
    """A metav1.LabelSelector object (matchLabels, matchExpressions) as requirements."""
    reqs = [selectors.Requirement(k, "=", (v,)) for k, v in (term.get("matchLabels") or {}).items()]
    reqs += [selectors.Requirement(e["key"], _OPS[e["operator"]], tuple(e.get("values") or ()))
             for e in term.get("matchExpressions") or []]
    return tuple(reqs)


def _grants(store: Any, who: Identity, namespace: str
            ) -> Iterator[tuple[str, list[JSON] | None, str]]:
    """(describer, rules or None when the role is missing, missing role's error), in the
    order the authorizer visits them: ClusterRoleBindings, then the namespace's
    RoleBindings."""
    builtin = [(_BASIC_USER, _BASIC_USER_RULES)]
    for (binding, role, subject), rules in builtin:
        if _subject_applies(who, subject, ""):
            yield (f'ClusterRoleBinding "{binding}" of ClusterRole "{role}" to '
                   f'{_describe_subject(subject, "")}', rules, "")
    for crb in _objects(store, rt.CLUSTERROLEBINDING):
        ref = crb.get("roleRef") or {}
        for subject in crb.get("subjects") or []:
            if not _subject_applies(who, subject, ""):
                continue
            rules = _cluster_role_rules(store, ref.get("name", ""))
            yield (f'ClusterRoleBinding "{crb["metadata"]["name"]}" of ClusterRole '
                   f'"{ref.get("name")}" to {_describe_subject(subject, "")}', rules,
                   f'clusterrole.{_RBAC} "{ref.get("name")}" not found')
            break
    if not namespace:
        return
    for rb in _objects(store, rt.ROLEBINDING, namespace):
        ref = rb.get("roleRef") or {}
        for subject in rb.get("subjects") or []:
            if not _subject_applies(who, subject, namespace):
                continue
            if ref.get("kind") == "ClusterRole":
                rules = _cluster_role_rules(store, ref.get("name", ""))
                missing = f'clusterrole.{_RBAC} "{ref.get("name")}" not found'
            else:
                entry = store.objects[rt.ROLE.key].get((namespace, ref.get("name", "")))
                rules = list(entry.obj.get("rules") or []) if entry is not None else None
                missing = f'role.{_RBAC} "{ref.get("name")}" not found'
            yield (f'RoleBinding "{rb["metadata"]["name"]}/{namespace}" of {ref.get("kind")} '
                   f'"{ref.get("name")}" to {_describe_subject(subject, namespace)}', rules,
                   missing)
            break


def authorize(store: Any, who: Identity, attrs: Attributes) -> Decision:
    """The RBAC authorizer's decision and reason (module docstring)."""
    if who.superuser:
        return Decision(True, "")
    errors: list[str] = []
    for describer, rules, missing in _grants(store, who, attrs.namespace):
        if rules is None:
            errors.append(missing)
            continue
        if any(rule_allows(attrs, rule) for rule in rules):
            return Decision(True, f"RBAC: allowed by {describer}")
    if not errors:
        return Decision(False, "")
    joined = errors[0] if len(errors) == 1 else "[" + ", ".join(errors) + "]"
    # the authorizer chain prefixes a denial's reason with the authorizer's name
    return Decision(False, f"rbac: RBAC: {joined}")


def forbidden(who: Identity, attrs: Attributes, reason: str) -> ApiError:
    """The 403 ``responsewriters.Forbidden`` sends."""
    message = attrs.describe(who.user) + (f": {reason}" if reason else "")
    qualified = f"{attrs.resource}.{attrs.group}" if attrs.group else attrs.resource
    prefix = f'{qualified} "{attrs.name}"' if attrs.name else qualified
    return ApiError(403, "Forbidden", f"{prefix} is forbidden: {message}",
                    details(attrs.name, attrs.group, attrs.resource))


def access_review(store: Any, who: Identity, body: Any) -> JSON:
    """A SelfSubjectAccessReview answered (201 body): the spec back, the status decided."""
    if not isinstance(body, dict):
        raise bad_request("the body of the request must be a JSON object")
    spec = body.get("spec") or {}
    res = spec.get("resourceAttributes")
    if not isinstance(res, dict) or spec.get("nonResourceAttributes"):
        raise ApiError(422, "Invalid", "the API double answers resourceAttributes only "
                       "(nonResourceAttributes are not modelled)")
    attrs = Attributes(str(res.get("verb", "")), str(res.get("group", "")),
                       str(res.get("resource", "")), str(res.get("subresource", "")),
                       str(res.get("namespace", "")), str(res.get("name", "")))
    decision = authorize(store, who, attrs)
    status: JSON = {"allowed": decision.allowed}
    if decision.reason:
        status["reason"] = decision.reason
    return {"kind": "SelfSubjectAccessReview", "apiVersion": "authorization.k8s.io/v1",
            "metadata": {"creationTimestamp": None}, "spec": spec, "status": status}


_NAMESPACE_SUBRESOURCES = frozenset({"status", "finalize"})


def request_attributes(method: str, path: str, query: dict[str, str]) -> Attributes | None:
    """What a request asks, as the apiserver's RequestInfoFactory reads it from the path;
    None for a non-resource path (discovery, /version, health, the double's own)."""
    parts = [p for p in path.split("/") if p]
    if not parts or parts[0] not in ("api", "apis"):
        return None
    if parts[0] == "api":
        group, rest = "", parts[2:]
    else:
        group, rest = (parts[1], parts[3:]) if len(parts) >= 3 else ("", [])
    if not rest:
        return None
    namespace = ""
    if rest[0] == "namespaces" and len(rest) > 1:
        namespace = rest[1]
        if len(rest) > 2 and rest[2] not in _NAMESPACE_SUBRESOURCES:
            rest = rest[2:]
    resource = rest[0]
    name = rest[1] if len(rest) > 1 else ""
    subresource = rest[2] if len(rest) > 2 else ""
    verb = {"POST": "create", "PUT": "update", "PATCH": "patch"}.get(method, "")
    if method == "GET":
        verb = "get"
        if not name:
            verb = "watch" if query.get("watch") in ("true", "1") else "list"
            for term in (query.get("fieldSelector") or "").split(","):
                key, sep, value = term.partition("=")
                if sep and key.strip() == "metadata.name" and not value.startswith("="):
                    name = value.strip()
    elif method == "DELETE":
        verb = "delete" if name else "deletecollection"
    return Attributes(verb or method.lower(), group, resource, subresource, namespace, name)


def token_request(store: Any, tokens: Tokens, namespace: str, name: str, body: JSON) -> JSON:
    """TokenRequest (``POST .../serviceaccounts/NAME/token``): a token that is this
    ServiceAccount; 404 as the apiserver's when there is no such ServiceAccount."""
    account = store.get(rt.SERVICEACCOUNT, namespace, name)
    spec = body.get("spec") or {}
    seconds = int(spec.get("expirationSeconds") or 3600)
    expires = datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=seconds)
    return {"kind": "TokenRequest", "apiVersion": "authentication.k8s.io/v1",
            "metadata": {"name": name, "namespace": namespace, "creationTimestamp": None},
            "spec": {"audiences": spec.get("audiences") or [], "expirationSeconds": seconds,
                     "boundObjectRef": None},
            "status": {"token": tokens.mint(namespace, name, account["metadata"]["uid"]),
                       "expirationTimestamp": expires.strftime("%Y-%m-%dT%H:%M:%SZ")}}
