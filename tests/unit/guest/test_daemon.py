"""daemon.py pieces that need no processes: shutdown that sticks, JSON log lines."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging

from guest_agent.daemon import cancel_all
from imex_shared.jsonlog import JsonFormatter


async def test_cancel_all_cancels_a_task_that_swallowed_its_cancellation() -> None:
    swallowed = asyncio.Event()

    async def stubborn() -> None:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            swallowed.set()  # what a lost cancellation looks like from outside
        await asyncio.sleep(30)

    async def polite() -> None:
        await asyncio.sleep(30)

    tasks = [asyncio.create_task(stubborn(), name="stubborn"),
             asyncio.create_task(polite(), name="polite")]
    await asyncio.sleep(0)
    # a generous deadline (one retry is 0.1 s), below the 30 s the stubborn task would
    # take to end by itself if its lost cancellation were never repeated
    await asyncio.wait_for(cancel_all(tasks, every=0.1), 10)
    assert swallowed.is_set() and all(t.cancelled() for t in tasks)
    for t in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await t


def test_json_formatter_one_object_with_extras() -> None:
    record = logging.makeLogRecord({"name": "guest_agent", "levelno": logging.WARNING,
                                    "levelname": "WARNING", "msg": "re-asserted %s",
                                    "args": ("/etc/hosts",), "reasserts": 3})
    line = JsonFormatter().format(record)
    assert "\n" not in line
    doc = json.loads(line)
    assert doc["msg"] == "re-asserted /etc/hosts" and doc["level"] == "warning"
    assert doc["reasserts"] == 3 and doc["logger"] == "guest_agent"


def test_both_agents_write_one_json_format() -> None:
    """The host's --json lines are the guest's: one parser reads both; lists stay JSON."""
    import io
    import ipaddress

    from host_agent.logs import setup_logging

    handler = setup_logging("INFO", True, io.StringIO())
    logging.getLogger().removeHandler(handler)
    assert handler.formatter is not None
    record = logging.makeLogRecord({"name": "imex.host.reconcile", "levelno": logging.INFO,
                                    "levelname": "INFO", "msg": "published",
                                    "ensemble": "rack1/gb200", "slots": [0, 2],
                                    "peer": ipaddress.ip_address("10.0.0.1")})
    host, guest = handler.formatter.format(record), JsonFormatter().format(record)
    assert host == guest
    doc = json.loads(host)
    assert doc["slots"] == [0, 2] and doc["ensemble"] == "rack1/gb200"
    assert doc["peer"] == "10.0.0.1"


async def test_run_all_repeats_a_cancellation_its_child_lost() -> None:
    """The owner of a child that swallowed its cancellation ends when cancel_all repeats
    the owner's; the same owner built on a TaskGroup waits for the child forever."""
    from guest_agent.daemon import run_all

    swallowed = asyncio.Event()

    async def stubborn() -> None:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            swallowed.set()  # as a lost cancellation looks from outside
        await asyncio.sleep(30)

    async def with_run_all() -> None:
        await run_all({"child": stubborn()})

    async def with_task_group() -> None:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(stubborn(), name="child")

    owner = asyncio.create_task(with_run_all(), name="owner")
    await asyncio.sleep(0.05)
    await asyncio.wait_for(cancel_all([owner], every=0.1), 10)
    assert swallowed.is_set() and owner.done()

    swallowed.clear()
    group = asyncio.create_task(with_task_group(), name="group")
    await asyncio.sleep(0.05)
    done, _ = await asyncio.wait([asyncio.create_task(cancel_all([group], every=0.1))],
                                 timeout=1.0)
    assert swallowed.is_set() and not done and not group.done()  # the hang fixed above
    for t in asyncio.all_tasks() - {asyncio.current_task()}:
        t.cancel()
    await asyncio.sleep(0)
