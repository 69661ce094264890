"""Warm pools: `/v1/pools` CRUD, creates served from a pool by `extensions.poolRef`
(official SDK) and by an exact template match (raw API), background refill, and an empty pool that
queues creates for a bounded wait and then answers 429 with Retry-After — never a silent failure."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time
import uuid
from datetime import timedelta
from pathlib import Path

import httpx
import pytest

import warren_e2e as W


def _template(image: str, marker: str) -> dict:
    body = W.create_body(image)
    body["env"] = {"E2E_POOL": marker}  # no other test's create matches this template
    return body


@pytest.fixture
def pool(server, api, test_image):
    name = f"e2e-{uuid.uuid4().hex[:8]}"
    marker = uuid.uuid4().hex
    spec = {"name": name, "template": _template(test_image, marker),
            "capacitySpec": {"bufferMin": 2, "bufferMax": 3, "poolMin": 0, "poolMax": 5},
            # long enough for a delete and a fresh create on the slowest runtime (gVisor)
            "maxWaitSeconds": 10}
    r = api.post("/v1/pools", json=spec)
    assert r.status_code == 201, r.text
    yield {"name": name, "spec": spec, "marker": marker}
    r = api.delete(f"/v1/pools/{name}")
    assert r.status_code in (204, 404), r.text


def _status(api, name) -> dict:
    r = api.get(f"/v1/pools/{name}")
    assert r.status_code == 200, r.text
    return r.json()["status"]


def _warm_up(api, name, n, timeout=120):
    W.wait_until(lambda: _status(api, name)["available"] >= n, timeout, interval=0.1,
                 message=f"pool {name} to hold {n} warm sandboxes")


@pytest.mark.timeout(300)
def test_pool_serves_creates_refills_and_queues(server, api, pool):
    name, spec = pool["name"], pool["spec"]
    _warm_up(api, name, 3)
    listed = api.get("/v1/pools").json()["items"]
    assert any(p["name"] == name and p["capacitySpec"]["poolMax"] == 5 for p in listed), listed
    before = {s["id"] for s in api.get("/v1/sandboxes", params={"pageSize": 1000}).json()["items"]}

    # 1. the official SDK with poolRef
    from opensandbox import SandboxSync
    sbx = SandboxSync.create(spec["template"]["image"]["uri"], connection_config=server.sdk_config(),
                             extensions={"poolRef": name}, metadata={"who": "sdk"},
                             timeout=timedelta(minutes=10), ready_timeout=timedelta(seconds=60))
    W.track_sandbox(sbx.id)
    ids = [sbx.id]
    try:
        code, out, err = W.sh(sbx, "echo $E2E_POOL")
        assert code == 0 and out.strip() == pool["marker"], (out, err)
        info = api.get(f"/v1/sandboxes/{sbx.id}").json()
        assert info["metadata"] == {"who": "sdk"} and info.get("expiresAt"), info
        # warm sandboxes are not listed; the claimed one is
        listed_ids = {s["id"] for s in api.get("/v1/sandboxes", params={"pageSize": 1000}).json()["items"]}
        assert listed_ids - before == {sbx.id}, "only the claimed sandbox becomes visible"

        # 2. a raw create asking for exactly the template is served from the pool too
        t0 = time.perf_counter()
        r = api.post("/v1/sandboxes", json={**spec["template"], "metadata": {"who": "raw"}})
        claim_ms = (time.perf_counter() - t0) * 1000
        assert r.status_code == 202, r.text
        ids.append(r.json()["id"])
        W.track_sandbox(ids[-1])
        assert _status(api, name)["allocated"] == 2
        print(f"claim from a warm pool: {claim_ms:.1f} ms")

        # 3. refill back to bufferMax within poolMax (5 - 2 allocated = 3)
        _warm_up(api, name, 3)
        st = _status(api, name)
        assert st["total"] <= 5 and st["allocated"] == 2, st

        # 4. more creates than the pool has left: 3 are served, 2 wait 10 s and get 429 + Retry-After
        def claim(_):
            return api.post("/v1/sandboxes", json={**spec["template"], "extensions": {"poolRef": name}})
        with concurrent.futures.ThreadPoolExecutor(5) as ex:
            results = list(ex.map(claim, range(5)))
        ok = [r for r in results if r.status_code == 202]
        busy = [r for r in results if r.status_code != 202]
        ids += [r.json()["id"] for r in ok]
        for r in ok:
            W.track_sandbox(r.json()["id"])
        assert len(ok) == 3 and len(busy) == 2, [(r.status_code, r.text[:200]) for r in results]
        for r in busy:
            body = W.assert_error_body(r, codes=[429])
            assert body["code"] == "POOL::EXHAUSTED" and name in body["message"], body
            assert r.headers.get("retry-after") == "1", dict(r.headers)

        # 5. a create queued on the empty pool is served as soon as an allocated sandbox goes
        done = {}

        def waiter():
            done["r"] = api.post("/v1/sandboxes", json={**spec["template"], "extensions": {"poolRef": name}},
                                 timeout=30)
        import threading
        t = threading.Thread(target=waiter)
        t.start()
        time.sleep(0.5)
        assert api.delete(f"/v1/sandboxes/{ids.pop(0)}").status_code == 204
        t.join(30)
        assert done["r"].status_code == 202, done["r"].text
        ids.append(done["r"].json()["id"])
        W.track_sandbox(ids[-1])
    finally:
        for i in ids:
            api.delete(f"/v1/sandboxes/{i}")
        sbx.close()


def _cpu_shares() -> dict[str, str]:
    """Sandbox cgroup → CPU weight, on the host: v1 `cpu.shares` (default 1024, least 2) or v2
    `cpu.weight` (default 100, least 1)."""
    cg = Path("/sys/fs/cgroup")
    files = [*cg.glob("cpu*/warren*/*/cpu.shares"), *cg.glob("warren*/*/cpu.weight")]
    return {f.parent.name: f.read_text().strip() for f in files if not f.parent.name.startswith(".")}


@pytest.mark.timeout(180)
def test_warm_sandboxes_yield_the_cpu_until_claimed(server, api, pool):
    """A warm sandbox is made, and idles, at the least CPU weight, so a pool's refill yields to the
    sandboxes in use; the one a create claims gets the weight every sandbox has."""
    if server.kind != "native":
        pytest.skip("Docker sandboxes keep the CPU weight Docker gives them")
    name, spec = pool["name"], pool["spec"]
    _warm_up(api, name, 3)
    warm = {sid for sid, w in _cpu_shares().items() if w in ("2", "1")}
    assert len(warm) >= 3, _cpu_shares()
    r = api.post("/v1/sandboxes", json={**spec["template"], "extensions": {"poolRef": name}})
    assert r.status_code == 202, r.text
    sid = r.json()["id"]
    W.track_sandbox(sid)
    try:
        assert sid in warm, "a warm sandbox was handed out"
        assert _cpu_shares().get(sid) in ("1024", "100"), _cpu_shares()
        # and the refill that follows is in the background again
        W.wait_until(lambda: len({s for s, w in _cpu_shares().items() if w in ("2", "1")} - warm) >= 1,
                     60, interval=0.1, message="a new warm sandbox, at the least weight")
    finally:
        assert api.delete(f"/v1/sandboxes/{sid}").status_code == 204


@pytest.mark.timeout(120)
def test_pool_api_errors(server, api, test_image):
    good = {"name": "e2e-bad", "template": _template(test_image, "x"),
            "capacitySpec": {"bufferMin": 0, "bufferMax": 0, "poolMin": 0, "poolMax": 1}}
    for bad in ({**good, "name": "Bad Name"},
                {**good, "capacitySpec": {"bufferMin": 3, "bufferMax": 2, "poolMin": 0, "poolMax": 5}},
                {**good, "capacitySpec": {"bufferMin": 0, "bufferMax": 9, "poolMin": 0, "poolMax": 5}},
                {**good, "template": {**good["template"], "resourceLimits": {"cpu": "lots"}}}):
        W.assert_error_body(api.post("/v1/pools", json=bad), codes=[400])
    assert api.get("/v1/pools/nope").status_code == 404
    assert api.delete("/v1/pools/nope").status_code == 404
    r = api.post("/v1/sandboxes", json={**W.create_body(test_image), "extensions": {"poolRef": "nope"}})
    W.assert_error_body(r, codes=[400])
    assert "nope" in r.json()["message"]
    # a pool with no room at all: a create waits its maxWaitSeconds and gets 429, nothing is made
    r = api.post("/v1/pools", json={**good, "maxWaitSeconds": 1})
    assert r.status_code == 201, r.text
    try:
        assert api.post("/v1/pools", json=good).status_code == 409
        before = len(api.get("/v1/sandboxes", params={"pageSize": 1000}).json()["items"])
        r = api.post("/v1/sandboxes", json={**W.create_body(test_image), "extensions": {"poolRef": "e2e-bad"}})
        # poolMax 1 and bufferMax 0: nothing is ever warm
        W.assert_error_body(r, codes=[429])
        assert len(api.get("/v1/sandboxes", params={"pageSize": 1000}).json()["items"]) == before
        # poolRef with another image is refused, not silently swapped
        r = api.post("/v1/sandboxes", json={**W.create_body("host"), "extensions": {"poolRef": "e2e-bad"}})
        W.assert_error_body(r, codes=[400])
    finally:
        assert api.delete("/v1/pools/e2e-bad").status_code == 204


def test_pool_replace_checks_the_new_spec_first(server, api, pool):
    """PUT with a bad spec is refused and changes nothing (it used to delete the pool first, so a
    400 left no pool at all); a good one replaces the pool under the same name."""
    name, spec = pool["name"], pool["spec"]
    _warm_up(api, name, 2)
    bad = {**spec, "capacitySpec": {**spec["capacitySpec"], "bufferMax": 9}}  # above poolMax
    W.assert_error_body(api.put(f"/v1/pools/{name}", json=bad), codes=[400])
    r = api.get(f"/v1/pools/{name}")
    assert r.status_code == 200, r.text
    assert r.json()["capacitySpec"] == spec["capacitySpec"]
    assert r.json()["status"]["available"] >= 2, r.json()
    good = {**spec, "capacitySpec": {**spec["capacitySpec"], "bufferMin": 1, "bufferMax": 1}}
    r = api.put(f"/v1/pools/{name}", json=good)
    assert r.status_code == 200, r.text
    assert api.get(f"/v1/pools/{name}").json()["capacitySpec"]["bufferMax"] == 1
    _warm_up(api, name, 1)
    if server.gvisor:
        return  # gVisor's processes are not host processes to count
    # the old pool's warm sandboxes are gone, not left running beside the new one's
    W.wait_until(lambda: len(_warm_pids(pool["marker"])) == 1, 30, interval=0.2,
                 message="one warm sandbox after shrinking the pool to bufferMax 1")


@pytest.mark.timeout(300)
def test_pool_update_with_only_capacity_keeps_the_warm_sandboxes(server, api, pool):
    """The reference's update shape, `PUT /pools/{name}` with `{capacitySpec}` alone: the sizes
    change, the template stays, warm sandboxes stay warm (none is remade), those beyond the new
    bufferMax go; answers carry `createdAt` and a `status.revision` that moves with the spec."""
    name, spec = pool["name"], pool["spec"]
    _warm_up(api, name, 3)
    first = api.get(f"/v1/pools/{name}").json()
    assert W.parse_time(first["createdAt"]) <= W.utcnow()
    assert first["status"]["revision"]
    # Warm sandboxes are not listed; on the host, each is its entrypoint's process (not on gVisor,
    # whose processes are not host processes).
    host_pids = not server.gvisor
    warm_before = set(_warm_pids(pool["marker"])) if host_pids else set()
    assert not host_pids or len(warm_before) == 3, warm_before

    grown = {"capacitySpec": {**spec["capacitySpec"], "bufferMin": 1, "bufferMax": 4}}
    r = api.put(f"/v1/pools/{name}", json=grown)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["capacitySpec"] == grown["capacitySpec"]
    assert body["template"]["env"] == spec["template"]["env"], "the template is kept"
    assert body["createdAt"] == first["createdAt"]
    assert body["status"]["revision"] != first["status"]["revision"]
    assert body["status"]["available"] >= 3, body
    _warm_up(api, name, 4)
    assert warm_before <= set(_warm_pids(pool["marker"])), "the warm sandboxes were kept, not remade"

    shrunk = {"capacitySpec": {**spec["capacitySpec"], "bufferMin": 1, "bufferMax": 1}}
    r = api.put(f"/v1/pools/{name}", json=shrunk)
    assert r.status_code == 200, r.text
    W.wait_until(lambda: _status(api, name)["available"] == 1, 30, interval=0.2,
                 message="the warm sandboxes beyond bufferMax 1 to go")
    if host_pids:
        W.wait_until(lambda: len(_warm_pids(pool["marker"])) == 1, 30, interval=0.2,
                     message="one warm sandbox process after shrinking to bufferMax 1")
        assert set(_warm_pids(pool["marker"])) <= warm_before, "the one kept is one of the first"
    # a claim is still served from the kept one
    r = api.post("/v1/sandboxes", json={**W.create_body(spec["template"]["image"]["uri"]),
                                        "env": spec["template"]["env"], "extensions": {"poolRef": name}})
    assert r.status_code == 202, r.text
    W.track_sandbox(r.json()["id"])
    assert api.delete(f"/v1/sandboxes/{r.json()['id']}").status_code == 204

    # bad updates change nothing: sizes out of order, another name, an unknown pool
    before = api.get(f"/v1/pools/{name}").json()
    W.assert_error_body(api.put(f"/v1/pools/{name}", json={"capacitySpec": {**spec["capacitySpec"],
                                                                            "bufferMax": 9}}), codes=[400])
    W.assert_error_body(api.put(f"/v1/pools/{name}", json={**shrunk, "name": "other"}), codes=[400])
    W.assert_error_body(api.put(f"/v1/pools/{name}", json={}), codes=[400])
    W.assert_error_body(api.put("/v1/pools/e2e-no-such-pool", json=shrunk), codes=[404])
    after = api.get(f"/v1/pools/{name}").json()
    assert after["capacitySpec"] == before["capacitySpec"]
    assert after["status"]["revision"] == before["status"]["revision"]


def _warm_pids(marker: str) -> list[int]:
    """Host PIDs of the pool's warm sandboxes' entrypoints (they carry the template's env)."""
    out = []
    for pid in W.all_pids():
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"E2E_POOL={marker}".encode() in env and W.proc_argv(pid)[:1] == ["tail"]:
            out.append(pid)
    return out


@pytest.mark.timeout(180)
def test_warm_sandbox_that_dies_is_replaced(server, api, pool):
    """A warm sandbox whose main process ends is no longer counted as available: the pool makes a
    replacement, and a claim gets a sandbox that works."""
    if server.gvisor:
        pytest.skip("gVisor's processes are not host processes this test can signal")
    name = pool["name"]
    _warm_up(api, name, 3)
    victims = W.wait_until(lambda: (lambda p: p if len(p) >= 3 else None)(_warm_pids(pool["marker"])),
                           30, message="the warm sandboxes' entrypoints")
    for pid in victims:
        os.kill(pid, signal.SIGKILL)
    # all three end, three new ones are made: the entrypoints seen now are all new
    W.wait_until(lambda: len(set(_warm_pids(pool["marker"])) - set(victims)) >= 3
                 and _status(api, name)["available"] >= 3, 60, interval=0.2,
                 message="replacements for the warm sandboxes that died")
    r = api.post("/v1/sandboxes", json={**pool["spec"]["template"], "extensions": {"poolRef": name}})
    assert r.status_code == 202, r.text
    sid = r.json()["id"]
    W.track_sandbox(sid)
    ep = api.get(f"/v1/sandboxes/{sid}/endpoints/44772").json()
    r = httpx.post(f"http://{ep['endpoint']}/command", headers=ep.get("headers") or {},
                   json={"command": "echo claimed"}, timeout=30)
    assert r.status_code == 200 and "claimed" in r.text, r.text[:300]
    assert api.delete(f"/v1/sandboxes/{sid}").status_code == 204


@pytest.mark.timeout(240)
def test_pool_keeps_its_size_across_restarts(fresh_server, test_image):
    """Warm sandboxes survive a server restart and are taken back; the refill must not start before
    they are, or every restart adds a pool's worth of extra warm sandboxes."""
    srv = fresh_server
    srv.import_image(W.TEST_IMAGE_NAME, W.test_rootfs())
    marker = uuid.uuid4().hex
    name = f"e2e-r{marker[:6]}"
    spec = {"name": name, "template": _template(test_image, marker),
            "capacitySpec": {"bufferMin": 2, "bufferMax": 2, "poolMin": 0, "poolMax": 2}}
    with srv.client() as api:
        assert api.post("/v1/pools", json=spec).status_code == 201
        _warm_up(api, name, 2)
    sandboxes = srv.data_dir / "sandboxes"
    for _ in range(2):
        srv.terminate()
        srv.start()
        with srv.client() as api:
            _warm_up(api, name, 2)
            time.sleep(2)  # a refill that started too early has made its extra ones by now
            st = _status(api, name)
            assert (st["available"], st["total"]) == (2, 2), st
        assert len(list(sandboxes.iterdir())) == 2, sorted(p.name for p in sandboxes.iterdir())
    with srv.client() as api:
        assert api.delete(f"/v1/pools/{name}").status_code == 204


@pytest.mark.timeout(180)
def test_creates_waiting_on_a_deleted_pool(server, api, test_image):
    """A create queued on an exhausted pool when the pool is deleted: one that merely matched the
    pool's template is made like any other create (it used to fail with 404 "pool not found"); one
    that named the pool with poolRef gets a 404 saying the pool was deleted while it waited."""
    import threading
    name = f"e2e-{uuid.uuid4().hex[:8]}"
    template = _template(test_image, uuid.uuid4().hex)
    spec = {"name": name, "template": template, "maxWaitSeconds": 60,
            "capacitySpec": {"bufferMin": 1, "bufferMax": 1, "poolMin": 0, "poolMax": 1}}
    assert api.post("/v1/pools", json=spec).status_code == 201
    ids = []
    try:
        _warm_up(api, name, 1)
        r = api.post("/v1/sandboxes", json=template)  # takes the pool's only sandbox
        assert r.status_code == 202, r.text
        ids.append(r.json()["id"])
        W.track_sandbox(ids[-1])

        results = {}

        def create(key, body):
            results[key] = api.post("/v1/sandboxes", json=body, timeout=90)

        waiters = [threading.Thread(target=create, args=("match", template)),
                   threading.Thread(target=create, args=("ref", {**template, "extensions": {"poolRef": name}}))]
        for t in waiters:
            t.start()
        time.sleep(1.5)  # both queue: the pool has nothing warm and may make no more
        assert all(t.is_alive() for t in waiters), {k: (v.status_code, v.text[:200]) for k, v in results.items()}
        assert api.delete(f"/v1/pools/{name}").status_code == 204
        for t in waiters:
            t.join(60)
        match, ref = results["match"], results["ref"]
        assert match.status_code == 202, match.text
        ids.append(match.json()["id"])
        W.track_sandbox(ids[-1])
        assert api.get(f"/v1/sandboxes/{ids[-1]}").json()["status"]["state"] == "Running"
        body = W.assert_error_body(ref, codes=[404])
        assert "deleted while this create waited" in body["message"], body
    finally:
        for i in ids:
            api.delete(f"/v1/sandboxes/{i}")
        api.delete(f"/v1/pools/{name}")
