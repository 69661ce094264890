"""Tenants on one Warren: keys that belong to tenants, made and revoked without a restart
(the admin API and `warren key`), roles (admin, full, read-only), and a tenant that sees and
touches only its own sandboxes, pools, snapshots and named volumes — another tenant's answering
exactly as a missing one — driven through the official SDK with each tenant's key. Tenancy lives
in the server, not the runtime: one runtime (the embedded one) is enough."""

from __future__ import annotations

import json
import re
import subprocess
import uuid
from datetime import timedelta

import httpx
import pytest

import warren_e2e as W

KEY = "OPEN-SANDBOX-API-KEY"


@pytest.fixture(scope="module")
def srv(work_root):
    s = W.WarrenServer("embedded", work_root, f"tenants-{uuid.uuid4().hex[:6]}")
    # One tenant with quotas; the others have none (no [quotas.default]). Host routing on
    # `*.localhost:PORT`, reached by sending the Host header to loopback (as test_browser_endpoints).
    port = W.free_port()
    s.more_config = ('[quotas.tenants.capped]\nsandboxes = 2\ncpu = "1"\nmemory = "1Gi"\n'
                     'creates_per_minute = 3\n'
                     '[quotas.tenants.snapcap]\nsnapshot_storage = "3Mi"\n'
                     '[quotas.tenants.nosnap]\nsnapshot_storage = "0"\n'
                     f'[endpoints]\ndomain = "localhost:{port}"\n')
    s.check_binary()
    s.start(port=port)
    yield s
    s.stop()


def _admin(srv, method, path, **kw) -> httpx.Response:
    return httpx.request(method, f"{srv.base_url}/v1{path}", headers={KEY: srv.api_key}, timeout=60, **kw)


def _as(srv, key, method, path, **kw) -> httpx.Response:
    headers = {KEY: key, **kw.pop("headers", {})}
    return httpx.request(method, f"{srv.base_url}/v1{path}", headers=headers, timeout=60, **kw)


def _key(srv, tenant, role="full") -> str:
    r = _admin(srv, "POST", "/admin/keys", json={"tenant": tenant, "role": role, "name": f"e2e-{role}"})
    assert r.status_code == 201, r.text
    body = r.json()
    assert body["tenant"] == tenant and body["role"] == role and body["key"].startswith("wk_"), body
    return body["key"]


def _sdk(srv, key):
    from opensandbox.config import ConnectionConfigSync
    return ConnectionConfigSync(domain=srv.domain, api_key=key, request_timeout=timedelta(seconds=60))


def _create(srv, key, **kw):
    from opensandbox import SandboxSync
    sbx = SandboxSync.create("host", connection_config=_sdk(srv, key), timeout=timedelta(minutes=10),
                             ready_timeout=timedelta(seconds=60), **kw)
    W.track_sandbox(sbx.id)
    return sbx


def _kill_all(sandboxes) -> None:
    for s in sandboxes:
        try:
            s.kill()
        except Exception:  # noqa: BLE001 - already gone
            pass
        s.close()


def _same_as_missing(srv, key, method, path_of, real_id, **kw):
    """`real_id` (another tenant's) answers exactly as an id that never existed."""
    missing = "0" * len(real_id)
    a = _as(srv, key, method, path_of(real_id), **kw)
    b = _as(srv, key, method, path_of(missing), **kw)
    assert a.status_code == b.status_code, (path_of(real_id), a.status_code, a.text, b.status_code, b.text)
    assert a.status_code in (404, 401), (a.status_code, a.text)
    assert json.loads(a.text.replace(real_id, missing)) == b.json(), (a.text, b.text)


def test_each_tenant_sees_and_touches_only_its_own_sandboxes(srv):
    acme, globex = _key(srv, "acme"), _key(srv, "globex")
    a, g = _create(srv, acme, metadata={"who": "acme"}), _create(srv, globex, metadata={"who": "globex"})
    try:
        # Lists: each its own; the server's own key (the default tenant's admin) all, or one
        # tenant's when it names it.
        ids = lambda key, **kw: {s["id"] for s in _as(srv, key, "GET", "/sandboxes", **kw).json()["items"]}  # noqa: E731
        assert ids(acme) == {a.id} and ids(globex) == {g.id}
        assert {a.id, g.id} <= ids(srv.api_key)
        assert ids(srv.api_key, headers={"X-Warren-Tenant": "acme"}) == {a.id}
        # A tenant's key names only its own tenant.
        r = _as(srv, acme, "GET", "/sandboxes", headers={"X-Warren-Tenant": "globex"})
        W.assert_error_body(r, codes=[403])

        # Every route under the other tenant's sandbox answers as for a sandbox that never was.
        for method, path, kw in [
            ("GET", lambda i: f"/sandboxes/{i}", {}),
            ("DELETE", lambda i: f"/sandboxes/{i}", {}),
            ("GET", lambda i: f"/sandboxes/{i}/endpoints/8080", {}),
            ("POST", lambda i: f"/sandboxes/{i}/renew-expiration",
             {"json": {"expiresAt": W.rfc3339(W.utcnow() + timedelta(hours=1))}}),
            ("PATCH", lambda i: f"/sandboxes/{i}/metadata", {"json": {"who": "acme"}}),
            ("GET", lambda i: f"/sandboxes/{i}/networkpolicy", {}),
            ("POST", lambda i: f"/sandboxes/{i}/pause", {}),
            ("GET", lambda i: f"/sandboxes/{i}/diagnostics/logs", {}),
            ("POST", lambda i: f"/sandboxes/{i}/snapshots", {}),
            # The endpoint proxy with a key opens only that key's tenant's sandboxes.
            ("POST", lambda i: f"/sandboxes/{i}/proxy/44772/command", {"json": {"command": "touch /tmp/pwned"}}),
            ("GET", lambda i: f"/sandboxes/{i}/proxy/44772/ping", {}),
        ]:
            _same_as_missing(srv, acme, method, path, g.id, **kw)
        # A percent-encoded id names the same sandbox to the route: hidden just the same.
        encoded = "".join(f"%{ord(c):02X}" for c in g.id)
        for method, path in [("DELETE", f"/sandboxes/{encoded}"), ("GET", f"/sandboxes/{encoded}/endpoints/44772")]:
            r = _as(srv, acme, method, path)
            W.assert_error_body(r, codes=[404])
        # A read-only key gets no endpoint: its token would open the port.
        # (see test_a_read_only_key_reads_and_does_nothing_else)
        # globex's sandbox is untouched, and still its own.
        code, out, _ = W.sh(g, "test -e /tmp/pwned && echo pwned || echo clean")
        assert out.strip() == "clean"
        assert _as(srv, globex, "GET", f"/sandboxes/{g.id}").json()["metadata"] == {"who": "globex"}
        # Its own key opens its own, through the proxy too.
        r = _as(srv, acme, "GET", f"/sandboxes/{a.id}/proxy/44772/ping")
        assert r.status_code == 200, r.text
    finally:
        for s in (a, g):
            s.kill()
            s.close()


def test_a_read_only_key_reads_and_does_nothing_else(srv):
    full, ro = _key(srv, "initech"), _key(srv, "initech", "read-only")
    sbx = _create(srv, full)
    try:
        assert _as(srv, ro, "GET", f"/sandboxes/{sbx.id}").status_code == 200
        assert {s["id"] for s in _as(srv, ro, "GET", "/sandboxes").json()["items"]} == {sbx.id}
        for method, path, kw in [("POST", "/sandboxes", {"json": W.create_body("host")}),
                                 ("DELETE", f"/sandboxes/{sbx.id}", {}),
                                 ("POST", "/pools", {"json": {"name": "p"}}),
                                 ("POST", "/admin/keys", {"json": {"tenant": "initech", "role": "admin"}})]:
            r = _as(srv, ro, method, path, **kw)
            W.assert_error_body(r, codes=[403])
        # Not a command either, through the SDK or the proxy (a read-only key is no key there).
        r = _as(srv, ro, "POST", f"/sandboxes/{sbx.id}/proxy/44772/command", json={"command": "true"})
        W.assert_error_body(r, codes=[401])
        assert _as(srv, ro, "GET", "/admin/keys").status_code == 403
        W.assert_error_body(_as(srv, ro, "GET", f"/sandboxes/{sbx.id}/endpoints/44772"), codes=[403])
    finally:
        sbx.kill()
        sbx.close()


def test_keys_are_revoked_and_rotated_at_once_by_the_api_and_the_cli(srv):
    key = _key(srv, "umbrella")
    kid = key.split("_")[1]
    assert _as(srv, key, "GET", "/sandboxes").status_code == 200
    # Rotated: the old text stops, the new one works, same tenant.
    r = _admin(srv, "POST", f"/admin/keys/{kid}/rotate")
    assert r.status_code == 200, r.text
    new = r.json()["key"]
    W.assert_error_body(_as(srv, key, "GET", "/sandboxes"), codes=[401])
    assert _as(srv, new, "GET", "/sandboxes").status_code == 200
    # Revoked through the API: refused on the next request, no restart.
    assert _admin(srv, "DELETE", f"/admin/keys/{kid}").status_code == 200
    W.assert_error_body(_as(srv, new, "GET", "/sandboxes"), codes=[401])
    listed = {k["id"]: k for k in _admin(srv, "GET", "/admin/keys").json()["items"]}
    assert listed[kid]["revokedAt"] and "secretSha256" not in json.dumps(listed)

    # `warren key` on the running server's data dir: made and revoked there, seen at once.
    cli = lambda *a: subprocess.run([str(srv.bin), "key", *a, "--data-dir", str(srv.data_dir)],  # noqa: E731
                                    capture_output=True, text=True, timeout=30)
    made = cli("create", "umbrella", "--role", "full", "-o", "json")
    assert made.returncode == 0, made.stderr
    text = json.loads(made.stdout)["key"]
    assert _as(srv, text, "GET", "/sandboxes").status_code == 200
    gone = cli("revoke", text.split("_")[1])
    assert gone.returncode == 0, gone.stderr
    W.assert_error_body(_as(srv, text, "GET", "/sandboxes"), codes=[401])
    # Hashed at rest: no key's text is in the data dir's key store or the server's log.
    stored = (srv.data_dir / "keys.json").read_text()
    for t in (key, new, text):
        assert t.split("_")[2] not in stored
        assert t not in srv.log_path.read_text()


def test_pools_snapshots_and_named_volumes_are_the_tenant_s_own(srv):
    acme, globex = _key(srv, "acme2"), _key(srv, "globex2")
    pool = {"name": "warm", "template": W.create_body("host"), "capacitySpec": {"bufferMax": 1, "bufferMin": 1, "poolMin": 0, "poolMax": 2}}
    made = []
    try:
        # One pool name, two tenants: two pools; each sees its own.
        for key in (acme, globex):
            r = _as(srv, key, "POST", "/pools", json=pool)
            assert r.status_code == 201, r.text
        assert [p["name"] for p in _as(srv, acme, "GET", "/pools").json()["items"]] == ["warm"]
        W.wait_until(lambda: _as(srv, acme, "GET", "/pools/warm").json()["status"]["available"] == 1, 30,
                     message="acme's pool to be warm")
        # A create from a pool is served by the caller's own pool, and the sandbox is the caller's.
        from opensandbox import SandboxSync
        sbx = SandboxSync.create("host", connection_config=_sdk(srv, acme), extensions={"poolRef": "warm"},
                                 timeout=timedelta(minutes=10), ready_timeout=timedelta(seconds=60))
        made.append(sbx)
        assert _as(srv, globex, "GET", f"/sandboxes/{sbx.id}").status_code == 404
        assert _as(srv, acme, "GET", "/pools/warm").json()["status"]["allocated"] == 1
        assert _as(srv, globex, "GET", "/pools/warm").json()["status"]["allocated"] == 0

        # Named volumes: one claimName, two tenants, two volumes.
        vol = [{"name": "d", "pvc": {"claimName": "shared", "createIfNotExists": True}, "mountPath": "/data"}]
        for key, word in ((acme, "acme"), (globex, "globex")):
            r = _as(srv, key, "POST", "/sandboxes", json=W.create_body("host", volumes=vol))
            assert r.status_code == 202, r.text
            sid = r.json()["id"]
            W.track_sandbox(sid)
            c = SandboxSync.connect(sid, connection_config=_sdk(srv, key))
            made.append(c)
            code, out, _ = W.sh(c, f"cat /data/who 2>/dev/null; echo {word} > /data/who")
            assert out.strip() == "", f"{word} found another tenant's file: {out!r}"

        # Snapshots: another tenant's is missing, for reading, deleting and restoring.
        srv.import_image(W.TEST_IMAGE_NAME, W.test_rootfs())
        src = SandboxSync.create(W.TEST_IMAGE_NAME, connection_config=_sdk(srv, acme),
                                 timeout=timedelta(minutes=10), ready_timeout=timedelta(seconds=60))
        made.append(src)
        r = _as(srv, acme, "POST", f"/sandboxes/{src.id}/snapshots", json={"name": "s"})
        assert r.status_code == 202, r.text
        snap = r.json()["id"]
        def ready():
            st = _as(srv, acme, "GET", f"/snapshots/{snap}").json()["status"]
            assert st["state"] != "Failed", st
            return st["state"] == "Ready"
        W.wait_until(ready, 60, message="the snapshot")
        _same_as_missing(srv, globex, "GET", lambda i: f"/snapshots/{i}", snap)
        _same_as_missing(srv, globex, "DELETE", lambda i: f"/snapshots/{i}", snap)
        assert _as(srv, globex, "GET", "/snapshots").json()["items"] == []
        body = W.create_body(W.TEST_IMAGE_NAME)
        body.pop("image")
        r = _as(srv, globex, "POST", "/sandboxes", json={**body, "snapshotId": snap})
        W.assert_error_body(r, codes=[404])
        assert _as(srv, acme, "GET", f"/snapshots/{snap}").status_code == 200
        # Another tenant's pool is missing too.
        r = _as(srv, acme, "POST", "/pools", json={**pool, "name": "only-acme",
                                                   "capacitySpec": {"bufferMax": 0, "bufferMin": 0, "poolMin": 0, "poolMax": 1}})
        assert r.status_code == 201, r.text
        for method in ("GET", "DELETE"):
            _same_as_missing(srv, globex, method, lambda i: f"/pools/{i}", "only-acme")
        assert _as(srv, acme, "GET", "/pools/only-acme").status_code == 200
    finally:
        _kill_all(made)
        for key in (acme, globex):
            _as(srv, key, "DELETE", "/pools/warm")
        _as(srv, acme, "DELETE", "/pools/only-acme")


def test_a_tenant_s_quotas_refuse_what_passes_them_and_nothing_is_left(srv):
    capped, free = _key(srv, "capped"), _key(srv, "uncapped")
    body = lambda cpu: W.create_body("host", resourceLimits={"cpu": cpu, "memory": "256Mi"})  # noqa: E731
    made = []

    def create(cpu):
        r = _as(srv, capped, "POST", "/sandboxes", json=body(cpu))
        if r.status_code == 202:
            made.append(r.json()["id"])
            W.track_sandbox(r.json()["id"])
        return r

    def listed():
        return {s["id"] for s in _as(srv, capped, "GET", "/sandboxes").json()["items"]}

    try:
        assert create("400m").status_code == 202 and create("400m").status_code == 202
        r = create("100m")
        W.assert_error_body(r, codes=[403])
        assert r.json()["code"] == "QUOTA_EXCEEDED" and "quota sandboxes" in r.json()["message"], r.text
        assert listed() == set(made)
        # What it uses, and may.
        u = _as(srv, capped, "GET", "/usage").json()
        assert u["tenant"] == "capped" and u["sandboxes"] == 2 and u["cpuMillis"] == 800, u
        assert u["quota"] == {"sandboxes": 2, "cpuMillis": 1000, "memoryBytes": 1 << 30, "createsPerMinute": 3,
                              "snapshotBytes": None}, u
        # CPU in total: 400m + 700m is over 1.
        assert _as(srv, capped, "DELETE", f"/sandboxes/{made.pop()}").status_code == 204
        r = create("700m")
        W.assert_error_body(r, codes=[403])
        assert "quota cpu" in r.json()["message"], r.text
        # A third create this minute passes; a fourth waits, told how long.
        assert create("600m").status_code == 202
        for sid in list(made):
            assert _as(srv, capped, "DELETE", f"/sandboxes/{sid}").status_code == 204
            made.remove(sid)
        r = create("100m")
        W.assert_error_body(r, codes=[429])
        assert "creates_per_minute" in r.json()["message"], r.text
        assert 1 <= int(r.headers["Retry-After"]) <= 60, r.headers
        # The official SDK surfaces it as the rate limit it is.
        from opensandbox.exceptions.sandbox import SandboxRateLimitException
        with pytest.raises(SandboxRateLimitException):
            _create(srv, capped, resource={"cpu": "100m", "memory": "256Mi"})
        assert listed() == set()
        # Another tenant is not held by them.
        other = _as(srv, free, "POST", "/sandboxes", json=body("2"))
        assert other.status_code == 202, other.text
        made.append(other.json()["id"])
        assert _as(srv, free, "GET", "/usage").json()["quota"]["sandboxes"] is None
    finally:
        for sid in made:
            _admin(srv, "DELETE", f"/sandboxes/{sid}")


def test_snapshot_storage_is_a_tenant_s_quota_and_usage_shows_it(srv):
    """A tenant's snapshots may take so much of the image store: a capture that would pass it ends
    Failed (`quota_exceeded`) with its layer removed; with the quota reached (here: none at all),
    a snapshot is refused at once with 403 naming the quota. `GET /v1/usage` and `warren usage`
    report the bytes."""
    from opensandbox import SandboxSync
    key, none = _key(srv, "snapcap"), _key(srv, "nosnap")
    srv.import_image(W.TEST_IMAGE_NAME, W.test_rootfs())
    made = []
    try:
        for k in (key, none):
            made.append(SandboxSync.create(W.TEST_IMAGE_NAME, connection_config=_sdk(srv, k),
                                           timeout=timedelta(minutes=10), ready_timeout=timedelta(seconds=60)))
            W.track_sandbox(made[-1].id)
        src, other = made
        # 2 MiB that do not compress away.
        code, _, err = W.sh(src, "head -c 2097152 /dev/urandom > /tmp/blob && sync")
        assert code == 0, err

        def snapshot(k, sid):
            r = _as(srv, k, "POST", f"/sandboxes/{sid}/snapshots", json={})
            assert r.status_code == 202, r.text
            snap = r.json()["id"]
            return W.wait_until(lambda: (st := _as(srv, k, "GET", f"/snapshots/{snap}").json()["status"])["state"]
                                in ("Ready", "Failed") and (snap, st), 60, message="the capture to end")

        first, st = snapshot(key, src.id)
        assert st["state"] == "Ready", st
        usage = _as(srv, key, "GET", "/usage").json()
        assert usage["quota"]["snapshotBytes"] == 3 << 20, usage
        assert 2 << 20 <= usage["snapshotBytes"] < 3 << 20, usage
        # The same 2 MiB again would pass 3 MiB: Failed, and nothing of it is kept.
        second, st = snapshot(key, src.id)
        assert st["state"] == "Failed" and st["reason"] == "quota_exceeded", st
        assert st["message"].startswith("quota snapshot_storage:"), st
        assert _as(srv, key, "GET", "/usage").json()["snapshotBytes"] == usage["snapshotBytes"]
        images = subprocess.run([str(srv.bin), "image", "ls", "--data-dir", str(srv.data_dir), "-o", "json"],
                                capture_output=True, text=True, timeout=30)
        assert images.returncode == 0, images.stderr
        assert second not in images.stdout and first in images.stdout, images.stdout
        # A quota of 0: refused before any capture, 403 naming it.
        r = _as(srv, none, "POST", f"/sandboxes/{other.id}/snapshots", json={})
        body = W.assert_error_body(r, codes=[403], code="QUOTA_EXCEEDED")
        assert "snapshot_storage" in body["message"], body
        assert [s["id"] for s in _as(srv, none, "GET", "/snapshots").json()["items"]] == []
        # Deleting the first frees its share; `warren usage` says so too.
        assert _as(srv, key, "DELETE", f"/snapshots/{first}").status_code == 204
        audited = [json.loads(x) for x in (srv.data_dir / "audit" / "audit.jsonl").read_text().splitlines()]
        assert any(e["action"] == "DELETE /snapshots/{id}" and e.get("object") == first and e["tenant"] == "snapcap"
                   for e in audited), audited[-3:]
        out = subprocess.run([str(srv.bin), "usage", "--domain", srv.domain, "--api-key", key, "-o", "json"],
                             capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        shown = json.loads(out.stdout)
        assert shown["tenant"] == "snapcap" and shown["snapshotBytes"] == 0, shown
        table = subprocess.run([str(srv.bin), "usage", "--domain", srv.domain, "--api-key", srv.api_key,
                                "--tenant", "snapcap"], capture_output=True, text=True, timeout=30)
        assert table.returncode == 0 and "snapshot storage" in table.stdout and "3.0 MiB" in table.stdout, table
    finally:
        _kill_all(made)


def test_the_audit_log_keeps_who_did_what_and_no_secret(srv):
    key = _key(srv, "audited")
    sbx = _create(srv, key, env={"TOKEN": "s3cr3t-env"}, metadata={"note": "m3ta-value"})
    W.sh(sbx, "echo c0mmand-text > /dev/null")
    sbx.kill()
    sbx.close()
    bad = httpx.post(f"{srv.base_url}/v1/sandboxes", headers={KEY: "wk_000000000000_nope"},
                     json=W.create_body("host"), timeout=30)
    assert bad.status_code == 401

    def audit(*args):
        out = subprocess.run([str(srv.bin), "audit", "--data-dir", str(srv.data_dir), "-o", "json", *args],
                             capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    mine = audit("--tenant", "audited", "--since", "10m")
    actions = [(e["action"], e["sandbox"], e["status"]) for e in mine]
    assert ("POST /sandboxes", sbx.id, 202) in actions, actions
    assert ("DELETE /sandboxes/{id}", sbx.id, 204) in actions, actions
    # The command went through the endpoint proxy with the sandbox's token: kept, as the tenant's.
    proxied = [e for e in mine if e["action"] == "proxy 44772"]
    assert proxied and all(e["keyId"] == "endpoint-token" for e in proxied), mine
    assert all(e["requestId"] and e["client"].startswith("127.0.0.1:") for e in mine), mine
    assert {e["sandbox"] for e in audit("--sandbox", sbx.id)} == {sbx.id}
    # A valid key's refused call is that key's: another tenant's sandbox (404) and a write with a
    # read-only key (403) are audited with the key's tenant, not as anonymous.
    other = _key(srv, "audited-other")
    reader = _key(srv, "audited", "read-only")
    r = httpx.delete(f"{srv.base_url}/v1/sandboxes/{sbx.id}", headers={KEY: other}, timeout=30)
    assert r.status_code == 404, r.text
    r = httpx.post(f"{srv.base_url}/v1/sandboxes", headers={KEY: reader}, json=W.create_body("host"), timeout=30)
    assert r.status_code == 403, r.text
    recent = audit("--since", "10m")
    assert any(e["status"] == 404 and e["tenant"] == "audited-other" and e["keyId"] and e["sandbox"] == sbx.id
               for e in recent), [e for e in recent if e["status"] == 404]
    assert any(e["status"] == 403 and e["tenant"] == "audited" and e["action"] == "POST /sandboxes"
               for e in recent), [e for e in recent if e["status"] == 403]
    # A refused key is kept too, with no tenant.
    assert any(e["status"] == 401 and e["tenant"] is None and e["action"] == "POST /sandboxes"
               for e in audit("--since", "10m")), "the refused create is not in the log"
    # Never a body, a key or a command.
    text = "".join(p.read_text() for p in (srv.data_dir / "audit").iterdir())
    for secret in ("s3cr3t-env", "m3ta-value", "c0mmand-text", key, "nope"):
        assert secret not in text, secret


def test_osb_and_the_mcp_server_see_only_their_key_s_tenant(srv, tmp_path):
    """The official `osb` CLI (PyPI opensandbox-cli) and MCP server (PyPI opensandbox-mcp), each
    given one tenant's key as test_official_clients.py gives them the server's (flags): one tenant's
    sandbox is invisible to the other's clients — listed nowhere, and get, kill, connect, a command
    or a file read on its id fail exactly as on an id that never was — while each works on its own;
    a revoked key is refused as an authentication failure."""
    import asyncio
    import sys
    from pathlib import Path

    from mcp import ClientSession, StdioServerParameters
    from mcp.client.stdio import stdio_client

    bindir = Path(sys.executable).parent
    hooli, vandelay = _key(srv, "hooli"), _key(srv, "vandelay")

    def osb(key, *args, check=True):
        home = tmp_path / key.split("_")[1]  # a private HOME per key: osb keeps its config there
        home.mkdir(exist_ok=True)
        res = subprocess.run([str(bindir / "osb"), "--domain", srv.domain, "--api-key", key, "--no-color", *args],
                             capture_output=True, text=True, timeout=60,
                             env={"PATH": "/usr/bin:/bin", "HOME": str(home), "NO_COLOR": "1"})
        if check:
            assert res.returncode == 0, f"{args}: exit {res.returncode}\n{res.stdout}\n{res.stderr}"
        return res

    def listed(key):
        return {s["id"] for s in json.loads(osb(key, "sandbox", "list", "-o", "json").stdout)["items"]}

    sid = json.loads(osb(hooli, "sandbox", "create", "-i", "host", "-t", "10m", "-o", "json").stdout)["id"]
    W.track_sandbox(sid)
    missing = str(uuid.uuid4())

    def said(text, real=None):
        """What a client said, A's id read as the missing one and the request id dropped."""
        return re.sub(r"request_id=[0-9a-f-]+", "request_id=*", text.replace(real, missing) if real else text)

    mine = None
    try:
        # A's key: its own sandbox, run in and listed.
        out = osb(hooli, "command", "run", sid, "--", "sh", "-c", "echo made-by-hooli > /tmp/who; cat /tmp/who").stdout
        assert out.strip() == "made-by-hooli", out
        assert listed(hooli) == {sid}

        # B's key: not listed; get, kill and a command fail as on a missing id, said as not found.
        assert listed(vandelay) == set()
        for args in (["sandbox", "get", "{}", "-o", "json"], ["sandbox", "kill", "{}"],
                     ["command", "run", "{}", "--", "sh", "-c", "echo pwned > /tmp/who"]):
            theirs = osb(vandelay, *[a.replace("{}", sid) for a in args], check=False)
            none = osb(vandelay, *[a.replace("{}", missing) for a in args], check=False)
            assert theirs.returncode == none.returncode == 1, (args, theirs, none)
            assert f"sandbox {sid} not found | [SANDBOX::NOT_FOUND]" in theirs.stderr, (args, theirs)
            assert said(theirs.stdout + theirs.stderr, sid) == said(none.stdout + none.stderr), (args, theirs, none)

        # The MCP server over stdio with B's key. rich 13.9.4, which mcp logs a failed tool call
        # with, loops forever on an exception that is its own cause, and the SDK raises one for
        # every API error (`raise ExceptionConverter.to_sandbox_exception(e) from e`;
        # Textualize/rich#3708): the server runs with rich hidden and logs through the stdlib.
        hidden = tmp_path / "no-rich" / "rich"
        hidden.mkdir(parents=True)
        (hidden / "__init__.py").write_text('raise ImportError("hidden by the e2e test")\n')
        errlog = tmp_path / "mcp.err"
        params = StdioServerParameters(command=str(bindir / "opensandbox-mcp"), args=[
            "--transport", "stdio", "--domain", srv.domain, "--api-key", vandelay],
            env={"PYTHONPATH": str(hidden.parent)})

        async def session():
            with errlog.open("w") as err:
                async with stdio_client(params, errlog=err) as (r, w), ClientSession(r, w) as s:
                    await s.initialize()

                    async def call(tool, **args):
                        res = await s.call_tool(tool, args, read_timeout_seconds=30)
                        return res.is_error, res.structured_content or {}, " ".join(c.text for c in res.content)

                    failed, made, text = await call("sandbox_create", image="host", timeout_seconds=600)
                    assert not failed, text
                    own = made["sandbox_id"]
                    W.track_sandbox(own)
                    failed, ran, text = await call("command_run", sandbox_id=own, command="echo vandelay-runs")
                    assert not failed and [m["text"] for m in ran["logs"]["stdout"]] == ["vandelay-runs"], text
                    failed, page, text = await call("sandbox_list")
                    assert not failed and {i["id"] for i in page["sandbox_infos"]} == {own}, text
                    for tool, args in [("sandbox_get_info", {}), ("sandbox_connect", {"connect_timeout_seconds": 5}),
                                       ("command_run", {"command": "echo pwned > /tmp/who", "connect_if_missing": True}),
                                       ("file_read", {"path": "/tmp/who", "connect_if_missing": True}),
                                       ("sandbox_kill", {})]:
                        theirs = await call(tool, sandbox_id=sid, **args)
                        none = await call(tool, sandbox_id=missing, **args)
                        assert theirs[0] and none[0], (tool, theirs, none)
                        assert said(theirs[2], sid) == said(none[2]), (tool, theirs, none)
                    return own

        mine = asyncio.run(session())
        # What the server answered the MCP server for A's id: not found, every time.
        log = errlog.read_text()
        assert log.count(f"sandbox {sid} not found | [SANDBOX::NOT_FOUND]") >= 5, log[-3000:]
        assert listed(vandelay) == {mine} and listed(hooli) == {sid}

        # A's sandbox is untouched by all of that.
        info = json.loads(osb(hooli, "sandbox", "get", sid, "-o", "json").stdout)
        assert info["status"]["state"] == "Running", info
        out = osb(hooli, "command", "run", sid, "--", "cat", "/tmp/who").stdout
        assert out.strip() == "made-by-hooli", out

        # A revoked key: refused, and said to be an authentication failure.
        gone = _key(srv, "hooli")
        assert _admin(srv, "DELETE", f"/admin/keys/{gone.split('_')[1]}").status_code == 200
        for args in (["sandbox", "list"], ["sandbox", "get", sid], ["command", "run", sid, "--", "true"]):
            res = osb(gone, *args, check=False)
            assert res.returncode == 1 and "[INVALID_API_KEY] invalid API key" in res.stderr, (args, res)
            assert "NOT_FOUND" not in res.stderr, (args, res)
    finally:
        osb(hooli, "sandbox", "kill", sid, check=False)
        if mine:
            osb(vandelay, "sandbox", "kill", mine, check=False)


def _answers_alike(a: httpx.Response, b: httpx.Response, real: str, missing: str) -> dict:
    """Two refusals that must be one answer: same status, and the same body once `real` (another
    tenant's name) is read as `missing` (a name that never was)."""
    assert a.status_code == b.status_code, (a.status_code, a.text, b.status_code, b.text)
    assert a.status_code >= 400, (a.status_code, a.text)
    body = W.assert_error_body(a)
    assert json.loads(a.text.replace(real, missing)) == b.json(), (a.text, b.text)
    return body


def _image_id(srv, name: str) -> str:
    out = subprocess.run([str(srv.bin), "image", "ls", "--data-dir", str(srv.data_dir), "-o", "json"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    listed = json.loads(out.stdout)
    items = listed["items"] if isinstance(listed, dict) else listed
    ids = [i["id"] for i in items if i["name"] == name]
    assert ids, (name, out.stdout)
    return ids[0]


def test_another_tenant_s_snapshot_is_missing_however_it_is_named(srv):
    """Every reference to a stored object goes through one tenant-aware resolver.
    Tenant B names tenant A's snapshot as an image (every spelling that reaches its image), as
    `snapshotId`, through A's template (`templateId`), through a pool (`poolRef`, or a pool or a
    template of its own made from that image): each answers exactly as a name that never was, and
    B is left with no sandbox, pool or template. A's own spellings restore it."""
    from opensandbox import SandboxSync
    acme, globex = _key(srv, "snapowner"), _key(srv, "snapthief")
    srv.import_image(W.TEST_IMAGE_NAME, W.test_rootfs())
    made, templates = [], []
    try:
        src = SandboxSync.create(W.TEST_IMAGE_NAME, connection_config=_sdk(srv, acme),
                                 timeout=timedelta(minutes=10), ready_timeout=timedelta(seconds=60))
        made.append(src)
        W.track_sandbox(src.id)
        code, _, err = W.sh(src, "echo acme-secret > /root/secret && sync")
        assert code == 0, err
        r = _as(srv, acme, "POST", f"/sandboxes/{src.id}/snapshots", json={"name": "golden"})
        assert r.status_code == 202, r.text
        snap = r.json()["id"]
        W.wait_until(lambda: _as(srv, acme, "GET", f"/snapshots/{snap}").json()["status"]["state"] == "Ready",
                     60, message="the snapshot")
        missing = str(uuid.uuid4())
        before = {s["id"] for s in _admin(srv, "GET", "/sandboxes").json()["items"]}

        def nothing_left():
            assert _as(srv, globex, "GET", "/sandboxes").json()["items"] == []
            assert {s["id"] for s in _admin(srv, "GET", "/sandboxes").json()["items"]} == before
            assert _as(srv, globex, "GET", "/pools").json()["items"] == []
            assert _as(srv, globex, "GET", "/templates").json()["items"] == []

        def create(key, **fields):
            return _as(srv, key, "POST", "/sandboxes", json={**W.create_body(W.TEST_IMAGE_NAME), **fields})

        spellings = [
            lambda i: f"warren-snapshot/{i}",
            lambda i: f"warren-snapshot/{i}:latest",
            lambda i: f"  warren-snapshot/{i}\t",
            lambda i: f"WARREN-SNAPSHOT/{i}",
            lambda i: f"Warren-Snapshot/{i}:LATEST",
            lambda i: f"docker.io/warren-snapshot/{i}",
            lambda i: f"index.docker.io/warren-snapshot/{i}:latest",
            lambda i: f"registry-1.docker.io/warren-snapshot/{i}",
            lambda i: f"docker.io/library/warren-snapshot/{i}",
            lambda i: f"warren-snapshot://{i}",
            # Names nothing there whoever asks: the same 400 for both.
            lambda i: f"warren-snapshot/{i}:v2",
            lambda i: f"warren-snapshot/{i}@sha256:{'a' * 64}",
        ]
        for spell in spellings:
            theirs = create(globex, image={"uri": spell(snap)})
            none = create(globex, image={"uri": spell(missing)})
            body = _answers_alike(theirs, none, snap, missing)
            assert theirs.status_code in (400, 404) and "acme-secret" not in theirs.text, (spell(snap), body)
            if theirs.status_code == 404:
                assert body["code"] == "SNAPSHOT::NOT_FOUND", body
        # By the store's id of the snapshot's image: as an id that is not there, for anyone.
        image_id = _image_id(srv, f"warren-snapshot/{snap}:latest")
        other_id = "sha256:" + "0" * 64
        _answers_alike(create(globex, image={"uri": image_id}), create(globex, image={"uri": other_id}),
                       image_id, other_id)
        W.assert_error_body(create(acme, image={"uri": image_id}), codes=[404])
        # snapshotId.
        body = W.create_body(W.TEST_IMAGE_NAME)
        body.pop("image")
        _answers_alike(_as(srv, globex, "POST", "/sandboxes", json={**body, "snapshotId": snap}),
                       _as(srv, globex, "POST", "/sandboxes", json={**body, "snapshotId": missing}), snap, missing)
        nothing_left()

        # A pool or a template of B's own, made from A's snapshot: refused as from a missing one.
        pool = {"name": "stolen", "template": W.create_body(f"warren-snapshot/{snap}"),
                "capacitySpec": {"bufferMax": 1, "bufferMin": 1, "poolMin": 0, "poolMax": 1}}
        pool_missing = {**pool, "template": W.create_body(f"warren-snapshot/{missing}")}
        _answers_alike(_as(srv, globex, "POST", "/pools", json=pool),
                       _as(srv, globex, "POST", "/pools", json=pool_missing), snap, missing)
        tpl = {"image": f"warren-snapshot://{snap}", "publish": "s3://bucket/x", "readiness": {"warmupSeconds": 0}}
        _answers_alike(_as(srv, globex, "POST", "/templates", json=tpl),
                       _as(srv, globex, "POST", "/templates", json={**tpl, "image": f"warren-snapshot://{missing}"}),
                       snap, missing)
        nothing_left()

        # A's pool, by poolRef, and A's template, by templateId: missing to B.
        r = _as(srv, acme, "POST", "/pools", json={**pool, "name": "acme-pool",
                                                   "capacitySpec": {"bufferMax": 0, "bufferMin": 0, "poolMin": 0, "poolMax": 1}})
        assert r.status_code == 201, r.text
        _answers_alike(create(globex, extensions={"poolRef": "acme-pool"}),
                       create(globex, extensions={"poolRef": "nopool-xyz"}), "acme-pool", "nopool-xyz")
        # (A's own creates below would match its pool, which makes no sandbox: it goes now.)
        assert _as(srv, acme, "DELETE", "/pools/acme-pool").status_code == 204
        r = _as(srv, acme, "POST", "/templates", json={**tpl, "image": W.TEST_IMAGE_NAME})
        assert r.status_code == 201, r.text
        tid = r.json()["templateId"]
        templates.append(tid)
        no_tid = "tpl_" + str(uuid.uuid4())
        _answers_alike(_as(srv, globex, "POST", "/sandboxes", json={"templateId": tid, "timeout": 600}),
                       _as(srv, globex, "POST", "/sandboxes", json={"templateId": no_tid, "timeout": 600}), tid, no_tid)
        nothing_left()

        # A's own spellings restore its snapshot (the manifestRef form too).
        for uri in (f"docker.io/warren-snapshot/{snap}:latest", f"warren-snapshot://{snap}"):
            r = create(acme, image={"uri": uri})
            assert r.status_code == 202, r.text
            W.track_sandbox(r.json()["id"])
            c = SandboxSync.connect(r.json()["id"], connection_config=_sdk(srv, acme))
            made.append(c)
            code, out, _ = W.sh(c, "cat /root/secret")
            assert out.strip() == "acme-secret", out
    finally:
        _kill_all(made)
        for tid in templates:
            _as(srv, acme, "DELETE", f"/templates/{tid}")
        _as(srv, acme, "DELETE", "/pools/acme-pool")
        _as(srv, globex, "DELETE", "/pools/stolen")


def test_a_default_tenant_claim_never_names_a_tenant_s_volume(srv):
    """A tenant's named volume `data` is kept as `<tenant>.data`, so the default
    tenant's claim names hold no dot (refused with 400, nothing made); a tenant's own dotted claim
    is still its own."""
    from opensandbox import SandboxSync
    tenant = _key(srv, "volowner")
    made = []
    try:
        vol = lambda claim: [{"name": "d", "pvc": {"claimName": claim, "createIfNotExists": True},  # noqa: E731
                              "mountPath": "/data"}]
        r = _as(srv, tenant, "POST", "/sandboxes", json=W.create_body("host", volumes=vol("data")))
        assert r.status_code == 202, r.text
        W.track_sandbox(r.json()["id"])
        c = SandboxSync.connect(r.json()["id"], connection_config=_sdk(srv, tenant))
        made.append(c)
        code, _, err = W.sh(c, "echo volowner-data > /data/who")
        assert code == 0, err
        before = {s["id"] for s in _admin(srv, "GET", "/sandboxes").json()["items"]}
        # The server's own key (the default tenant) naming it, and naming one that never was.
        theirs = _admin(srv, "POST", "/sandboxes", json=W.create_body("host", volumes=vol("volowner.data")))
        none = _admin(srv, "POST", "/sandboxes", json=W.create_body("host", volumes=vol("nobody.data")))
        body = _answers_alike(theirs, none, "volowner.data", "nobody.data")
        assert theirs.status_code == 400 and "claimName" in body["message"], body
        assert {s["id"] for s in _admin(srv, "GET", "/sandboxes").json()["items"]} == before
        assert not (srv.data_dir / "volumes" / "nobody.data").exists()
        # A tenant's dotted claim is its own volume, not another's.
        r = _as(srv, tenant, "POST", "/sandboxes", json=W.create_body("host", volumes=vol("x.y")))
        assert r.status_code == 202, r.text
        W.track_sandbox(r.json()["id"])
        c = SandboxSync.connect(r.json()["id"], connection_config=_sdk(srv, tenant))
        made.append(c)
        code, out, _ = W.sh(c, "ls -A /data")
        assert code == 0 and out.strip() == "", out
    finally:
        _kill_all(made)


def test_host_routing_takes_the_sandbox_tenant_s_key_and_never_passes_it_on(srv):
    """`{port}-{id}.{domain}` opens a port with the sandbox tenant's key (or an
    admin's), as the path proxy does; another tenant's key answers as for a missing sandbox; the key
    never reaches the app."""
    from opensandbox.models.execd import RunCommandOpts
    owner, other = _key(srv, "hostowner"), _key(srv, "hostother")
    ro = _key(srv, "hostowner", "read-only")
    port = 8766
    sbx = _create(srv, owner)
    try:
        # An app that answers with the headers it was sent.
        app = ("import http.server, json, sys\n"
               "class H(http.server.BaseHTTPRequestHandler):\n"
               "    def do_GET(self):\n"
               "        b = json.dumps({k.lower(): v for k, v in self.headers.items()}).encode()\n"
               "        self.send_response(200); self.send_header('Content-Length', str(len(b)))\n"
               "        self.end_headers(); self.wfile.write(b)\n"
               "    def log_message(self, *a): pass\n"
               f"http.server.HTTPServer(('127.0.0.1', {port}), H).serve_forever()\n")
        sbx.files.write_file("/tmp/echo_app.py", app)
        sbx.commands.run("python3 /tmp/echo_app.py", opts=RunCommandOpts(background=True))
        host = f"{port}-{sbx.id}.localhost:{srv.port}"

        def via_host(h, **headers):
            return httpx.get(f"http://127.0.0.1:{srv.port}/echo", headers={"Host": h, **headers}, timeout=30)

        W.wait_until(lambda: via_host(host, **{KEY: owner}).status_code == 200, 20, interval=0.2,
                     message="the app to answer through host routing")
        for key in (owner, srv.api_key):
            r = via_host(host, **{KEY: key, "X-Warren-Tenant": "hostowner"})
            assert r.status_code == 200, r.text
            seen = r.json()
            assert KEY.lower() not in seen and "x-warren-tenant" not in seen, seen
            assert key not in r.text
        # No key, a bad key, or a read-only one: as with no credential.
        for headers in ({}, {KEY: "wk_000000000000_nope"}, {KEY: ro}):
            W.assert_error_body(via_host(host, **headers), codes=[401])
        # Another tenant's key: exactly as a sandbox that never was.
        missing = str(uuid.uuid4())
        theirs = via_host(host, **{KEY: other})
        none = via_host(f"{port}-{missing}.localhost:{srv.port}", **{KEY: other})
        _answers_alike(theirs, none, sbx.id, missing)
        assert theirs.status_code == 404, theirs.text
    finally:
        sbx.kill()
        sbx.close()
