"""The Docker runtime with a daemon on another host (`[docker] host = "tcp://…"` with TLS), driven by
the official SDK.

The other host is real as far as Warren can tell: `remote_docker.RemoteDocker` starts Debian's
dockerd in a network namespace of its own, reached only over a veth link, on TCP with TLS and client
certificates. Nothing of this host is mounted into its containers: execd is uploaded once into a
volume on that daemon and reached on the port the daemon publishes, with the sandbox's credential.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import socket
import uuid

import httpx
import pytest

import warren_e2e as W
from remote_docker import RemoteDocker

IMAGE = "warren-e2e-remote:1"
APP_PORT = 8768


@pytest.fixture(scope="module")
def remote(work_root):
    if shutil.which("dockerd") is None or shutil.which("openssl") is None:
        msg = "the remote Docker tests need Debian's docker.io and openssl (scripts/install-deps installs them)"
        if W.allow_skip():
            pytest.skip(msg)
        pytest.fail(msg, pytrace=False)
    rd = RemoteDocker(work_root)
    try:
        rd.import_rootfs(IMAGE, W.test_rootfs())
        yield rd
    finally:
        rd.close()


def _server(work_root, remote, certs=None) -> W.WarrenServer:
    srv = W.WarrenServer("docker", work_root, f"rdock-{uuid.uuid4().hex[:6]}")
    srv.docker_host = remote.host
    srv.docker_config = f'tls_cert_path = "{certs or remote.client_certs}"\n'
    srv.check_binary()
    srv.start()
    return srv


@pytest.fixture(scope="module")
def rdock(work_root, remote):
    srv = _server(work_root, remote)
    yield srv
    srv.stop()


def _create(srv, **kw):
    return W.sdk_sandbox(srv, IMAGE, **kw)


def _through_relay(relay, target, method, path, token=None, body=""):
    """One raw HTTP request to execd at `target` through the relay: its status, or None when the
    relay closed the connection without an answer."""
    import socket
    head = [f"{method} {path} HTTP/1.1", "Host: execd", "Connection: close", f"Content-Length: {len(body)}",
            "Content-Type: application/json"]
    if token:
        head.append(f"X-EXECD-ACCESS-TOKEN: {token}")
    data = b""
    with socket.create_connection(relay, timeout=15) as s:
        s.sendall(f"WARREN-RELAY {target}\n".encode() + ("\r\n".join(head) + "\r\n\r\n" + body).encode())
        try:
            while chunk := s.recv(4096):
                data += chunk
        except ConnectionResetError:  # closed with the request unread
            pass
    if not data.startswith(b"HTTP/1."):
        return None, data
    return int(data.split()[1]), data


def _container(remote, sid):
    out = remote.docker("ps", "-aq", "--no-trunc", "--filter", f"label=io.warren.sandbox={sid}").stdout.split()
    return remote.inspect(out[0]) if out else None


def test_health_reports_tcp_and_no_egress_enforcement(rdock):
    info = httpx.get(f"{rdock.base_url}/health", timeout=10).json()["runtime"]
    assert info["kind"] == "docker", info
    caps = info["capabilities"]
    assert caps["execdTransport"] == "tcp" and caps["pause"] is True, caps
    # Warren cannot reach into a remote host's network namespaces: a policy would not be enforced.
    assert caps["egressPolicy"] is False, caps
    # Nor mount this host's folders there: named volumes only.
    assert caps["hostVolumes"] == "none", caps


def test_the_sdk_drives_a_sandbox_on_a_daemon_on_another_host(rdock, remote):
    sbx = _create(rdock, env={"AGENT": "remote"}, metadata={"team": "e2e"})
    try:
        c = _container(remote, sbx.id)
        assert c is not None, "no container on the remote daemon"
        # Nothing of Warren's host is mounted: execd comes from a volume on the daemon, read-only.
        mounts = c["Mounts"]
        assert all(m["Type"] == "volume" for m in mounts), mounts
        (execd_vol,) = [m for m in mounts if m["Destination"] == "/.warren/bin"]
        assert execd_vol["RW"] is False, execd_vol
        assert not c["HostConfig"].get("Binds"), c["HostConfig"].get("Binds")
        # The container carries execd's verifier, never the credential the server sends.
        credential = W.execd_credential(rdock, sbx.id)
        assert credential not in json.dumps(c)
        assert hashlib.sha256(credential.encode()).hexdigest() in c["Config"]["Entrypoint"]

        code, out, _ = W.sh(sbx, "echo $AGENT; id -u")
        assert (code, out.split("\n")[:2]) == (0, ["remote", "0"]), out
        W.files_logs_and_proxy_work(sbx, "the remote container", APP_PORT)

        # Nothing of the sandbox is published: the one way in is the relay, which opens execd only
        # with the credential: not without, not with the verifier the container shows, not with
        # the API key or the sandbox's secret.
        assert not any(c["NetworkSettings"]["Ports"].values()), c["NetworkSettings"]["Ports"]
        relay = (remote.ip, 44773)
        ip = next(iter(c["NetworkSettings"]["Networks"].values()))["IPAddress"]
        secret = W.sandbox_record(rdock, sbx.id)["token"]
        body = '{"command": "touch /tmp/remote-pwned"}'
        for token in (None, hashlib.sha256(credential.encode()).hexdigest(), rdock.api_key, secret):
            status, _ = _through_relay(relay, ip, "POST", "/command", token, body)
            assert status == 401, (token, status)
        assert _through_relay(relay, ip, "GET", "/ping", credential)[0] == 200
        code, out, _ = W.sh(sbx, "ls /tmp/remote-pwned 2>&1 || true")
        assert "No such file" in out, out
        # The relay reaches execd's port of the sandboxes' network only.
        for target in (remote.ip, remote.host_ip, "127.0.0.1"):
            assert _through_relay(relay, target, "GET", "/ping", credential)[0] is None, target

        # Pause and resume go through the daemon; the sandbox goes on after.
        sbx.pause()
        assert remote.inspect(c["Id"])["State"]["Paused"] is True
        from opensandbox import SandboxSync
        sbx = SandboxSync.resume(sbx.id, connection_config=rdock.sdk_config())
        code, out, _ = W.sh(sbx, f"cat /tmp/e2e-{APP_PORT}.txt")
        assert (code, out.strip()) == (0, "via the remote container"), out
    finally:
        sbx.kill()
        sbx.close()
    W.wait_until(lambda: _container(remote, sbx.id) is None, 20, message="the remote container to be removed")


def test_sandboxes_have_no_network_and_cannot_reach_each_other_or_the_daemon(rdock, remote):
    a, b = _create(rdock), _create(rdock)
    try:
        b_ip = next(iter(_container(remote, b.id)["NetworkSettings"]["Networks"].values()))["IPAddress"]
        assert b_ip, "the sandbox has no address on its network"
        probe = ("import socket,sys\n"
                 "host, port = sys.argv[1], int(sys.argv[2])\n"
                 "s = socket.socket(); s.settimeout(3)\n"
                 "try:\n"
                 "    s.connect((host, port)); s.sendall(b'GET /version HTTP/1.0\\r\\n\\r\\n')\n"
                 "    print('answer', s.recv(200))\n"
                 "except OSError as e:\n"
                 "    print('no way', e)\n")
        a.files.write_file("/tmp/probe.py", probe)
        # Another sandbox's execd, straight over the sandboxes' network: traffic between them is off.
        code, out, _ = W.sh(a, f"python3 /tmp/probe.py {b_ip} 44772")
        assert out.startswith("no way"), out
        # The daemon's own host is reachable (Docker's internal networks stop only traffic beyond
        # it), but its API wants a client certificate no sandbox has, and the relay takes no
        # connection from a sandbox.
        code, out, _ = W.sh(a, f"python3 /tmp/probe.py {remote.ip} {remote.port}")
        assert "ApiVersion" not in out, out
        code, out, _ = W.sh(a, f"python3 /tmp/probe.py {remote.ip} 44773")
        assert "HTTP" not in out, out
        # No network beyond it, as everywhere by default: not this host, where a test server listens.
        with socket.create_server((remote.host_ip, 0)) as listener:
            code, out, _ = W.sh(a, f"python3 /tmp/probe.py {remote.host_ip} {listener.getsockname()[1]}")
        assert out.startswith("no way"), out
    finally:
        for s in (a, b):
            s.kill()
            s.close()


def test_host_volumes_and_network_policies_are_refused_and_nothing_is_left(rdock, remote):
    before = set(remote.containers())
    vols_before = remote.docker("volume", "ls", "-q").stdout.split()
    rdock.host_volumes.mkdir(parents=True, exist_ok=True)
    body = W.create_body(IMAGE, volumes=[
        {"name": "scratch", "pvc": {"claimName": "remote-e2e-scratch", "createIfNotExists": True,
                                    "deleteOnSandboxTermination": True}, "mountPath": "/scratch"},
        {"name": "v", "host": {"path": str(rdock.host_volumes)}, "mountPath": "/mnt/x"}])
    with rdock.client() as c:
        r = c.post("/v1/sandboxes", json=body)
    # what this runtime cannot do is a 501, as on Kubernetes
    W.assert_error_body(r, codes=[501])
    assert "pvc" in r.json()["message"], r.text
    assert set(remote.containers()) == before
    assert remote.docker("volume", "ls", "-q").stdout.split() == vols_before
    # A policy Warren could not enforce there is refused, not ignored.
    policy = {"defaultAction": "deny", "egress": [{"action": "allow", "target": "example.com"}]}
    with rdock.client() as c:
        r = c.post("/v1/sandboxes", json=W.create_body(IMAGE, networkPolicy=policy))
    W.assert_error_body(r, codes=[400])
    assert "cannot enforce network policies on sandboxes on a remote Docker daemon" in r.json()["message"], r.text
    assert set(remote.containers()) == before


def test_a_client_certificate_from_another_ca_is_refused(work_root, remote):
    srv = _server(work_root, remote, certs=remote.stranger_certs)
    try:
        before = set(remote.containers())
        with srv.client() as c:
            r = c.post("/v1/sandboxes", json=W.create_body(IMAGE))
        W.assert_error_body(r, codes=[503])
        assert remote.ip in r.json()["message"], r.text
        assert set(remote.containers()) == before
    finally:
        srv.stop()


def test_a_restarted_server_finds_its_remote_sandboxes(work_root, remote):
    from opensandbox import SandboxSync
    srv = _server(work_root, remote)
    try:
        kept = _create(srv)
        kept.files.write_file("/tmp/before-restart.txt", "before")
        kept.close()
        srv.kill9()
        srv.start()
        again = SandboxSync.connect(kept.id, connection_config=srv.sdk_config())
        try:
            code, out, _ = W.sh(again, "cat /tmp/before-restart.txt")
            assert (code, out.strip()) == (0, "before"), out
        finally:
            again.kill()
            again.close()
    finally:
        srv.stop()


def test_a_pruned_network_is_made_again_and_the_relay_follows(rdock, remote):
    """`docker network prune` once no sandbox uses Warren's network: the next create makes it again,
    perhaps on another subnet, and the relay, which reaches one subnet only, is made again for it."""
    _create(rdock).kill()  # the network and the relay exist
    W.wait_until(lambda: not remote.docker("ps", "-aq", "--filter", "label=io.warren.sandbox").stdout.split(),
                 30, message="no sandbox left on the remote daemon")
    old = json.loads(remote.docker("network", "inspect", "warren-sandboxes").stdout)[0]["IPAM"]["Config"][0]["Subnet"]
    remote.docker("network", "rm", "warren-sandboxes")
    # the old subnet is taken meanwhile, so the network comes back on another one
    remote.docker("network", "create", "--subnet", old, "e2e-decoy")
    try:
        sbx = _create(rdock)
        try:
            code, out, _ = W.sh(sbx, "echo again")
            assert (code, out.strip()) == (0, "again"), out
            new = json.loads(remote.docker("network", "inspect", "warren-sandboxes").stdout)[0]["IPAM"]["Config"][0]
            assert new["Subnet"] != old, new
            relay = remote.inspect("warren-relay")
            assert relay["Config"]["Labels"]["io.warren.relay.to"] == new["Subnet"], relay["Config"]["Labels"]
        finally:
            sbx.kill()
            sbx.close()
    finally:
        W.wait_until(lambda: not remote.docker("ps", "-aq", "--filter", "label=io.warren.sandbox").stdout.split(),
                     30, message="no sandbox left on the remote daemon")
        remote.docker("network", "rm", "e2e-decoy", check=False)
