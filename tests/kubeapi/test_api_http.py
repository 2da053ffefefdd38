"""The local API over real HTTP, as kubectl, kopf and the kubelet loop talk to it."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import kmock
import pytest
import yaml

from kvshard_local.apiserver import LocalKubeApi, Store
from kvshard_local.apiserver.errors import Expired

ROOT = Path(__file__).resolve().parents[2]
SHARDS = "/apis/kvshard.io/v1alpha1/namespaces/default/cacheshards"
PODS = "/api/v1/namespaces/default/pods"
TABLE = "application/json;as=Table;v=v1;g=meta.k8s.io,application/json"
MERGE = {"Content-Type": "application/merge-patch+json"}


@pytest.fixture
async def api() -> AsyncIterator[tuple[LocalKubeApi, aiohttp.ClientSession]]:
    server = LocalKubeApi()
    async with server, kmock.Server(server) as running, aiohttp.ClientSession(str(running.url)) as client:
        yield server, client


async def call(client: aiohttp.ClientSession, method: str, path: str, body: Any = None,
               headers: dict[str, str] | None = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body)
    async with client.request(method, path, data=data, headers=headers) as response:
        return response.status, await response.json(content_type=None)


def minimal(name: str = "movielens") -> dict[str, Any]:
    obj: dict[str, Any] = yaml.safe_load((ROOT / "crds" / "examples" / "cacheshard-minimal.yaml").read_text())
    obj["metadata"]["name"] = name
    return obj


async def test_lists_carry_kind_and_tables_come_from_printer_columns(api: tuple[LocalKubeApi, Any]) -> None:
    _, client = api
    assert (await call(client, "POST", SHARDS, minimal()))[0] == 201
    code, listed = await call(client, "GET", SHARDS)
    assert (code, listed["kind"], listed["apiVersion"]) == (200, "CacheShardList", "kvshard.io/v1alpha1")
    assert int(listed["metadata"]["resourceVersion"]) >= int(listed["items"][0]["metadata"]["resourceVersion"])
    _, table = await call(client, "GET", SHARDS + "/movielens", headers={"Accept": TABLE})
    assert table["kind"] == "Table" and table["rows"][0]["cells"][0] == "movielens"
    _, namespaces = await call(client, "GET", "/api/v1/namespaces")
    assert [n["metadata"]["name"] for n in namespaces["items"]] == ["default"]


async def test_errors_are_kubernetes_statuses(api: tuple[LocalKubeApi, Any]) -> None:
    _, client = api
    code, missing = await call(client, "GET", SHARDS + "/nope")
    assert (code, missing["kind"], missing["reason"]) == (404, "Status", "NotFound")
    assert missing["message"] == 'cacheshards.kvshard.io "nope" not found'
    bad = minimal("bad")
    bad["spec"]["clusters"] = 0
    code, refused = await call(client, "POST", SHARDS + "?fieldValidation=Strict", bad)
    assert (code, refused["details"]["causes"][0]["field"]) == (422, "spec.clusters")
    assert (await call(client, "POST", SHARDS, minimal()))[0] == 201
    code, exists = await call(client, "POST", SHARDS, minimal())
    assert (code, exists["reason"]) == (409, "AlreadyExists")
    assert (await call(client, "POST", "/api/v1/namespaces/ghost/pods", {"metadata": {"name": "p"}}))[0] == 404
    assert (await call(client, "GET", "/apis/kvshard.io/v1alpha1/namespaces/default/widgets"))[0] == 404
    assert (await call(client, "DELETE", "/api/v1/namespaces/default"))[0] == 405


async def test_status_is_written_only_through_the_subresource(api: tuple[LocalKubeApi, Any]) -> None:
    _, client = api
    await call(client, "POST", SHARDS, minimal())
    _, main = await call(client, "PATCH", SHARDS + "/movielens", {"status": {"pods": 3}}, MERGE)
    assert "status" not in main
    _, sub = await call(client, "PATCH", SHARDS + "/movielens/status", {"status": {"pods": 3}}, MERGE)
    assert sub["status"] == {"pods": 3} and sub["metadata"]["generation"] == 1
    _, changed = await call(client, "PATCH", SHARDS + "/movielens", {"spec": {"clusters": 4}}, MERGE)
    assert changed["metadata"]["generation"] == 2 and changed["status"] == {"pods": 3}


async def test_a_finalizer_holds_deletion_until_it_is_removed(api: tuple[LocalKubeApi, Any]) -> None:
    _, client = api
    await call(client, "POST", SHARDS, minimal())
    await call(client, "PATCH", SHARDS + "/movielens", {"metadata": {"finalizers": ["kvshard.io/etcd-cleanup"]}}, MERGE)
    code, deleting = await call(client, "DELETE", SHARDS + "/movielens")
    assert code == 200 and deleting["metadata"]["deletionTimestamp"]
    assert (await call(client, "GET", SHARDS + "/movielens"))[0] == 200
    _, last = await call(client, "PATCH", SHARDS + "/movielens", {"metadata": {"finalizers": None}}, MERGE)
    assert last["metadata"]["name"] == "movielens"
    assert (await call(client, "GET", SHARDS + "/movielens"))[0] == 404


async def watch(client: aiohttp.ClientSession, query: str, count: int,
                headers: dict[str, str] | None = None) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    async with client.get(SHARDS + "?watch=true&" + query, headers=headers) as response:
        assert response.headers["Content-Type"].startswith("application/json")
        async for line in response.content:
            if line.strip():
                events.append(json.loads(line))
            if len(events) == count:
                break
    return events


async def test_a_watch_from_a_list_sees_each_later_change_once(api: tuple[LocalKubeApi, Any]) -> None:
    _, client = api
    await call(client, "POST", SHARDS, minimal("a"))
    _, listed = await call(client, "GET", SHARDS)
    version = listed["metadata"]["resourceVersion"]
    task = asyncio.create_task(watch(client, f"resourceVersion={version}", 2))
    await asyncio.sleep(0.2)
    await call(client, "POST", SHARDS, minimal("b"))
    await call(client, "PATCH", SHARDS + "/a", {"metadata": {"labels": {"x": "y"}}}, MERGE)
    events = await asyncio.wait_for(task, 10)
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [("ADDED", "b"), ("MODIFIED", "a")]
    # no version: the current objects first; sendInitialEvents: then a bookmark
    initial = await asyncio.wait_for(watch(client, "sendInitialEvents=true&resourceVersionMatch=NotOlderThan", 3), 10)
    assert [e["type"] for e in initial] == ["ADDED", "ADDED", "BOOKMARK"]
    assert initial[2]["object"]["metadata"]["annotations"] == {"k8s.io/initial-events-end": "true"}
    named = await asyncio.wait_for(watch(client, "fieldSelector=metadata.name%3Db", 1, {"Accept": TABLE}), 10)
    assert named[0]["object"]["kind"] == "Table" and named[0]["object"]["rows"][0]["cells"][0] == "b"


async def test_watches_end_after_timeout_seconds(api: tuple[LocalKubeApi, Any]) -> None:
    _, client = api
    events = await asyncio.wait_for(watch(client, "resourceVersion=1&timeoutSeconds=1", 99), 10)
    assert events == []


async def test_the_store_forgets_old_events_and_says_so() -> None:
    store = Store(history=2)
    for i in range(6):
        store.put("things", {"metadata": {"name": f"t{i}", "namespace": None}})
    with pytest.raises(Expired):
        store.events("things", 1)
    stream = store.events("things", store.revision - 1)
    first = await asyncio.wait_for(anext(stream), 1)
    assert (first.type, first.object["metadata"]["name"]) == ("ADDED", "t5")
    store.remove("things", first.object)
    second = await asyncio.wait_for(anext(stream), 1)
    assert (second.type, second.revision) == ("DELETED", store.revision)
