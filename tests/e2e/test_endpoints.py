"""Reaching a server started inside the sandbox through get_endpoint(port)
and Warren's proxy (issue 2 items 3, 9)."""

from __future__ import annotations

import hashlib
import os

import httpx
import pytest
from opensandbox.models.execd import RunCommandOpts

import warren_e2e as W

PORT = 8765


@pytest.fixture
def web_sandbox(make_sandbox, any_image):
    sbx = make_sandbox(any_image)
    sbx.files.write_file("/tmp/www/hello.txt", "hello through the proxy\n", mode=644)
    ex = sbx.commands.run(f"python3 -m http.server {PORT} --bind 127.0.0.1 --directory /tmp/www",
                          opts=RunCommandOpts(background=True))
    assert ex.id
    return sbx, ex.id


def _get(ep, path, **kw):
    return httpx.get(f"http://{ep.endpoint}{path}", headers=ep.headers, timeout=30, **kw)


def test_http_server_inside_sandbox(web_sandbox):
    sbx, exec_id = web_sandbox
    ep = sbx.get_endpoint(PORT)
    assert "://" not in ep.endpoint, f"endpoint must have no scheme: {ep.endpoint}"
    assert ep.headers, "Warren's endpoints carry a per-sandbox token header"

    r = W.wait_until(lambda: (x := _get(ep, "/hello.txt")).status_code == 200 and x, 15, interval=0.2,
                     message="http.server inside the sandbox to answer")
    assert r.text == "hello through the proxy\n"

    # query strings pass through; 404s from inside come back as 404s
    assert _get(ep, "/hello.txt?x=1&y=%20z").text == "hello through the proxy\n"
    assert _get(ep, "/nope.txt").status_code == 404

    # the listing page includes the file: a whole HTML body passes through
    assert "hello.txt" in _get(ep, "/").text

    # a bigger body streams through intact
    data = os.urandom(8 * 1024 * 1024)
    sbx.files.write_file("/tmp/www/blob.bin", data, mode=644)
    h = hashlib.sha256()
    with httpx.stream("GET", f"http://{ep.endpoint}/blob.bin", headers=ep.headers, timeout=60) as resp:
        assert resp.status_code == 200
        for chunk in resp.iter_bytes():
            h.update(chunk)
    assert h.hexdigest() == hashlib.sha256(data).hexdigest()

    # the request log shows the server really runs inside the sandbox
    logs = sbx.commands.get_background_command_logs(exec_id)
    assert "GET /hello.txt" in logs.content


def test_endpoint_without_token_is_refused(web_sandbox):
    sbx, _ = web_sandbox
    ep = sbx.get_endpoint(PORT)
    W.wait_until(lambda: _get(ep, "/hello.txt").status_code == 200, 15, interval=0.2,
                 message="http.server to answer")
    r = httpx.get(f"http://{ep.endpoint}/hello.txt", timeout=10)
    W.assert_error_body(r, codes=[401])
    assert "hello through the proxy" not in r.text


def test_endpoint_for_closed_port(make_sandbox):
    sbx = make_sandbox("host")
    ep = sbx.get_endpoint(9)  # nothing listens on the discard port
    r = httpx.get(f"http://{ep.endpoint}/", headers=ep.headers, timeout=15)
    assert r.status_code in (502, 503, 504), f"expected a gateway error, got {r.status_code}"


def test_server_proxy_mode(server, make_sandbox):
    """ConnectionConfig(use_server_proxy=True): the SDK sends the API key to
    the endpoint and everything still works."""
    sbx = make_sandbox("host", connection_config=server.sdk_config(use_server_proxy=True))
    code, out, _ = W.sh(sbx, "echo via-server-proxy")
    assert code == 0 and out.strip() == "via-server-proxy"
    sbx.files.write_file("/tmp/p.txt", "p")
    assert sbx.files.read_file("/tmp/p.txt") == "p"


def test_endpoint_unknown_sandbox(api):
    r = api.get("/v1/sandboxes/no-such-sandbox-e2e/endpoints/8080")
    W.assert_error_body(r, codes=[404])


@pytest.mark.parametrize("port", ["0", "70000", "abc"])
def test_endpoint_bad_port(api, raw_sandbox, port):
    sid = raw_sandbox()["id"]
    r = api.get(f"/v1/sandboxes/{sid}/endpoints/{port}")
    W.assert_error_body(r, codes=[400, 404])
