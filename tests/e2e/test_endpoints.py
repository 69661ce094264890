"""Reaching a server started inside the sandbox through get_endpoint(port)
and Warren's proxy: HTTP and WebSocket traffic, the endpoint token required, closed ports, unknown
sandboxes and bad ports refused, the server-proxy mode and its query parameters."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

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


def test_endpoint_query_parameters_as_the_reference_answers_them(server, make_sandbox, api):
    """`use_server_proxy` is accepted (every endpoint is the server's proxy); `expires` is checked
    as the reference checks it and answered with a signed URL on the path proxy (no `[endpoints]
    domain` here) that needs no header: the SDK's `get_signed_endpoint` reaches execd with it
    alone. (Signed URLs in depth, and a browser: test_browser_endpoints.py.)"""
    import time
    sbx = make_sandbox("host")
    plain = api.get(f"/v1/sandboxes/{sbx.id}/endpoints/8080").json()
    proxied = api.get(f"/v1/sandboxes/{sbx.id}/endpoints/8080", params={"use_server_proxy": "true"})
    assert proxied.status_code == 200 and proxied.json()["endpoint"] == plain["endpoint"]
    later = int(time.time()) + 600
    for params, what in [({"expires": "1"}, "greater than current time"),
                         ({"expires": "soon"}, "Unix timestamp"),
                         ({"expires": "-5"}, "Unix timestamp"),
                         ({"expires": str(later + 30 * 86400)}, "max_signed_seconds"),
                         ({"use_server_proxy": "maybe"}, "true or false")]:
        r = api.get(f"/v1/sandboxes/{sbx.id}/endpoints/8080", params=params)
        W.assert_error_body(r, codes=[400], code="SANDBOX::INVALID_PARAMETER")
        assert what in r.json()["message"], (params, r.json())
    # Signed URLs open application ports, not execd's: its token header stays the way in.
    r = api.get(f"/v1/sandboxes/{sbx.id}/endpoints/44772", params={"expires": str(later)})
    assert "application ports only" in W.assert_error_body(r, codes=[400])["message"]
    sbx.commands.run("python3 -m http.server 8080 --bind 127.0.0.1 --directory /tmp",
                     opts=RunCommandOpts(background=True))
    signed = sbx.get_signed_endpoint(8080, later)
    assert not signed.headers, signed.headers
    assert signed.endpoint.startswith(f"{server.domain}/signed/"), signed.endpoint
    r = W.wait_until(lambda: (x := httpx.get(f"http://{signed.endpoint}/", timeout=30)).status_code == 200 and x,
                     20, interval=0.2, message="the app through its signed URL")
    # As handed out, without a slash after the token: sent on to the app's root with one, so a
    # page's relative links resolve beside it, not beside the token (where they got 401).
    bare = httpx.get(f"http://{signed.endpoint}?x=1", timeout=30)
    assert bare.status_code == 308, bare.status_code
    assert bare.headers["location"] == f"/{signed.endpoint.split('/', 1)[1]}/?x=1", bare.headers
    followed = httpx.get(f"http://{signed.endpoint}", timeout=30, follow_redirects=True)
    assert followed.status_code == 200 and followed.text == r.text
    # Under /v1 the same: the redirect keeps the prefix it came with.
    host, path = signed.endpoint.split("/", 1)
    v1 = httpx.get(f"http://{host}/v1/{path}?x=1", timeout=30)
    assert v1.status_code == 308 and v1.headers["location"] == f"/v1/{path}/?x=1", v1.headers
    # The rest of the path reaches the app as it was sent, still percent-encoded, bytes that are
    # no UTF-8 included: the app answers it (http.server's own 404), not Warren.
    raw = httpx.get(f"http://{signed.endpoint}/no%FFsuch%2Ffile", timeout=30)
    assert raw.status_code == 404 and "Error response" in raw.text, (raw.status_code, raw.text)
    # No token at all is a token that opens nothing.
    for empty in (f"http://{host}/signed/", f"http://{host}/v1/signed/"):
        body = W.assert_error_body(httpx.get(empty, timeout=30), codes=[401])
        assert "ACCESS_TOKEN" in body["code"] and "route token" in body["message"], (empty, body)
    # The same path with one character of the signature changed opens nothing.
    forged = signed.endpoint[:-1] + ("a" if signed.endpoint[-1] != "a" else "b")
    W.assert_error_body(httpx.get(f"http://{forged}/", timeout=30), codes=[401])


def _execd_connections(sandbox_id: str) -> set[str]:
    """Inodes of the connections execd (in the sandbox with this id) has accepted and still holds
    open. An accepted Unix socket lives in the connecting side's network namespace, so it is listed
    in the host's /proc/net/unix under the listener's path; the descriptors of the sandbox's
    processes (execd and an entrypoint that holds no sockets) say which are this sandbox's."""
    procs = [p for p in Path("/sys/fs/cgroup").glob(f"*/warren*/{sandbox_id}/cgroup.procs")]
    assert procs, f"no cgroup for sandbox {sandbox_id}"
    held = set()
    for pid in procs[0].read_text().split():
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    held.add(target[len("socket:["):-1])
        except OSError:
            continue
    accepted = set()
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        f = line.split()
        if len(f) == 8 and f[5] == "03" and f[7].endswith("/execd.sock"):
            accepted.add(f[6])
    return held & accepted


def test_sequential_requests_reuse_one_connection_to_execd(server, make_sandbox):
    """The proxy keeps its connections to execd alive: sequential commands and file calls ride one
    connection rather than a connect and an accept each, and it stays open between them."""
    if not server.execd_socket_handed_over:
        pytest.skip("execd's descriptors are visible from the host only where the server binds its socket "
                    "(the native runtime but gVisor)")
    sbx = make_sandbox("host")
    seen = []
    for _ in range(3):
        code, out, _ = W.sh(sbx, "echo hi")
        assert code == 0 and out.strip() == "hi"
        seen.append(_execd_connections(sbx.id))
    sbx.files.write_file("/tmp/reuse.txt", "x")
    assert sbx.files.read_file("/tmp/reuse.txt") == "x"
    seen.append(_execd_connections(sbx.id))
    assert all(seen), f"no connection to execd stayed open between requests: {seen}"
    assert set.intersection(*seen), f"requests came on new connections: {seen}"


def test_endpoint_unknown_sandbox(api):
    r = api.get("/v1/sandboxes/no-such-sandbox-e2e/endpoints/8080")
    W.assert_error_body(r, codes=[404])


@pytest.mark.parametrize("port", ["0", "70000", "abc"])
def test_endpoint_bad_port(api, raw_sandbox, port):
    sid = raw_sandbox()["id"]
    r = api.get(f"/v1/sandboxes/{sid}/endpoints/{port}")
    W.assert_error_body(r, codes=[400, 404])


WS_PORT = 8766
# A WebSocket echo server in plain python3 (no packages in the images): the handshake, then each
# client frame's payload sent back as a server text frame.
WS_SERVER = r'''
import base64, hashlib, socket, struct
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", %d)); s.listen(4)
while True:
    c, _ = s.accept()
    req = b""
    while b"\r\n\r\n" not in req:
        req += c.recv(4096)
    key = [l.split(b":", 1)[1].strip() for l in req.split(b"\r\n") if l.lower().startswith(b"sec-websocket-key:")][0]
    acc = base64.b64encode(hashlib.sha1(key + b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11").digest())
    c.sendall(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Accept: " + acc + b"\r\n\r\n")
    while True:
        h = c.recv(2)
        if len(h) < 2:
            break
        n = h[1] & 0x7f
        if n == 126:
            n = struct.unpack(">H", c.recv(2))[0]
        mask = c.recv(4)
        data = b""
        while len(data) < n:
            data += c.recv(n - len(data))
        data = bytes(b ^ mask[i %% 4] for i, b in enumerate(data))
        if h[0] & 0x0f == 8:
            break
        out = b"echo:" + data
        c.sendall(bytes([0x81, len(out)]) + out)
    c.close()
''' % WS_PORT


def _ws_roundtrip(endpoint: str, headers: dict, messages: list[bytes]) -> list[bytes]:
    """A minimal WebSocket client over a raw socket, through Warren's proxy."""
    import base64
    import socket

    hostport, _, path = endpoint.partition("/")
    host, port = hostport.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=10)
    key = base64.b64encode(os.urandom(16)).decode()
    extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    sock.sendall((f"GET /{path}/ws HTTP/1.1\r\nHost: {hostport}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                  f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n{extra}\r\n").encode())
    resp = b""
    while b"\r\n\r\n" not in resp:
        chunk = sock.recv(4096)
        assert chunk, f"connection closed during the handshake: {resp!r}"
        resp += chunk
    status = resp.split(b"\r\n", 1)[0]
    assert b" 101 " in status, f"expected 101 Switching Protocols, got {resp[:300]!r}"
    leftover = resp.split(b"\r\n\r\n", 1)[1]
    replies = []
    for m in messages:
        mask = os.urandom(4)
        sock.sendall(bytes([0x81, 0x80 | len(m)]) + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(m)))
        buf = leftover
        while len(buf) < 2 or len(buf) < 2 + buf[1]:
            buf += sock.recv(4096)
        replies.append(buf[2:2 + buf[1]])
        leftover = buf[2 + buf[1]:]
    sock.sendall(bytes([0x88, 0x80]) + os.urandom(4))
    sock.close()
    return replies


def test_websocket_through_the_proxy(make_sandbox):
    sbx = make_sandbox("host")
    sbx.files.write_file("/tmp/ws.py", WS_SERVER, mode=644)
    ex = sbx.commands.run("python3 /tmp/ws.py", opts=RunCommandOpts(background=True))
    assert ex.id
    ep = sbx.get_endpoint(WS_PORT)

    def attempt():
        try:
            return _ws_roundtrip(ep.endpoint, ep.headers, [b"one", b"two" * 20])
        except (AssertionError, OSError):
            return None

    replies = W.wait_until(attempt, 15, interval=0.3, message="WebSocket echo server inside the sandbox")
    assert replies == [b"echo:one", b"echo:" + b"two" * 20]
