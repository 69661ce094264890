"""Renew on access (OpenSandbox's OSEP-0009): a sandbox created with
`extensions["access.renew.extend.seconds"]` is kept alive by traffic through the endpoint proxy —
its expiry pushed to that long from now, debounced, never past `[limits]
renew_on_access_max_lifetime_seconds` after its creation — while one nobody reaches still expires.
Driven through the official SDK; proxy behaviour, not the runtime's: the embedded runtime only."""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest

import warren_e2e as W

EXT = "access.renew.extend.seconds"


@pytest.fixture(scope="module")
def srv(work_root):
    s = W.WarrenServer("embedded", work_root, f"renew-{uuid.uuid4().hex[:6]}")
    s.more_config = "[limits]\nrenew_on_access_max_lifetime_seconds = 400\n"
    s.check_binary()
    s.start()
    yield s
    s.stop()


def _create(srv, seconds: int, **kw):
    from opensandbox import SandboxSync
    sbx = SandboxSync.create("host", connection_config=srv.sdk_config(), timeout=timedelta(seconds=seconds),
                             ready_timeout=timedelta(seconds=60), **kw)
    W.track_sandbox(sbx.id)
    return sbx


def _set_expiry(srv, sid, seconds: int) -> None:
    with srv.client() as c:
        r = c.post(f"/v1/sandboxes/{sid}/renew-expiration",
                   json={"expiresAt": W.rfc3339(W.utcnow() + timedelta(seconds=seconds))})
    assert r.status_code == 200, r.text


def _running(srv, sid) -> bool:
    with srv.client() as c:
        r = c.get(f"/v1/sandboxes/{sid}")
    return r.status_code == 200 and r.json()["status"]["state"] == "Running"


def _expires(srv, sid):
    with srv.client() as c:
        r = c.get(f"/v1/sandboxes/{sid}")
    return W.parse_time(r.json()["expiresAt"]) if r.status_code == 200 else None


def test_proxied_traffic_keeps_a_sandbox_alive_and_an_idle_one_still_expires(srv):
    used = _create(srv, 60, extensions={EXT: "300"})
    idle = _create(srv, 60, extensions={EXT: "300"})
    try:
        # Both due in a few seconds (a renew through the lifecycle API is not traffic).
        for s in (used, idle):
            _set_expiry(srv, s.id, 6)
        before = _expires(srv, used.id)
        created = W.parse_time(W.sandbox_record(srv, used.id)["created_at"])
        # Traffic through the endpoint proxy (a command: the SDK goes through it).
        code, out, _ = W.sh(used, "echo hi")
        assert (code, out) == (0, "hi\n")
        after = W.wait_until(lambda: (e := _expires(srv, used.id)) and e > before + timedelta(seconds=200) and e,
                             10, message="the expiry to move")
        assert after <= W.utcnow() + timedelta(seconds=301), after
        # Debounced: more traffic right away does not move it again.
        W.sh(used, "true")
        assert _expires(srv, used.id) == after
        # The idle one expires on time; the used one is still there past that.
        W.wait_until(lambda: not _running(srv, idle.id), 30, message="the idle sandbox to expire")
        assert _running(srv, used.id) and _expires(srv, used.id) == after
        # Never past the maximum lifetime (400 s after creation), however much traffic.
        _set_expiry(srv, used.id, 5)
        W.sh(used, "true")
        capped = W.wait_until(lambda: (e := _expires(srv, used.id)) and e > W.utcnow() + timedelta(seconds=60) and e,
                              10, message="the expiry to move again")
        assert capped <= created + timedelta(seconds=400, milliseconds=1), (capped, created)
    finally:
        for s in (used, idle):
            try:
                s.kill()
            except Exception:  # noqa: BLE001 - expired already
                pass
            s.close()


@pytest.mark.parametrize("value", ["299", "86401", "5m", ""])
def test_a_bad_extension_is_refused_with_nothing_made(srv, value):
    with srv.client() as c:
        before = len(c.get("/v1/sandboxes").json()["items"])
        r = c.post("/v1/sandboxes", json=W.create_body("host", extensions={EXT: value}))
        W.assert_error_body(r, codes=[400])
        assert EXT in r.json()["message"], r.text
        assert len(c.get("/v1/sandboxes").json()["items"]) == before
