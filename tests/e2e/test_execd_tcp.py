"""execd over TCP (`[runtime] execd_transport = "tcp"`): the transport of runtimes whose sandboxes
live elsewhere (a pod, a remote Docker host), served here by the embedded runtime on a loopback
port of the host (a server of its own, whatever the session's runtimes: once per session, on the
first runtime's turn).

A network listener is an open door unless it checks who calls: these tests call execd's port the
way anything else on the host (or, elsewhere, on the pod network) could — without the credential,
with a forged one, with the verifier that the sandbox can read — and look for the credential the
way code inside the sandbox would: in every process's command line and environment, in the files
Warren puts there, and in what a program behind the endpoint proxy receives. The official SDK
drives the sandbox through the server as usual, across a server restart too."""

from __future__ import annotations

import hashlib
import json
import secrets
import socket
import uuid

import httpx
import pytest
from opensandbox.models.execd import RunCommandOpts

import warren_e2e as W

HEADER = "X-EXECD-ACCESS-TOKEN"
APP_PORT = 8766

# A program that answers every request with the headers it received, as JSON.
ECHO_HEADERS = f"""
import http.server, json
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({{k.lower(): v for k, v in self.headers.items()}}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
http.server.ThreadingHTTPServer(("127.0.0.1", {APP_PORT}), H).serve_forever()
"""


def _start(work_root) -> W.WarrenServer:
    srv = W.WarrenServer("embedded", work_root, f"execd-tcp-{uuid.uuid4().hex[:6]}")
    srv.runtime_config = 'execd_transport = "tcp"\n'
    srv.check_binary()
    srv.start()
    return srv


@pytest.fixture(scope="module")
def tcp_server(runtime, work_root):
    W.skip_unless_first(runtime, work_root, "its server is an embedded one of its own, with execd over TCP")
    srv = _start(work_root)
    yield srv
    srv.stop()


def _execd_addr(srv, sid) -> tuple[str, int]:
    addr = W.sandbox_record(srv, sid)["runtime_state"]["execd_tcp"]
    host, port = addr.rsplit(":", 1)
    assert host == "127.0.0.1", addr
    return host, int(port)


def _create(srv, **kw):
    return W.sdk_sandbox(srv, srv.sandbox_image("host"), **kw)


@pytest.fixture(scope="module")
def sbx(tcp_server):
    s = _create(tcp_server, env={"PLAIN_VAR": "plain"})
    yield s
    s.kill()
    s.close()


def test_health_says_tcp(tcp_server):
    caps = httpx.get(f"{tcp_server.base_url}/health", timeout=10).json()["runtime"]["capabilities"]
    assert caps["execdTransport"] == "tcp", caps


def test_the_sdk_works_through_the_server(sbx):
    code, out, _ = W.sh(sbx, "echo hello; echo err >&2; exit 3")
    assert (code, out.strip()) == (3, "hello"), (code, out)
    sbx.files.write_file("/tmp/over-tcp.txt", "written over tcp")
    assert sbx.files.read_file("/tmp/over-tcp.txt") == "written over tcp"
    bg = sbx.commands.run("for i in 1 2 3; do echo line$i; done; sleep 60",
                          opts=RunCommandOpts(background=True))
    W.wait_until(lambda: "line3" in sbx.commands.get_background_command_logs(bg.id).content, 15,
                 message="background logs over tcp")
    sbx.commands.interrupt(bg.id)


def test_execd_s_port_refuses_every_caller_without_the_credential(tcp_server, sbx):
    host, port = _execd_addr(tcp_server, sbx.id)
    base = f"http://{host}:{port}"
    # The verifier execd is given (`--access-token-sha256`), which a sandbox may read.
    verifier = hashlib.sha256(W.execd_credential(tcp_server, sbx.id).encode()).hexdigest()
    for headers in ({}, {HEADER: ""}, {HEADER: secrets.token_hex(32)}, {HEADER: verifier},
                    {HEADER: verifier.upper()}, {"OPEN-SANDBOX-API-KEY": tcp_server.api_key},
                    {"X-Warren-Sandbox-Token": sbx.get_endpoint(44772).headers.get("X-Warren-Sandbox-Token", "")}):
        for method, path in (("GET", "/ping"), ("POST", "/command"), ("GET", "/files/download?path=/etc/hostname"),
                             ("GET", f"/proxy/{APP_PORT}/")):
            r = httpx.request(method, base + path, headers=headers, timeout=10,
                              json={"command": "touch /tmp/pwned"} if method == "POST" else None)
            assert r.status_code == 401, (headers, path, r.status_code, r.text[:200])
            assert r.json()["code"] == "UNAUTHORIZED", r.text
    # A WebSocket upgrade is refused the same way.
    r = httpx.get(base + "/pty", headers={"Connection": "Upgrade", "Upgrade": "websocket",
                                           "Sec-WebSocket-Version": "13",
                                           "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ=="}, timeout=10)
    assert r.status_code == 401, r.text
    code, _, _ = W.sh(sbx, "test -e /tmp/pwned")
    assert code != 0, "a request without the credential ran a command"
    # The server's credential opens it (so the refusals above are the check, not a dead port).
    r = httpx.get(base + "/ping", headers={HEADER: W.execd_credential(tcp_server, sbx.id)}, timeout=10)
    assert r.status_code == 200, r.text


def test_the_sandbox_cannot_find_or_reach_the_credential(tcp_server, sbx):
    credential = W.execd_credential(tcp_server, sbx.id)
    _, port = _execd_addr(tcp_server, sbx.id)
    # Everywhere a process of the sandbox could look: every process's command line and
    # environment, what Warren mounts into the sandbox, its own environment.
    script = (
        "for f in /proc/[0-9]*/cmdline /proc/[0-9]*/environ; do cat $f 2>/dev/null; echo; done; "
        "env; grep -rs . /.warren /tmp /workspace 2>/dev/null | head -c 1000000"
    )
    code, out, _ = W.sh(sbx, script)
    assert code == 0
    assert "PLAIN_VAR=plain" in out  # the search did read environments
    assert credential not in out, "the execd credential is readable inside the sandbox"
    # execd's port is on the host's loopback; the sandbox's 127.0.0.1 is its own.
    probe = f"python3 -c \"import socket; socket.create_connection(('127.0.0.1', {port}), 2)\""
    code, _, err = W.sh(sbx, probe)
    assert code != 0 and "refused" in err.lower(), err


def test_a_program_behind_the_endpoint_proxy_never_sees_the_credential(tcp_server, sbx):
    sbx.files.write_file("/tmp/echo_headers.py", ECHO_HEADERS)
    sbx.commands.run("python3 /tmp/echo_headers.py", opts=RunCommandOpts(background=True))
    ep = sbx.get_endpoint(APP_PORT)
    url = f"http://{ep.endpoint}/"

    def seen(extra):
        r = httpx.get(url, headers={**ep.headers, **extra}, timeout=10)
        return r.status_code == 200 and r.json()

    got = W.wait_until(lambda: seen({}), 15, interval=0.2, message="the header echo to answer")
    assert HEADER.lower() not in got, got
    # A client's own header of that name does not pass either (nor could it open execd).
    got = seen({HEADER: "from-the-client"})
    assert HEADER.lower() not in got, got
    assert W.execd_credential(tcp_server, sbx.id) not in json.dumps(got)


def test_a_restarted_server_reaches_its_sandboxes_over_tcp_again(work_root, runtime):
    W.skip_unless_first(runtime, work_root, "its server is an embedded one of its own, with execd over TCP")
    from opensandbox import SandboxSync
    srv = _start(work_root)
    try:
        sbx = _create(srv)
        sbx.files.write_file("/tmp/before.txt", "before")
        _, port = _execd_addr(srv, sbx.id)
        sbx.close()
        srv.kill9()
        srv.start()
        again = SandboxSync.connect(sbx.id, connection_config=srv.sdk_config())
        try:
            code, out, _ = W.sh(again, "cat /tmp/before.txt")
            assert (code, out.strip()) == (0, "before"), (code, out)
        finally:
            again.kill()
            again.close()
        # Deleted: its port is closed.
        W.wait_until(lambda: _refused(port), 10, interval=0.2, message="execd's port to close")
    finally:
        srv.stop()


def _refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), 1).close()
        return False
    except OSError:
        return True
