"""Browser sandboxes: `extensions.browser` starts the image's Chromium with its DevTools endpoint on
port 9222, and Playwright's `connect_over_cdp` on the host drives it through Warren's endpoint
proxy — by a signed URL (no header, no key) and by the API with its key — while the page runs
inside the sandbox: a form served there is filled and clicked, the screenshot's pixels checked; a
download lands where the files API reads it; the sandbox's egress policy holds for the browser (an
allowed name loads from a fake internet the test builds, a denied one does not).

The host's Playwright drives the sandbox's Chromium only; the host's own browser is not started.
The browser is execd's, the same on every runtime: it runs once per image source, on the first
runtime with a network link (egressPolicy) of each — with Warren's image store, the host's Chromium
through the `host` image (the embedded runtime); with an engine's, the desktop image (Docker)."""

from __future__ import annotations

import json
import time
import uuid

import pytest

import warren_e2e as W
from fakenet import FakeNet
from test_desktop import desktop_image, png_pixels

FORM = """<!doctype html><html><head><title>form</title><style>
body { margin: 0; background: #ffffff; font: 16px sans-serif }
body.done { background: rgb(0, 200, 83) }
</style></head><body>
<input id="name"><button id="go" onclick="
  document.getElementById('out').textContent = 'Hello, ' + document.getElementById('name').value;
  document.body.className = 'done'">Go</button>
<p id="out"></p><a id="dl" href="report.txt" download="report.txt">report</a>
</body></html>"""

DONE = (0, 200, 83)

# Answers with the request's headers, as JSON (single quotes: it runs as `python3 -c '…'`).
HEADERS_APP = """
import http.server, json
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({k.lower(): v for k, v in self.headers.items()}).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)
http.server.HTTPServer(("127.0.0.1", 8001), H).serve_forever()
"""


@pytest.fixture(scope="module")
def fakenet(work_root):
    with FakeNet(work_root / f"fakenet-{uuid.uuid4().hex[:6]}") as net:
        yield net


@pytest.fixture(scope="module")
def browser_sandbox(server, work_root, fakenet):
    server.run_once("the browser is execd's, the same on every runtime: once per image source, where the "
                    "sandbox's egress policy is enforced on its link",
                    imageSource=server.caps.image_source, egressPolicy=True)
    s = W.WarrenServer(server.runtime, work_root, f"browser-sbx-{uuid.uuid4().hex[:6]}")
    port = W.free_port()
    s.more_config = f'[endpoints]\ndomain = "localhost:{port}"\nmax_signed_seconds = 3600\n'
    s.extra_config = (f'[network]\nsubnet = "10.232.{port % 200}.0/24"\n'
                      f'dns_upstream = "127.0.0.1:{fakenet.dns_port}"\n')
    s.check_binary()
    s.start(port=port)
    try:
        with s.client() as api:
            r = api.post("/v1/sandboxes", json=W.create_body(
                desktop_image(s), extensions={"browser": "true"},
                networkPolicy={"defaultAction": "deny", "egress": [{"action": "allow", "target": "allowed.test"}]}))
            assert r.status_code == 202, r.text
            sid = r.json()["id"]
            W.track_sandbox(sid)
            st = W.wait_until(lambda: (x := api.get(f"/v1/sandboxes/{sid}").json()["status"])["state"]
                              in ("Running", "Failed") and x, 90, message="the browser sandbox")
            assert st["state"] == "Running", st
            execd = f"/v1/sandboxes/{sid}/proxy/44772"
            for name, text in (("form.html", FORM), ("report.txt", "the report\n")):
                r = api.post(f"{execd}/files/upload", files={
                    "metadata": (None, f'{{"path": "/tmp/site/{name}"}}', "application/json"),
                    "file": (name, text.encode(), "application/octet-stream")})
                assert r.status_code == 200, r.text
            r = api.post(f"{execd}/command", json={
                "command": "python3 -m http.server 8000 --bind 127.0.0.1 --directory /tmp/site", "background": True})
            assert r.status_code == 200, r.text
            r = api.post(f"{execd}/command", json={"command": f"python3 -c '{HEADERS_APP}'", "background": True})
            assert r.status_code == 200, r.text
            for port in (8000, 8001):
                W.wait_until(lambda: api.get(f"/v1/sandboxes/{sid}/proxy/{port}/").status_code == 200, 20,
                             interval=0.1, message=f"the sandbox's server on {port}")
            yield s, api, sid
            api.delete(f"/v1/sandboxes/{sid}")
    finally:
        s.stop()


def _signed_devtools(srv, api, sid) -> str:
    """A signed URL for DevTools, in its path form on the API's host (`/signed/{token}`): Node's
    resolver, unlike Chromium's, does not take `*.localhost` for loopback."""
    r = api.get(f"/v1/sandboxes/{sid}/endpoints/9222", params={"expires": str(int(time.time()) + 600)})
    assert r.status_code == 200 and not r.json().get("headers"), r.text
    token = r.json()["endpoint"].split(".", 1)[0]
    return f"{srv.base_url}/signed/{token}"


def test_playwright_drives_the_sandbox_browser_over_cdp(browser_sandbox, tmp_path):
    from playwright.sync_api import sync_playwright

    srv, api, sid = browser_sandbox
    with sync_playwright() as p:
        browser = p.chromium.connect_over_cdp(_signed_devtools(srv, api, sid), timeout=30_000)
        try:
            page = browser.contexts[0].new_page()
            page.set_viewport_size({"width": 800, "height": 600})
            page.goto("http://127.0.0.1:8000/form.html")
            page.fill("#name", "Warren")
            page.click("#go")
            assert page.text_content("#out") == "Hello, Warren"
            # The page's pixels, drawn by the sandbox's browser: mostly the colour the click set.
            w, h, px = png_pixels(page.screenshot(path=str(tmp_path / "form.png")))
            assert (w, h) == (800, 600)
            done = sum(1 for i in range(0, len(px), 3) if tuple(px[i:i + 3]) == DONE)
            assert done > 0.8 * w * h, f"{done} of {w * h} pixels are the clicked colour"
            # The browser is the sandbox's: it sees the sandbox's files, not the host's.
            page.goto("file:///tmp/site/report.txt")
            assert page.text_content("body").strip() == "the report"
            page.close()
        finally:
            browser.close()


def test_the_api_key_form_reaches_devtools_too(browser_sandbox):
    """Through the API's own proxy path, with the key as a header: the WebSocket URL DevTools
    gives is the same path on the same host, so the client connects with the same header."""
    from playwright.sync_api import sync_playwright

    srv, api, sid = browser_sandbox
    # The caller's own X-Forwarded-* are Warren's to write: a forged host is not taken.
    version = api.get(f"/v1/sandboxes/{sid}/proxy/9222/json/version",
                      headers={"X-Forwarded-Host": "evil.example", "X-Forwarded-Prefix": "/x"}).json()
    assert version["webSocketDebuggerUrl"].startswith(
        f"ws://127.0.0.1:{srv.port}/v1/sandboxes/{sid}/proxy/9222/devtools/browser/"), version
    with sync_playwright() as p:
        browser = p.chromium.connect_over_cdp(f"{srv.base_url}/v1/sandboxes/{sid}/proxy/9222",
                                              headers={"OPEN-SANDBOX-API-KEY": srv.api_key}, timeout=30_000)
        try:
            page = browser.contexts[0].new_page()
            page.goto("http://127.0.0.1:8000/report.txt")
            assert page.text_content("body").strip() == "the report"
            page.close()
        finally:
            browser.close()
    # Without the key, nothing: neither the JSON nor the WebSocket.
    import httpx
    r = httpx.get(f"{srv.base_url}/v1/sandboxes/{sid}/proxy/9222/json/version", timeout=10)
    W.assert_error_body(r, codes=[401])


def test_the_egress_policy_holds_for_the_browser(browser_sandbox, fakenet):
    from playwright.sync_api import Error as PlaywrightError
    from playwright.sync_api import sync_playwright

    srv, api, sid = browser_sandbox
    with sync_playwright() as p:
        browser = p.chromium.connect_over_cdp(_signed_devtools(srv, api, sid), timeout=30_000)
        try:
            page = browser.contexts[0].new_page()
            page.goto("http://allowed.test/", timeout=15_000)
            assert page.text_content("body").startswith(f"hello from {fakenet.zone['allowed.test']}")
            page.close()
            # A denied name does not resolve; a denied address is not reached. (Each in a page of
            # its own, left open: an error page's close waits on a navigation that never ends.)
            for url in ("http://other.test/", f"http://{fakenet.zone['other.test']}/"):
                with pytest.raises(PlaywrightError) as failed:
                    browser.contexts[0].new_page().goto(url, timeout=15_000)
                assert "net::ERR_" in str(failed.value), failed.value
        finally:
            browser.close()
    assert "other.test" not in fakenet.names, "a denied name was forwarded upstream"


def test_downloads_land_where_the_files_api_reads_them(browser_sandbox):
    from playwright.sync_api import sync_playwright

    srv, api, sid = browser_sandbox
    with sync_playwright() as p:
        browser = p.chromium.connect_over_cdp(_signed_devtools(srv, api, sid), timeout=30_000)
        try:
            cdp = browser.new_browser_cdp_session()
            cdp.send("Browser.setDownloadBehavior", {"behavior": "default"})
            page = browser.contexts[0].new_page()
            page.goto("http://127.0.0.1:8000/form.html")
            page.click("#dl")

            def landed():
                r = api.get(f"/v1/sandboxes/{sid}/proxy/44772/files/download",
                            params={"path": "/root/Downloads/report.txt"})
                return r.status_code == 200 and r.text
            assert W.wait_until(landed, 20, interval=0.3, message="the download") == "the report\n"
            page.close()
        finally:
            browser.close()


def test_no_app_sees_the_callers_url(browser_sandbox):
    """The caller's URL (X-Forwarded-*, which for a signed URL holds its token) goes to execd for
    the DevTools port only, and execd keeps it: an app sees neither Warren's nor a caller's."""
    srv, api, sid = browser_sandbox
    r = api.get(f"/v1/sandboxes/{sid}/endpoints/8001", params={"expires": str(int(time.time()) + 600)})
    token = r.json()["endpoint"].split(".", 1)[0]
    import httpx
    seen = httpx.get(f"{srv.base_url}/signed/{token}/", timeout=30).json()
    assert seen["host"] == "localhost", seen
    assert not any(k.startswith("x-forwarded") for k in seen) and token not in json.dumps(seen), seen
    seen = api.get(f"/v1/sandboxes/{sid}/proxy/8001/", headers={"X-Forwarded-Host": "mine.example"}).json()
    assert seen.get("x-forwarded-host") == "mine.example", "a caller's own header reaches its app as sent"
