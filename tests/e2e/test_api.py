"""Raw HTTP checks of the lifecycle API: auth, error bodies, bad input, unknown and deleted
sandboxes, readiness on create, clients that go away mid-request. Uses httpx directly, not the SDK."""

from __future__ import annotations

import concurrent.futures
import json
import os
import socket
import time
import uuid

import httpx
import pytest

import warren_e2e as W


def test_health_needs_no_key(server):
    r = httpx.get(f"{server.base_url}/health", timeout=10)
    assert r.status_code == 200
    assert r.json() == {"status": "healthy"} or r.json().get("status") == "healthy"


# What each runtime can do, as /health must report it. (The one place the suite names runtimes to
# choose what to expect: every other test chooses by what /health says, `server.caps`.)
_LOCAL = dict(egressAddresses=False, egressNames=False, hostVolumes="server")
CAPABILITIES = {
    "embedded": dict(snapshots=True, egressPolicy=True, diskBound=True, isolatedSessions=True,
                     imageSource="store", **_LOCAL),
    "runc": dict(snapshots=True, egressPolicy=True, diskBound=True, isolatedSessions=False,
                 imageSource="store", **_LOCAL),
    "runsc": dict(snapshots=False, egressPolicy=False, diskBound=False, isolatedSessions=False,
                  imageSource="store", **_LOCAL),
    "docker": dict(snapshots=False, egressPolicy=True, diskBound=False, isolatedSessions=False,
                   imageSource="engine", **_LOCAL),
    "docker-runsc": dict(snapshots=False, egressPolicy=False, diskBound=False, isolatedSessions=False,
                         imageSource="engine", **_LOCAL),
}


def _expected_userns(server) -> bool:
    """Whether its sandboxes should run in user namespaces of their own (the default of the
    embedded runtime and runc; `user_namespaces` in its `[runtime]` decides otherwise)."""
    if "user_namespaces = false" in server.runtime_config:
        return False
    return server.runtime in ("embedded", "runc") or "user_namespaces = true" in server.runtime_config


def test_health_reports_the_runtime_and_what_it_can_do(server, api):
    """/health says which runtime runs sandboxes and what it can do; the answers the server gives
    agree with it (a snapshot or a network policy where the runtime has none is refused). Native
    runtimes bound how many creates run at once by the server's CPUs and say how many; a Docker
    daemon has no such bound. /v1/health says the same, and the harness's `caps` are its answer."""
    info = httpx.get(f"{server.base_url}/health", timeout=10).json()["runtime"]
    docker = server.runtime.startswith("docker")
    assert info["kind"] == ("docker" if docker else "native"), info
    assert info["name"] == {"embedded": "native/embedded", "runc": "native/runc", "runsc": "native/runsc",
                            "docker": "docker", "docker-runsc": "docker/runsc"}[server.runtime], info
    caps = info["capabilities"]
    assert caps["execdTransport"] == "unix" and caps["pause"] is True, caps
    assert caps["userNamespaces"] is _expected_userns(server), caps
    expected = CAPABILITIES[server.runtime]
    assert {k: caps.get(k) for k in expected} == expected, caps
    if docker:
        assert "createParallelism" not in caps, caps
    else:
        assert isinstance(caps.get("createParallelism"), int) and caps["createParallelism"] >= 1, caps
    assert httpx.get(f"{server.base_url}/v1/health", timeout=10).json()["runtime"] == info
    assert W.Capabilities.from_health(info) == server.caps
    r = api.post("/v1/sandboxes", json=W.create_body(server.sandbox_image("host")))
    assert r.status_code == 202, r.text
    sid = r.json()["id"]
    W.track_sandbox(sid)
    try:
        snap = api.post(f"/v1/sandboxes/{sid}/snapshots", json={"name": "caps"})
        if caps["snapshots"]:
            assert snap.status_code in (200, 201, 202), snap.text
            api.delete(f"/v1/snapshots/{snap.json()['id']}")
        else:
            W.assert_error_body(snap, codes=[400, 501])
    finally:
        api.delete(f"/v1/sandboxes/{sid}")
    if not caps["egressPolicy"]:
        body = W.create_body(server.sandbox_image("host"))
        body["networkPolicy"] = {"defaultAction": "deny", "egress": [{"action": "allow", "target": "example.com"}]}
        W.assert_error_body(api.post("/v1/sandboxes", json=body), codes=[400])


def test_openapi_document(server):
    r = httpx.get(f"{server.base_url}/openapi.json", timeout=10)
    assert r.status_code == 200, r.text[:300]
    doc = r.json()
    assert "paths" in doc and doc["paths"], "openapi.json has no paths"
    paths = " ".join(doc["paths"])
    assert "/sandboxes" in paths


@pytest.mark.parametrize("page,viewer", [("docs", "SwaggerUIBundle"), ("redoc", "Redoc.init")])
def test_docs_pages(server, page, viewer):
    """/docs and /redoc beside /openapi.json, as the reference serves them: no key needed, the
    viewer pointed at the document, and every route indexed in the page itself (readable where the
    viewer's CDN cannot be reached, as on this machine)."""
    doc = httpx.get(f"{server.base_url}/openapi.json", timeout=10).json()
    for prefix in ("", "/v1"):
        r = httpx.get(f"{server.base_url}{prefix}/{page}", timeout=10)
        assert r.status_code == 200, r.text[:300]
        assert r.headers["content-type"].startswith("text/html")
        assert viewer in r.text and '"/openapi.json"' in r.text
        for path in doc["paths"]:
            assert f"<code>{path}</code>" in r.text, f"{path} is not in /{page}"


def test_missing_api_key(server):
    with server.client(api_key=None) as c:
        r = c.get("/v1/sandboxes")
    W.assert_error_body(r, codes=[401], code="MISSING_API_KEY")


def test_wrong_api_key(server):
    with server.client(api_key="wk-definitely-wrong") as c:
        r = c.get("/v1/sandboxes")
        W.assert_error_body(r, codes=[401], code="INVALID_API_KEY")
        r = c.post("/v1/sandboxes", json=W.create_body())
        W.assert_error_body(r, codes=[401], code="INVALID_API_KEY")


def test_request_id_and_unprefixed_routes(api):
    r = api.get("/v1/sandboxes")
    assert r.status_code == 200, r.text[:300]
    assert r.headers.get("X-Request-ID"), "responses must carry X-Request-ID"
    r = api.get("/v1/sandboxes", headers={"X-Request-ID": "e2e-req-123"})
    assert r.headers.get("X-Request-ID") == "e2e-req-123", "a client X-Request-ID should be echoed"
    body = r.json()
    assert isinstance(body.get("items"), list) and "pagination" in body
    r2 = api.get("/sandboxes")
    assert r2.status_code == 200, "routes must also be served without the /v1 prefix"


def test_metrics_events_accepted(api):
    r = api.post("/v1/metrics/events", json={
        "eventType": "sandbox.create", "sandboxId": "x", "image": "host",
        "createDurationMs": 12, "success": True})
    assert r.status_code == 204, r.text[:300]


def _ids(api) -> set[str]:
    r = api.get("/v1/sandboxes", params={"pageSize": 1000})
    assert r.status_code == 200
    return {i["id"] for i in r.json()["items"]}


def test_unknown_image(api):
    before = _ids(api)
    r = api.post("/v1/sandboxes", json=W.create_body("no-such-image-e2e:latest"))
    W.assert_error_body(r, codes=range(400, 500))
    assert r.status_code not in (401, 403)
    assert _ids(api) == before, "a failed create must not leave a sandbox behind"


@pytest.mark.parametrize("limits", [
    {"cpu": "1", "memory": "lots"},
    {"cpu": "many", "memory": "512Mi"},
    {"cpu": "1", "memory": "-5Gi"},
    {"cpu": "5m", "memory": "512Mi"},  # below the kernel's smallest quota: was a 500 from the runtime
    {"cpu": "1", "memory": "512Mi", "ephemeral-storage": "banana"},  # was accepted and ignored
    {"cpu": "1", "memory": "512Mi", "ephemeral-storage": "1Mi"},
], ids=["memory=lots", "cpu=many", "memory=negative", "cpu=below-10m", "disk=banana", "disk=1Mi"])
def test_bad_resource_limits(api, limits):
    before = _ids(api)
    r = api.post("/v1/sandboxes", json=W.create_body(resourceLimits=limits))
    W.assert_error_body(r, codes=[400])
    assert _ids(api) == before


@pytest.mark.parametrize("key", ["bad key!", "opensandbox.io/reserved", "-leading-dash"])
def test_bad_metadata_key(api, key):
    before = _ids(api)
    r = api.post("/v1/sandboxes", json=W.create_body(metadata={key: "v"}))
    W.assert_error_body(r, codes=[400])
    assert _ids(api) == before


def test_timeout_below_minimum(api):
    r = api.post("/v1/sandboxes", json=W.create_body(timeout=5))
    W.assert_error_body(r, codes=[400])


@pytest.mark.parametrize("payload", [
    b"{not json",
    b'{"image": {"uri": "host"}, "entrypoint": ["sh"], ',
    b"[1, 2, 3]",
    b'{"image": 42, "entrypoint": "not-a-list", "resourceLimits": {"cpu":"1","memory":"1Gi"}}',
], ids=["garbage", "truncated", "array", "wrong-types"])
def test_malformed_json(api, payload):
    before = _ids(api)
    r = api.post("/v1/sandboxes", content=payload, headers={"Content-Type": "application/json"})
    W.assert_error_body(r, codes=[400])
    assert _ids(api) == before


def test_oversized_body(api):
    big = {"k": "x" * (20 * 1024 * 1024)}
    r = api.post("/v1/sandboxes", content=json.dumps(W.create_body(env=big)).encode(),
                 headers={"Content-Type": "application/json"})
    W.assert_error_body(r, codes=[400, 413])


def test_get_unknown_sandbox(api):
    r = api.get("/v1/sandboxes/does-not-exist-e2e")
    W.assert_error_body(r, codes=[404])


def test_double_delete(api, raw_sandbox):
    sid = raw_sandbox()["id"]
    r1 = api.delete(f"/v1/sandboxes/{sid}")
    assert r1.status_code == 204, r1.text[:300]
    r2 = api.delete(f"/v1/sandboxes/{sid}")
    W.assert_error_body(r2, codes=[404])


def test_operations_on_deleted_sandbox(api, raw_sandbox):
    sid = raw_sandbox()["id"]
    assert api.delete(f"/v1/sandboxes/{sid}").status_code == 204
    future = W.rfc3339(W.utcnow().replace(microsecond=0) + __import__("datetime").timedelta(hours=1))
    calls = [
        ("POST", f"/v1/sandboxes/{sid}/pause", None),
        ("POST", f"/v1/sandboxes/{sid}/resume", None),
        ("POST", f"/v1/sandboxes/{sid}/renew-expiration", {"expiresAt": future}),
        ("GET", f"/v1/sandboxes/{sid}/endpoints/44772", None),
        ("PATCH", f"/v1/sandboxes/{sid}/metadata", {"a": "b"}),
    ]
    for method, path, body in calls:
        r = api.request(method, path, json=body)
        W.assert_error_body(r, codes=[404, 409, 410])
        if body is not None:
            # Refused with its body unread: the connection is not for reuse (the client's next
            # request on it would be lost when the server closes it).
            assert r.headers.get("connection") == "close", (path, r.headers)
    r = api.get(f"/v1/sandboxes/{sid}")
    W.assert_error_body(r, codes=[404])


def test_resume_running_and_pause_twice(api, raw_sandbox):
    sid = raw_sandbox()["id"]
    r = api.post(f"/v1/sandboxes/{sid}/resume")
    W.assert_error_body(r, codes=[409])
    assert api.post(f"/v1/sandboxes/{sid}/pause").status_code == 202
    W.wait_until(lambda: api.get(f"/v1/sandboxes/{sid}").json()["status"]["state"] == "Paused",
                 10, message="state Paused")
    r = api.post(f"/v1/sandboxes/{sid}/pause")
    W.assert_error_body(r, codes=[409])
    assert api.post(f"/v1/sandboxes/{sid}/resume").status_code == 202


def test_renew_into_the_past(api, raw_sandbox):
    sid = raw_sandbox()["id"]
    past = W.rfc3339(W.utcnow() - __import__("datetime").timedelta(minutes=5))
    r = api.post(f"/v1/sandboxes/{sid}/renew-expiration", json={"expiresAt": past})
    W.assert_error_body(r, codes=[400])
    r = api.post(f"/v1/sandboxes/{sid}/renew-expiration", json={"expiresAt": "tomorrow"})
    W.assert_error_body(r, codes=[400])


def test_state_filters_take_every_state_the_clients_know(api, raw_sandbox):
    """A state the reference's models define but no sandbox here is in (`Allocated`, `Unknown`)
    filters to nothing, with or beside a real one; a name nobody defines is a 400."""
    sid = raw_sandbox()["id"]
    ids = lambda params: {i["id"] for i in api.get("/v1/sandboxes", params=params).json()["items"]}  # noqa: E731
    assert ids({"state": "Allocated", "pageSize": 200}) == set()
    assert ids({"state": "unknown", "pageSize": 200}) == set()
    assert sid in ids({"state": "Allocated,Running", "pageSize": 200})
    assert sid not in ids({"state": "Paused", "pageSize": 200})
    W.assert_error_body(api.get("/v1/sandboxes", params={"state": "Sleeping"}), codes=[400])


def test_bad_metadata_filter_and_paging(api):
    r = api.get("/v1/sandboxes", params={"page": 0})
    W.assert_error_body(r, codes=[400])
    r = api.get("/v1/sandboxes", params={"pageSize": "abc"})
    W.assert_error_body(r, codes=[400])


def test_ready_means_ready(server, api, raw_sandbox):
    """Create returns 202 only once execd answers: the very first /ping
    through the returned endpoint must succeed."""
    sid = raw_sandbox()["id"]
    r = api.get(f"/v1/sandboxes/{sid}/endpoints/44772", params={"use_server_proxy": "false"})
    assert r.status_code == 200, r.text[:300]
    ep = r.json()
    assert "://" not in ep["endpoint"], "endpoint must not carry a scheme"
    ping = httpx.get(f"http://{ep['endpoint']}/ping", headers=ep.get("headers") or {}, timeout=10)
    assert ping.status_code == 200, f"first ping after create failed: {ping.status_code} {ping.text[:200]}"


def test_proxy_requires_endpoint_token(server, api, raw_sandbox):
    sid = raw_sandbox()["id"]
    ep = api.get(f"/v1/sandboxes/{sid}/endpoints/44772").json()
    url = f"http://{ep['endpoint']}/ping"
    headers = ep.get("headers") or {}
    assert headers, "endpoints on Warren's listener must come with a per-sandbox token header"
    assert httpx.get(url, headers=headers, timeout=10).status_code == 200
    r = httpx.get(url, timeout=10)
    W.assert_error_body(r, codes=[401])
    bad = {k: "wrong-token" for k in headers}
    r = httpx.get(url, headers=bad, timeout=10)
    W.assert_error_body(r, codes=[401])
    # the API key is accepted instead of the token (SDK use_server_proxy mode)
    r = httpx.get(url, headers={"OPEN-SANDBOX-API-KEY": server.api_key}, timeout=10)
    assert r.status_code == 200
    # a token for one sandbox does not open another
    other = raw_sandbox()["id"]
    ep2 = api.get(f"/v1/sandboxes/{other}/endpoints/44772").json()
    r = httpx.get(f"http://{ep2['endpoint']}/ping", headers=headers, timeout=10)
    if (ep2.get("headers") or {}) != headers:
        W.assert_error_body(r, codes=[401, 403])


def test_client_disconnect_mid_stream(server, api, raw_sandbox):
    """A client that hangs up mid-stream does not hurt the server or sandbox."""
    sid = raw_sandbox()["id"]
    ep = api.get(f"/v1/sandboxes/{sid}/endpoints/44772").json()
    base = f"http://{ep['endpoint']}"
    headers = ep.get("headers") or {}
    with httpx.Client(headers=headers, timeout=httpx.Timeout(10, read=10)) as c:
        with c.stream("POST", f"{base}/command",
                      json={"command": "for i in $(seq 1 200); do echo tick$i; sleep 0.05; done"},
                      headers={"Accept": "text/event-stream"}) as resp:
            assert resp.status_code == 200
            for chunk in resp.iter_bytes():
                if b"tick" in chunk:
                    break
        # connection closed here, command still running
    time.sleep(0.5)
    assert httpx.get(f"{server.base_url}/health", timeout=5).status_code == 200
    with httpx.Client(headers=headers, timeout=30) as c:
        r = c.post(f"{base}/command", json={"command": "echo still-alive"},
                   headers={"Accept": "text/event-stream"})
        assert r.status_code == 200 and "still-alive" in r.text, r.text[:500]


def test_client_gone_mid_create(server, api):
    """Creates whose clients hang up (an SDK timeout, Ctrl-C) before the answer: each one that
    reached the server still ends as a Running sandbox that is listed, answers and can be deleted.
    None stays Pending (a create dropped while it waited for a slot or for the runtime did, before:
    never expiring, and sometimes with a running sandbox nobody watched). The leak check at the end
    of the suite covers what deleting them leaves."""
    marker = uuid.uuid4().hex
    body = json.dumps(W.create_body(server.sandbox_image("host"), timeout=300,
                                    metadata={"e2e-gone": marker})).encode()
    host, port = server.domain.rsplit(":", 1)
    request = (f"POST /v1/sandboxes HTTP/1.1\r\nHost: {server.domain}\r\n"
               f"OPEN-SANDBOX-API-KEY: {server.api_key}\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(body)}\r\n\r\n").encode() + body
    # More at once than the server creates in parallel (the CPU count, 2 here), so most wait for a
    # slot when their clients leave. (30 took a minute of the suite on gVisor, for nothing more.)
    conns = [socket.create_connection((host, int(port)), timeout=10) for _ in range(12)]
    for c in conns:
        c.sendall(request)
    time.sleep(0.01)
    for c in conns:
        c.close()

    def ours() -> list[dict]:
        r = api.get("/v1/sandboxes", params={"metadata": f"e2e-gone={marker}", "pageSize": 100})
        assert r.status_code == 200, r.text
        items = r.json()["items"]
        for i in items:
            W.track_sandbox(i["id"])
        return items

    try:
        settled = W.wait_until(
            lambda: (lambda items: items if items and all(
                i["status"]["state"] != "Pending" for i in items) else None)(ours()),
            120, interval=0.5, message="every abandoned create to leave Pending")
        assert [i["status"]["state"] for i in settled] == ["Running"] * len(settled), settled
        ep = api.get(f"/v1/sandboxes/{settled[0]['id']}/endpoints/44772").json()
        r = httpx.get(f"http://{ep['endpoint']}/ping", headers=ep.get("headers") or {}, timeout=30)
        assert r.status_code == 200, r.text
    finally:
        def delete(sid: str) -> int:
            with server.client() as c:  # a client per thread
                return c.delete(f"/v1/sandboxes/{sid}").status_code
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            codes = list(pool.map(delete, [i["id"] for i in ours()]))
        assert all(c in (204, 404) for c in codes), codes


def test_execd_stream_format(server, api, raw_sandbox):
    """Each event is single-line JSON with an int ms timestamp; a non-zero
    exit ends with an `error` event whose evalue is the exit code; the
    stream is properly terminated (reference §3.2)."""
    sid = raw_sandbox()["id"]
    ep = api.get(f"/v1/sandboxes/{sid}/endpoints/44772").json()
    with httpx.Client(headers=ep.get("headers") or {}, timeout=30) as c:
        r = c.post(f"http://{ep['endpoint']}/command", json={"command": "echo out; echo err >&2; exit 4"},
                   headers={"Accept": "text/event-stream"})
    assert r.status_code == 200
    events = []
    for line in r.text.splitlines():
        line = line.strip()
        if not line:
            continue
        if line.startswith("data:"):
            line = line[5:].strip()
        ev = json.loads(line)
        assert isinstance(ev.get("timestamp"), int) and ev["timestamp"] > 1_600_000_000_000, ev
        events.append(ev)
    types = [e["type"] for e in events if e["type"] != "ping"]
    assert types[0] == "init"
    assert "stdout" in types and "stderr" in types
    assert types[-1] == "error", types
    assert events[-1]["error"]["evalue"] == "4"
    assert "execution_complete" not in types


def test_a_full_data_dir_refuses_creates_cleanly(server, work_root):
    """With the data dir's filesystem full (here a sandbox filled it), a create or a snapshot
    answers 507 SANDBOX::INSUFFICIENT_STORAGE with the numbers, before making anything; once there
    is room again creates work. Creates used to fail half-way with a 500 "execd exited during start: no
    output" (execd could not make its socket, nor the log say why)."""
    import subprocess
    from opensandbox import SandboxSync

    # (A Docker sandbox writes into Docker's storage, and gVisor keeps a sandbox's root writes in
    # its own overlay: neither in Warren's data dir.)
    server.require("snapshots", "a sandbox's root writes land in its writable layer in Warren's data "
                                "dir, and a snapshot copies that layer")
    server.require_image_store("creates on the built-in host image")
    srv = W.WarrenServer(server.runtime, work_root, f"full-{uuid.uuid4().hex[:6]}")
    srv.data_dir.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=160m", "tmpfs", str(srv.data_dir)], check=True)
    try:
        srv.start()
        with srv.client() as api:
            filler = SandboxSync.create(srv.sandbox_image("host"), connection_config=srv.sdk_config())
            W.track_sandbox(filler.id)
            try:
                # The filler's own disk is thin (10 GiB over a 160 MiB data dir) and its overlay
                # volatile (fsync is a no-op): its writes reach the data dir at writeback, forced
                # here, and fail there once it is full; that sandbox alone sees I/O errors.
                W.sh(filler, "dd if=/dev/zero of=/tmp/fill bs=1M count=400")
                os.sync()
                r = api.post("/v1/sandboxes", json=W.create_body())
                W.assert_error_body(r, codes=[507])
                assert r.json()["code"] == "SANDBOX::INSUFFICIENT_STORAGE", r.text
                assert "no room for a sandbox" in r.json()["message"] and str(srv.data_dir) in r.json()["message"], r.text
                assert [i["id"] for i in api.get("/v1/sandboxes").json()["items"]] == [filler.id]
                assert sorted(os.listdir(srv.data_dir / "sandboxes")) == [filler.id]
                r = api.post(f"/v1/sandboxes/{filler.id}/snapshots", json={})
                W.assert_error_body(r, codes=[507])
                assert "no room for a snapshot" in r.json()["message"], r.text
                assert api.get("/v1/snapshots").json()["items"] == []

                code, _, _ = W.sh(filler, "rm /tmp/fill")
                assert code == 0
                r = api.post("/v1/sandboxes", json=W.create_body())
                assert r.status_code == 202, r.text
                W.track_sandbox(r.json()["id"])
            finally:
                filler.close()
    finally:
        srv.stop()
        subprocess.run(["umount", str(srv.data_dir)], check=False)
