"""The official SDK's client-side pools (`SandboxPoolSync`, `SandboxPoolAsync` with the in-memory state
stores) against Warren, and the rule they rely on: a deleted sandbox leaves the list and answers 404 at
once, as in the reference, so a caller counting its sandboxes by a metadata tag sees the count fall.
Sandboxes that ended on their own stay visible for `terminated_retention_seconds`
(test_lifecycle's expiry test)."""

from __future__ import annotations

import asyncio
import uuid
from datetime import datetime, timedelta, timezone

from opensandbox import (InMemoryAsyncPoolStateStore, InMemoryPoolStateStore, PoolCreationSpec,
                         SandboxManagerSync, SandboxPoolAsync, SandboxPoolSync)
from opensandbox.models.sandboxes import SandboxFilter

import warren_e2e as W


def tagged(manager: SandboxManagerSync, tag: str) -> dict[str, str]:
    """id → state of every listed sandbox carrying the tag."""
    page = manager.list_sandbox_infos(SandboxFilter(metadata={"e2e-pool": tag}, page_size=100))
    return {s.id: s.status.state for s in page.sandbox_infos}


def test_deleted_sandbox_is_gone_from_list_and_get(api, raw_sandbox):
    tag = uuid.uuid4().hex[:12]
    sid = raw_sandbox(metadata={"e2e-pool": tag})["id"]
    listed = api.get("/v1/sandboxes", params={"metadata": f"e2e-pool={tag}"}).json()["items"]
    assert [s["id"] for s in listed] == [sid]
    assert api.delete(f"/v1/sandboxes/{sid}").status_code == 204
    W.assert_error_body(api.get(f"/v1/sandboxes/{sid}"), codes=[404])
    assert api.get("/v1/sandboxes", params={"metadata": f"e2e-pool={tag}"}).json()["items"] == []
    # not even under a filter for the state it ended in
    r = api.get("/v1/sandboxes", params={"state": "Terminated", "metadata": f"e2e-pool={tag}"})
    assert r.status_code == 200 and r.json()["items"] == []


def test_operations_racing_a_delete_answer_404_not_the_dead_state(server, api, raw_sandbox):
    """Pause, renew and metadata patches sent while a delete runs wait for it; once it is done the
    sandbox is unknown, so they answer 404 like any unknown sandbox (not 409 "Terminated" about a
    record no list or get shows)."""
    from concurrent.futures import ThreadPoolExecutor
    until = (datetime.now(timezone.utc) + timedelta(minutes=20)).isoformat()
    ops = {
        "pause": lambda sid: api.post(f"/v1/sandboxes/{sid}/pause"),
        "renew": lambda sid: api.post(f"/v1/sandboxes/{sid}/renew-expiration", json={"expiresAt": until}),
        "metadata": lambda sid: api.patch(f"/v1/sandboxes/{sid}/metadata", json={"k": "v"}),
    }
    with ThreadPoolExecutor(4) as pool:
        for _ in range(4):
            sid = raw_sandbox()["id"]
            W.wait_until(lambda: api.get(f"/v1/sandboxes/{sid}").json()["status"]["state"] == "Running", 60,
                         interval=0.1, message="the sandbox to run")
            deleting = pool.submit(api.delete, f"/v1/sandboxes/{sid}")
            racing = {name: pool.submit(op, sid) for name, op in ops.items()}
            assert deleting.result().status_code == 204
            for name, fut in racing.items():
                r = fut.result()
                # before the delete took the sandbox: done; after: unknown
                assert r.status_code in (200, 202, 204, 404), (name, r.status_code, r.text)
            assert api.get(f"/v1/sandboxes/{sid}").status_code == 404


def test_sync_pool_warms_hands_out_and_releases(server, manager):
    tag = uuid.uuid4().hex[:12]
    pool = SandboxPoolSync(
        pool_name=f"e2e-{tag}", max_idle=2, state_store=InMemoryPoolStateStore(),
        connection_config=server.sdk_config(),
        creation_spec=PoolCreationSpec(image=server.sandbox_image("host"), metadata={"e2e-pool": tag}),
        warmup_concurrency=2, idle_timeout=timedelta(minutes=5))
    pool.start()
    try:
        W.wait_until(lambda: pool.snapshot().idle_count == 2, 60, interval=0.3, message="the pool to warm up")
        for sid in tagged(manager, tag):
            W.track_sandbox(sid)
        sbx = pool.acquire(sandbox_timeout=timedelta(minutes=5))
        W.track_sandbox(sbx.id)
        ex = sbx.commands.run("echo pooled")
        assert [m.text for m in ex.logs.stdout] == ["pooled"]
        sbx.kill()
        sbx.close()
        assert sbx.id not in tagged(manager, tag), "a killed sandbox must leave the list at once"
    finally:
        # Stop the pool before draining it: a running pool refills while release_all_idle takes idle
        # sandboxes, and release_all_idle loops until the store is empty (forever when the runtime's
        # delete is slower than its create, as with gVisor).
        pool.shutdown(graceful=True)
        pool.release_all_idle()
    # The pool's idle sandboxes were killed: the tag counts none, none answers get.
    W.wait_until(lambda: not tagged(manager, tag), 20, interval=0.3,
                 message="the pool's sandboxes to leave the list")


def test_async_pool_releases_everything(server, manager):
    tag = uuid.uuid4().hex[:12]

    async def main():
        pool = SandboxPoolAsync(
            pool_name=f"e2e-{tag}", max_idle=2, state_store=InMemoryAsyncPoolStateStore(),
            connection_config=server.sdk_async_config(),
            creation_spec=PoolCreationSpec(image=server.sandbox_image("host"), metadata={"e2e-pool": tag}),
            warmup_concurrency=2, idle_timeout=timedelta(minutes=5))
        await pool.start()
        try:
            for _ in range(300):
                if (await pool.snapshot()).idle_count == 2:
                    break
                await asyncio.sleep(0.2)
            assert (await pool.snapshot()).idle_count == 2, await pool.snapshot()
            for sid in tagged(manager, tag):
                W.track_sandbox(sid)
        finally:
            await pool.shutdown(graceful=True)     # stopped first: see the sync test
        assert await pool.release_all_idle() == 2

    asyncio.run(main())
    W.wait_until(lambda: not tagged(manager, tag), 20, interval=0.3,
                 message="the pool's sandboxes to leave the list")
