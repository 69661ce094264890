"""TLS for the API and the proxy: a certificate and key from files, read again on
SIGHUP (a broken file leaves the served one in place); a development certificate Warren makes on
request; and the official SDK with `protocol="https"`, trusting a CA bundle, driving a sandbox —
lifecycle, commands, files and an endpoint — over HTTPS only."""

from __future__ import annotations

import os
import signal
import socket
import ssl
import subprocess
import time
import uuid
from datetime import timedelta
from pathlib import Path

import httpx
import pytest

import warren_e2e as W


def _openssl(*args, cwd: Path) -> None:
    out = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def _make_ca(d: Path) -> Path:
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
             "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=e2e test CA",
             "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=d)
    return d / "ca.pem"


def _make_leaf(d: Path, cn: str) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and localhost named `cn`, signed by the CA in `d`."""
    (d / "ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n"
                           "keyUsage=critical,digitalSignature\n")
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
             "-keyout", f"{cn}.key", "-out", f"{cn}.csr", "-subj", f"/CN={cn}", cwd=d)
    _openssl("x509", "-req", "-in", f"{cn}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
             "-CAcreateserial", "-out", f"{cn}.pem", "-days", "2", "-extfile", "ext", cwd=d)
    return d / f"{cn}.pem", d / f"{cn}.key"


def _served_cn(port: int, ca: Path) -> str:
    ctx = ssl.create_default_context(cafile=str(ca))
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        with ctx.wrap_socket(s, server_hostname="127.0.0.1") as t:
            subject = dict(x[0] for x in t.getpeercert()["subject"])
            return subject["commonName"]


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    d = tmp_path_factory.mktemp("tls")
    ca = _make_ca(d)
    first = _make_leaf(d, "warren-first")
    second = _make_leaf(d, "warren-second")
    # What the server reads: copies the test replaces.
    cert, key = d / "served.pem", d / "served.key"
    cert.write_bytes(first[0].read_bytes())
    key.write_bytes(first[1].read_bytes())
    return {"ca": ca, "cert": cert, "key": key, "first": first, "second": second}


@pytest.fixture(scope="module")
def srv(work_root, certs):
    s = W.WarrenServer("embedded", work_root, f"tls-{uuid.uuid4().hex[:6]}")
    s.more_config = f'[tls]\ncert_file = "{certs["cert"]}"\nkey_file = "{certs["key"]}"\n'
    s.scheme, s.ca_file = "https", certs["ca"]
    s.check_binary()
    s.start()
    yield s
    s.stop()


def test_the_official_sdk_drives_a_sandbox_over_https(srv, certs):
    from opensandbox import SandboxSync
    from opensandbox.config import ConnectionConfigSync
    from opensandbox.models.execd import RunCommandOpts
    ctx = ssl.create_default_context(cafile=str(certs["ca"]))
    config = ConnectionConfigSync(domain=srv.domain, api_key=srv.api_key, protocol="https",
                                  transport=httpx.HTTPTransport(verify=ctx),
                                  request_timeout=timedelta(seconds=60))
    sbx = SandboxSync.create("host", connection_config=config, timeout=timedelta(minutes=5),
                             ready_timeout=timedelta(seconds=60))
    W.track_sandbox(sbx.id)
    try:
        code, out, _ = W.sh(sbx, "echo over-tls")
        assert code == 0 and out.strip() == "over-tls"
        sbx.files.write_file("/tmp/t.txt", "secret over tls")
        assert sbx.files.read_file("/tmp/t.txt") == "secret over tls"
        sbx.commands.run("python3 -m http.server 8766 --bind 127.0.0.1 --directory /tmp",
                         opts=RunCommandOpts(background=True))
        ep = sbx.get_endpoint(8766)
        r = W.wait_until(lambda: (x := httpx.get(f"https://{ep.endpoint}/t.txt", headers=ep.headers,
                                                 verify=ctx, timeout=10)).status_code == 200 and x,
                         20, interval=0.2, message="the app over https")
        assert r.text == "secret over tls"
        # A signed URL over https too.
        signed = sbx.get_signed_endpoint(8766, int(time.time()) + 60)
        assert httpx.get(f"https://{signed.endpoint}/t.txt", verify=ctx, timeout=10).text == "secret over tls"
    finally:
        sbx.kill()
        sbx.close()
    # Plain HTTP on the TLS port gets no HTTP answer; a client that does not trust the CA refuses.
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{srv.port}/health", timeout=5)
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(f"https://127.0.0.1:{srv.port}/health", timeout=5)


def test_sighup_serves_a_renewed_certificate_and_keeps_the_old_one_when_the_new_is_broken(srv, certs):
    assert _served_cn(srv.port, certs["ca"]) == "warren-first"
    # A renewed certificate: served to the next connection after SIGHUP, with no restart.
    certs["cert"].write_bytes(certs["second"][0].read_bytes())
    certs["key"].write_bytes(certs["second"][1].read_bytes())
    os.kill(srv.proc.pid, signal.SIGHUP)
    W.wait_until(lambda: _served_cn(srv.port, certs["ca"]) == "warren-second", 10,
                 message="the renewed certificate to be served")
    # A key that is not the certificate's: refused, and the served certificate stays.
    certs["key"].write_bytes(certs["first"][1].read_bytes())
    os.kill(srv.proc.pid, signal.SIGHUP)
    W.wait_until(lambda: "TLS certificate not reloaded" in srv.log_tail(100), 10,
                 message="the refused reload to be logged")
    assert _served_cn(srv.port, certs["ca"]) == "warren-second"
    assert srv.client().get("/health").json()["status"] == "healthy"
    certs["key"].write_bytes(certs["second"][1].read_bytes())


def test_a_development_certificate_on_request(work_root):
    s = W.WarrenServer("embedded", work_root, f"devtls-{uuid.uuid4().hex[:6]}")
    s.more_config = "[tls]\nself_signed = true\n"
    s.scheme, s.ca_file = "https", s.data_dir / "tls" / "ca.pem"
    s.check_binary()
    s.start()
    try:
        assert "clients trust" in s.log_tail(50) and str(s.ca_file) in s.log_tail(50)
        # Its CA verifies it for 127.0.0.1 and localhost, with a strict verifier (Python's).
        ctx = ssl.create_default_context(cafile=str(s.ca_file))
        ctx.verify_flags |= ssl.VERIFY_X509_STRICT
        for host in ("127.0.0.1", "localhost"):
            r = httpx.get(f"https://{host}:{s.port}/health", verify=ctx, timeout=10)
            assert r.json()["status"] == "healthy", r.text
        assert oct((s.data_dir / "tls" / "key.pem").stat().st_mode & 0o777) == "0o600"
        # A restart keeps the certificate (clients keep trusting the same CA).
        ca = s.ca_file.read_bytes()
        s.terminate()
        s.start()
        assert s.ca_file.read_bytes() == ca
    finally:
        s.stop()


def test_a_certificate_that_does_not_load_stops_the_start_with_a_clear_error(work_root, certs):
    s = W.WarrenServer("embedded", work_root, f"badtls-{uuid.uuid4().hex[:6]}")
    # A key that is not the certificate's.
    s.more_config = f'[tls]\ncert_file = "{certs["first"][0]}"\nkey_file = "{certs["second"][1]}"\n'
    s.check_binary()
    with pytest.raises(AssertionError, match="exited with code"):
        s.start()
    log = s.log_tail(20)
    assert "[tls]" in log and "is not" in log and "key" in log, log
