"""The start-up checks of ``preflight.py``, asked of the API until they hold.

``Preflight.run`` (a task of the agent's TaskGroup) reads the token file, when the
configuration has one; asks a SelfSubjectAccessReview for each right the settings
need, all at once (one whose need depends on another right only when that one is
granted); and,
once every right holds, makes a dry-run create in each namespace the agent creates
objects in, which the apiserver answers with 404 for a namespace that does not
exist (nothing is stored; a dry run is authorized as the create it would be, so it
is asked only once RBAC allows that create). Until everything holds, ``problem``
names the cause, the registry's ``/readyz`` answers 503 with it, and the log says it
once (and again only when the cause changes); the checks run again after 1, 2 and 4
seconds, then every 5, so a namespace or a RoleBinding created later is found.

Once they hold they are never asked again: readiness is then the registry's own
(synced, not stopping) and does not follow the API's reachability, so the registry
keeps serving through an API outage, as designed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Final

from host_agent.kube.client import KubeError, api_call
from host_agent.kube.preflight import (
    Need,
    OwnNamespace,
    namespace_problem,
    needed_rights,
    own_namespaces,
    probe_object,
    rights_problem,
)
from host_agent.settings import HostSettings

log = logging.getLogger("imex.host")

REVIEWS: Final = "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews"
NOT_YET: Final = "the start-up checks (namespace, token file, RBAC) have not finished"


class Unanswered(Exception):
    """The API did not give an answer the checks can judge (unreachable, 5xx, 401)."""


def _collection(own: OwnNamespace) -> str:
    right = own.create
    base = f"/apis/{right.group}/v1" if right.group else "/api/v1"
    return f"{base}/namespaces/{own.namespace}/{right.resource}"


class Preflight:
    """Asks until the agent's preconditions hold (module docstring); ``problem`` is None
    once they do."""

    def __init__(self, client: Any, settings: HostSettings, token_file: str | None = None,
                 *, retry: tuple[float, float] = (1.0, 5.0),
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        self._client = client
        self._settings = settings
        self._token_file = token_file
        self._retry = retry
        self._sleep = sleep
        self._said: str | None = None
        self.problem: str | None = NOT_YET
        self.rounds = 0

    async def run(self) -> None:
        delay = self._retry[0]
        while True:
            self.rounds += 1
            problem = await self.check()
            if problem is None:
                self.problem = None
                needs = needed_rights(self._settings)
                spaces = ", ".join(o.namespace for o in own_namespaces(self._settings))
                log.info("start-up checks hold: RBAC allows the %d rights the configuration "
                         "uses%s%s", len(needs),
                         f"; namespace {spaces} exists" if spaces else "",
                         f"; token file {self._token_file} is readable"
                         if self._token_file else "")
                return
            self.problem = problem
            if problem != self._said:
                log.warning("not ready: %s", problem)
                self._said = problem
            await self._sleep(delay)
            delay = min(delay * 2, self._retry[1])

    async def check(self) -> str | None:
        """One round of every check; the first cause found, or None when all hold."""
        token = self._token_problem()
        if token is not None:
            return token
        try:
            denied = await self._denied()
            if denied:
                return rights_problem(denied)
            for own in own_namespaces(self._settings):
                problem = await self._namespace(own)
                if problem is not None:
                    return problem
        except Unanswered as exc:
            return str(exc)
        return None

    def _token_problem(self) -> str | None:
        if self._token_file is None:
            return None
        try:
            text = Path(self._token_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            return f"token file {self._token_file} cannot be read: {exc}"
        if not text.strip():
            return f"token file {self._token_file} is empty"
        return None

    async def _allowed(self, need: Need) -> bool:
        try:
            answer = await api_call(self._client, "POST", REVIEWS, body=need.right.review(),
                                    timeout=10)
        except KubeError as exc:
            if exc.status == 403:
                raise Unanswered(
                    "RBAC refuses the agent the SelfSubjectAccessReviews it checks its rights "
                    "with: grant create on selfsubjectaccessreviews.authorization.k8s.io (the "
                    "built-in system:basic-user role does, to every authenticated user)"
                ) from exc
            raise Unanswered(f"cannot check the agent's rights: {exc}") from exc
        return bool(((answer or {}).get("status") or {}).get("allowed"))

    async def _denied(self) -> list[Need]:
        """The needs RBAC refuses, in the table's order; the reviews are asked at once
        (two rounds: the gates of conditional needs, then every need that applies)."""
        needs = needed_rights(self._settings)
        gates = sorted({n.only_if for n in needs if n.only_if is not None})
        granted = dict(zip(gates, await self._ask([Need(g, "") for g in gates]), strict=True))
        applies = [n for n in needs if n.only_if is None or granted[n.only_if]]
        answers = await self._ask(applies)
        return [n for n, allowed in zip(applies, answers, strict=True) if not allowed]

    async def _ask(self, needs: list[Need]) -> list[bool]:
        """Each need's review, asked at once; Unanswered if any could not be asked."""
        async def ask(need: Need) -> bool | Unanswered:
            try:
                return await self._allowed(need)
            except Unanswered as exc:
                return exc

        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(ask(n)) for n in needs]
        answers = [t.result() for t in tasks]
        for answer in answers:
            if isinstance(answer, Unanswered):
                raise answer
        return [bool(a) for a in answers]

    async def _namespace(self, own: OwnNamespace) -> str | None:
        try:
            await api_call(self._client, "POST", _collection(own), body=probe_object(own.create),
                           params={"dryRun": "All", "fieldManager": self._settings.field_manager},
                           timeout=10)
        except KubeError as exc:
            details = exc.details or {}
            if exc.status == 404 and details.get("kind") == "namespaces":
                return namespace_problem(own, self._settings, terminating=False)
            if exc.status == 403 and "being terminated" in (exc.api_message or ""):
                return namespace_problem(own, self._settings, terminating=True)
            if exc.status == 0 or exc.status == 429 or exc.status >= 500 or exc.status == 401:
                raise Unanswered(f"cannot check that namespace {own.namespace} exists: "
                                 f"{exc}") from exc
            # 409 (an object of that name exists) and anything else that is not about the
            # namespace (an admission webhook refusing dry runs): the namespace is there
            log.debug("namespace %s: the dry-run create answered %s; taken as present",
                      own.namespace, exc)
        return None
