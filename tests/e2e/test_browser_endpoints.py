"""Endpoint URLs a browser can open: signed, expiring URLs that carry their own
credential — on the path (`/signed/{token}/`) and as a host (`{token}.{domain}`) — host routing
(`{port}-{id}.{domain}` with the port's token header or a key), and CORS for the API. A real headless
Chromium loads a page and opens a WebSocket served from inside a sandbox through both forms.

The endpoint domain is `localhost:PORT`: Chromium resolves every `*.localhost` name to loopback
itself; httpx reaches the same names by sending the Host header to 127.0.0.1. Chromium is kept on
loopback: its resolver maps every other name to nothing, other traffic goes to a dead proxy on
loopback, and its background services are off."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import uuid
from pathlib import Path

import httpx
import pytest
from opensandbox.models.execd import RunCommandOpts

import warren_e2e as W

APP_PORT = 8765
ORIGIN = "http://app.example"


@pytest.fixture(scope="module")
def srv(work_root):
    s = W.WarrenServer("embedded", work_root, f"browser-{uuid.uuid4().hex[:6]}")
    port = W.free_port()
    s.more_config = (f'[endpoints]\ndomain = "localhost:{port}"\nmax_signed_seconds = 3600\n'
                     f'[http]\ncors_allowed_origins = ["{ORIGIN}"]\n')
    s.check_binary()
    s.start(port=port)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def app(srv):
    """A sandbox serving browser_app.py on APP_PORT."""
    sbx = W.sdk_sandbox(srv, "host")
    sbx.files.write_file("/tmp/browser_app.py", (Path(__file__).parent / "browser_app.py").read_text())
    sbx.commands.run(f"python3 /tmp/browser_app.py {APP_PORT}", opts=RunCommandOpts(background=True))
    ep = sbx.get_endpoint(APP_PORT)
    W.wait_until(lambda: httpx.get(f"http://{ep.endpoint}/", headers=ep.headers, timeout=10).status_code == 200,
                 20, interval=0.2, message="the app in the sandbox to answer")
    yield sbx
    sbx.kill()
    sbx.close()


def _signed(sbx, seconds=600, port=APP_PORT):
    ep = sbx.get_signed_endpoint(port, int(time.time()) + seconds)
    assert ep.headers in (None, {}), f"a signed URL needs no header: {ep.headers}"
    return ep.endpoint


def _token(endpoint: str) -> str:
    """The route token of a host-form signed endpoint (`{token}.localhost:PORT`)."""
    label = endpoint.split(".", 1)[0]
    assert len(label) <= 63 and label.count("-") == 3, endpoint
    return label


def _via_host(srv, host: str, path: str = "/", **kw) -> httpx.Response:
    return httpx.request(kw.pop("method", "GET"), f"http://127.0.0.1:{srv.port}{path}",
                         headers={"Host": host, **kw.pop("headers", {})}, timeout=30, **kw)


def test_a_signed_url_opens_its_port_with_no_header_and_nothing_else(srv, app):
    endpoint = _signed(app)
    assert endpoint.endswith(f".localhost:{srv.port}"), endpoint
    token = _token(endpoint)
    # As a host: the app, served at `/` (its absolute paths too).
    r = _via_host(srv, endpoint, "/app.js")
    assert r.status_code == 200 and "fromAbsolute" in r.text, (r.status_code, r.text)
    # On the path, on the API's own host: the same app, the prefix taken off.
    r = httpx.get(f"{srv.base_url}/signed/{token}/app.js", timeout=30)
    assert r.status_code == 200 and "fromAbsolute" in r.text, (r.status_code, r.text)
    # An app's path that looks like the API's is the app's.
    r = _via_host(srv, endpoint, "/v1/sandboxes")
    assert r.status_code == 404 and r.text.startswith("app: no GET /v1/sandboxes"), r.text
    # Tampered: another port, another sandbox, a later expiry, a changed signature.
    compact, port, exp, sig = token.split("-")
    other = uuid.uuid4().hex
    flipped = sig[:-1] + ("a" if sig[-1] != "a" else "b")
    for forged in (f"{compact}-44772-{exp}-{sig}", f"{other}-{port}-{exp}-{sig}",
                   f"{compact}-{port}-{exp}z-{sig}", f"{compact}-{port}-{exp}-{flipped}"):
        for r in (_via_host(srv, f"{forged}.localhost:{srv.port}", "/"),
                  httpx.get(f"{srv.base_url}/signed/{forged}/", timeout=30)):
            W.assert_error_body(r, codes=[401])
    # On its own host an app's cookies stay on that host (no Domain: other sandboxes under the
    # domain are other tenants'); on Warren's own host (the path) the app is confined to an opaque
    # origin: no cookie, no service worker, a sandboxing CSP.
    r = _via_host(srv, endpoint, "/setcookie")
    assert sorted(r.headers.get_list("set-cookie")) == ["narrow=2; Path=/", "wide=1; Path=/"], r.headers
    r = httpx.get(f"{srv.base_url}/signed/{token}/setcookie", timeout=30)
    assert r.status_code == 200 and "set-cookie" not in r.headers and "service-worker-allowed" not in r.headers
    csp = r.headers["content-security-policy"]
    assert csp.startswith("sandbox ") and "allow-same-origin" not in csp, csp
    r = httpx.get(f"{srv.base_url}/signed/{token}/sw.js", headers={"Service-Worker": "script"}, timeout=30)
    W.assert_error_body(r, codes=[403])
    # Signed URLs open application ports only: never execd's or the egress surface's.
    for port in (44772, 18080):
        r = srv.client().get(f"/v1/sandboxes/{app.id}/endpoints/{port}",
                             params={"expires": str(int(time.time()) + 60)})
        assert "application ports only" in W.assert_error_body(r, codes=[400])["message"]
    # Names deeper than one label under the domain are nobody's (never the API); a fully
    # qualified name (a trailing dot) is the same name.
    assert _via_host(srv, endpoint.replace(f".localhost:{srv.port}", f".localhost.:{srv.port}"),
                     "/app.js").status_code == 200
    W.assert_error_body(_via_host(srv, f"x.{endpoint}", "/health"), codes=[401])
    # The API is still the API on its own host, and on the bare domain.
    assert _via_host(srv, f"localhost:{srv.port}", "/health").json()["status"] == "healthy"
    # The audit log keeps who opened what: the sandbox's tenant, by signed URL.
    lines = [json.loads(x) for x in (srv.data_dir / "audit" / "audit.jsonl").read_text().splitlines()]
    assert any(e["keyId"] == "signed-url" and e["sandbox"] == app.id and e["action"] == f"proxy {APP_PORT}"
               and e["status"] == 200 and e["tenant"] == "default" for e in lines), lines[-5:]


def test_a_signed_url_dies_when_it_expires_its_sandbox_ends_or_its_key_is_dropped(srv, app):
    # Expiry: a URL good for two seconds.
    short = _signed(app, seconds=2)
    assert _via_host(srv, short, "/app.js").status_code == 200
    time.sleep(2.5)
    r = _via_host(srv, short, "/app.js")
    assert W.assert_error_body(r, codes=[401])["message"] == "this URL has expired"
    # Limits on what may be asked.
    for params, what in [({"expires": str(int(time.time()) + 7200)}, "max_signed_seconds"),
                         ({"expires": "1"}, "greater than current time")]:
        r = srv.client().get(f"/v1/sandboxes/{app.id}/endpoints/{APP_PORT}", params=params)
        assert what in W.assert_error_body(r, codes=[400])["message"], r.text
    # Key rotation: a new key put first signs, the old one still opens until it is dropped.
    keys = srv.data_dir / "endpoint-signing-keys"
    old_key = keys.read_text().strip()
    old = _signed(app)
    keys.write_text(f"{'n' * 40}\n{old_key}\n")
    os.kill(srv.proc.pid, signal.SIGHUP)
    W.wait_until(lambda: _signed(app) != old, 10, message="the new key to sign")
    new = _signed(app)
    assert _via_host(srv, old, "/app.js").status_code == 200
    keys.write_text(f"{'n' * 40}\n")
    os.kill(srv.proc.pid, signal.SIGHUP)
    W.wait_until(lambda: _via_host(srv, old, "/app.js").status_code == 401, 10,
                 message="the dropped key's URL to be refused")
    assert _via_host(srv, new, "/app.js").status_code == 200
    # A broken key file is refused on SIGHUP and the keys in use stay.
    keys.write_text("short\n")
    os.kill(srv.proc.pid, signal.SIGHUP)
    time.sleep(0.5)
    assert _via_host(srv, new, "/app.js").status_code == 200
    assert "endpoint signing keys not reloaded" in srv.log_tail(200)
    keys.write_text(f"{'n' * 40}\n")
    # The sandbox ends: its URLs open nothing, and say no more than a missing sandbox.
    other = W.sdk_sandbox(srv, "host")
    gone = _signed(other, port=80)
    other.kill()
    other.close()
    W.wait_until(lambda: _via_host(srv, gone, "/").status_code == 404, 30,
                 message="the deleted sandbox's URL to answer 404")


def test_host_routing_takes_the_port_s_token_header_or_a_key_and_nothing_less(srv, app):
    ep = app.get_endpoint(APP_PORT)
    host = f"{APP_PORT}-{app.id}.localhost:{srv.port}"
    r = _via_host(srv, host, "/app.js", headers=ep.headers)
    assert r.status_code == 200 and "fromAbsolute" in r.text, r.text
    W.assert_error_body(_via_host(srv, host, "/app.js"), codes=[401])
    # A key of the sandbox's tenant (here the server's own, an admin's) opens it as on the path
    # proxy, and is taken off before the app (test_tenants.py checks what the app sees); a key
    # that is no key opens nothing.
    r = _via_host(srv, host, "/app.js", headers={"OPEN-SANDBOX-API-KEY": srv.api_key})
    assert r.status_code == 200 and "fromAbsolute" in r.text, r.text
    W.assert_error_body(_via_host(srv, host, "/app.js", headers={"OPEN-SANDBOX-API-KEY": "not-a-key"}),
                        codes=[401])
    # Another port's token does not open this one.
    execd = app.get_endpoint(44772)
    W.assert_error_body(_via_host(srv, host, "/app.js", headers=execd.headers), codes=[401])
    # A sandbox that does not exist, with a token: as any wrong token.
    W.assert_error_body(_via_host(srv, f"{APP_PORT}-{uuid.uuid4()}.localhost:{srv.port}", "/",
                                  headers=ep.headers), codes=[401])


def test_cors_lets_only_the_configured_origin_call_the_api(srv, app):
    pre = {"Access-Control-Request-Method": "GET",
           "Access-Control-Request-Headers": "open-sandbox-api-key"}
    r = httpx.options(f"{srv.base_url}/v1/sandboxes", headers={"Origin": ORIGIN, **pre}, timeout=30)
    assert r.status_code == 200, (r.status_code, r.text)
    assert r.headers["access-control-allow-origin"] == ORIGIN
    assert "open-sandbox-api-key" in r.headers["access-control-allow-headers"].lower()
    r = httpx.get(f"{srv.base_url}/v1/sandboxes", headers={"Origin": ORIGIN, "OPEN-SANDBOX-API-KEY": srv.api_key},
                  timeout=30)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    assert "x-request-id" in r.headers["access-control-expose-headers"].lower()
    # Another origin gets no grant (the browser then withholds the answer).
    r = httpx.options(f"{srv.base_url}/v1/sandboxes", headers={"Origin": "http://evil.example", **pre},
                      timeout=30)
    assert "access-control-allow-origin" not in r.headers, r.headers
    # The app's own origin is the app's: a preflight there reaches the app, not Warren's CORS.
    r = _via_host(srv, _signed(app), "/x", method="OPTIONS", headers={"Origin": ORIGIN, **pre})
    assert r.text.startswith("app: no OPTIONS /x"), r.text
    assert "access-control-allow-origin" not in r.headers


def _open_in_chromium(url: str, profile: Path) -> subprocess.Popen:
    args = [W.chromium_binary(), "--headless=new", "--no-sandbox", "--disable-gpu", f"--user-data-dir={profile}",
            *W.CHROMIUM_LOOPBACK_FLAGS, url]
    return subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=open(profile / "chromium.log", "wb"), start_new_session=True)


def test_chromium_opens_a_page_and_a_websocket_through_signed_urls(srv, app, tmp_path):
    host_form = _signed(app)
    path_form = f"127.0.0.1:{srv.port}/signed/{_token(_signed(app))}/"
    app.commands.run("rm -f /tmp/reports")
    for name, url in (("host", f"http://{host_form}/"), ("path", f"http://{path_form}")):
        profile = tmp_path / name
        profile.mkdir()
        browser = _open_in_chromium(url, profile)
        try:
            def reported():
                _, out, _ = W.sh(app, "cat /tmp/reports 2>/dev/null || true")
                return out.splitlines()
            lines = W.wait_until(reported, 60, interval=0.5,
                                 message=f"Chromium to report through the {name} form "
                                         f"({(profile / 'chromium.log').read_text(errors='replace')[-2000:]})")
        finally:
            os.killpg(browser.pid, signal.SIGKILL)
            browser.wait(timeout=10)
        # The WebSocket went through and back.
        assert lines[0].startswith("echo:ping|"), lines
        if name == "host":
            # Served at `/`: the page's absolute /app.js is the app's.
            assert lines[0] == "echo:ping|abs=yes|path=/", lines
        else:
            # Under a path prefix: relative URLs work (the WebSocket, the report); /app.js is not
            # the app's — what host routing is for.
            assert lines[0].startswith("echo:ping|abs=no|path=/signed/"), lines
        app.commands.run("rm -f /tmp/reports")
