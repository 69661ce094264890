"""A fake internet for egress tests and benchmarks, made entirely of things the caller creates:

- a network namespace linked to the host by a veth pair (host end 198.18.K.1/24), whose addresses
  198.18.K.2-.4 serve HTTP on port 80 (each answers with the address it was reached on and the
  Authorization header it got, and logs the request to `request_log`; `/stream` never ends) and
  HTTPS on port 443 with a certificate of its own CA (for the `.test` names);
- the same servers on internal addresses (one each in 10/8, 172.16/12, 192.168/16 and the CGNAT
  100.64/10, in /24s no host address or route uses), routed to the namespace by /32 routes on the
  veth: the networks an allow must not reach unless a rule names them. `private.test` (exact) and
  `db.wild.test` (under a wildcard) resolve to two of them;
- a DNS server on the host's loopback answering the `.test` zone and logging every name it is asked.

K is the first /24 of 198.18.0.0/16 that no host address or route uses yet: a fake internet left
behind by a killed run (its veth keeps the host end's address) would otherwise take the packets
meant for this one, and two runs at once would do the same to each other.

Nothing here sends a packet anywhere but loopback and that namespace."""

from __future__ import annotations

import secrets
import socket
import subprocess
import threading
import time
from pathlib import Path

# name -> last byte of its address in the fake internet's /24
ZONE = {
    "allowed.test": 2,
    "other.test": 3,
    "api.wild.test": 4,
    "denied.test": 3,
}

SERVER = r'''
import http.server, socketserver, ssl, sys, threading, time
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True
    def do_GET(self):
        local = self.connection.getsockname()[0]
        if self.path == "/stream":
            self.send_response(200); self.send_header("Transfer-Encoding", "chunked"); self.end_headers()
            try:
                while True:
                    line = f"tick from {local}\n".encode()
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line)); self.wfile.flush()
                    time.sleep(0.05)
            except OSError:
                return
        auth = self.headers.get('Authorization')
        with open(sys.argv[3], "a") as log:
            log.write(f"{local} {self.path} authorization={auth} x-key={self.headers.get('X-Key')}\n")
        body = f"hello from {local} auth={auth}\n".encode()
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)
    def do_POST(self):
        local = self.connection.getsockname()[0]
        body = self.rfile.read(int(self.headers.get('Content-Length') or 0))
        with open(sys.argv[3], "a") as log:
            log.write(f"{local} POST {self.path} x-key={self.headers.get('X-Key')} body={body.decode(errors='replace')}\n")
        out = f"posted to {local}\n".encode()
        self.send_response(200); self.send_header("Content-Length", str(len(out))); self.end_headers()
        self.wfile.write(out)
    def log_message(self, *a): pass
class S(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    allow_reuse_address = True
tls = S(("0.0.0.0", 443), H)
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER); ctx.load_cert_chain(sys.argv[1], sys.argv[2])
tls.socket = ctx.wrap_socket(tls.socket, server_side=True)
threading.Thread(target=tls.serve_forever, daemon=True).start()
S(("0.0.0.0", 80), H).serve_forever()
'''


def dns_answer(query: bytes, names: list[str], zone: dict[str, str]) -> bytes:
    """A minimal authoritative answer for `zone` (A records only; NXDOMAIN otherwise)."""
    pos, labels = 12, []
    while query[pos]:
        n = query[pos]
        labels.append(query[pos + 1:pos + 1 + n].decode().lower())
        pos += n + 1
    qend = pos + 5
    qtype = int.from_bytes(query[pos + 1:pos + 3], "big")
    name = ".".join(labels)
    names.append(name)
    ip = zone.get(name)
    header = bytearray(query[:12])
    header[2] = 0x84 | (query[2] & 1)
    header[3] = 0x80 | (0 if ip else 3)
    header[6:12] = (1 if ip and qtype == 1 else 0).to_bytes(2, "big") + b"\0\0\0\0"
    out = bytes(header) + query[12:qend]
    if ip and qtype == 1:
        out += b"\xc0\x0c\x00\x01\x00\x01" + (30).to_bytes(4, "big") + b"\x00\x04" + socket.inet_aton(ip)
    return out


def make_ca(folder: Path) -> tuple[Path, Path, Path]:
    """A CA and a server certificate for every ZONE name; returns (ca.pem, cert.pem, key.pem)."""
    ca_key, ca, key, csr, cert = (folder / n for n in ("ca.key", "ca.pem", "srv.key", "srv.csr", "srv.pem"))
    run = lambda *a: subprocess.run(a, check=True, capture_output=True)  # noqa: E731
    run("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=fakenet CA",
        "-keyout", str(ca_key), "-out", str(ca))
    run("openssl", "req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=allowed.test",
        "-keyout", str(key), "-out", str(csr))
    ext = folder / "san.ext"
    ext.write_text("subjectAltName=" + ",".join(f"DNS:{n}" for n in ZONE) + "\n")
    run("openssl", "x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key), "-CAcreateserial",
        "-days", "2", "-extfile", str(ext), "-out", str(cert))
    return ca, cert, key


def _used() -> str:
    used = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True, check=True).stdout
    return used + subprocess.run(["ip", "-4", "route"], capture_output=True, text=True, check=True).stdout


def free_net(prefix: str = "198.18", start: int = 0, step: int = 1) -> str:
    """The first `prefix`.K (a /24, K from `start` by `step`) that no host address or route
    mentions."""
    used = _used()
    for k in range(start, 256 if step > 0 else -1, step):
        if f"{prefix}.{k}." not in used and f"{prefix}.{k}.0/" not in used:
            return f"{prefix}.{k}"
    raise RuntimeError(f"every {prefix}.K.0/24 is in use on this host")


# label -> (first two bytes, where the search for a free /24 starts, its direction)
INTERNAL = {
    "10": ("10.254", 255, -1),
    "172": ("172.31", 255, -1),
    "192": ("192.168", 254, -1),
    "100": ("100.127", 255, -1),
}


class FakeNet:
    def __init__(self, folder: Path):
        tag = secrets.token_hex(2)
        self.folder = folder
        self.ns, self.host_if = f"wfn{tag}", f"wfh{tag}"
        self.names: list[str] = []
        net = free_net()
        self.host_ip = f"{net}.1"
        # name -> address, for the DNS answers and the tests' expectations
        self.zone = {name: f"{net}.{last}" for name, last in ZONE.items()}
        # label -> an internal address served from the namespace
        self.internal = {label: f"{free_net(*spec)}.2" for label, spec in INTERNAL.items()}
        self.zone["private.test"] = self.internal["10"]
        self.zone["db.wild.test"] = self.internal["172"]
        self.procs: list[subprocess.Popen] = []
        self._stop = threading.Event()

    def __enter__(self) -> "FakeNet":
        run = lambda *a: subprocess.run(a, check=True, capture_output=True)  # noqa: E731
        run("ip", "netns", "add", self.ns)
        try:
            run("ip", "link", "add", self.host_if, "type", "veth", "peer", "name", "eth0", "netns", self.ns)
            run("ip", "addr", "add", f"{self.host_ip}/24", "dev", self.host_if)
            run("ip", "link", "set", self.host_if, "up")
            for a in sorted(set(self.zone.values())):
                run("ip", "-n", self.ns, "addr", "add", f"{a}/24", "dev", "eth0")
            for a in self.internal.values():
                run("ip", "-n", self.ns, "addr", "add", f"{a}/32", "dev", "eth0")
            run("ip", "-n", self.ns, "link", "set", "eth0", "up")
            for a in self.internal.values():
                run("ip", "route", "add", f"{a}/32", "via", self.zone["allowed.test"], "dev", self.host_if)
            run("ip", "-n", self.ns, "link", "set", "lo", "up")
            self.folder.mkdir(parents=True, exist_ok=True)
            self.ca, cert, key = make_ca(self.folder)
            script = self.folder / "fakenet-server.py"
            script.write_text(SERVER)
            self.request_log = self.folder / "requests.log"
            self.request_log.touch()
            self.procs.append(subprocess.Popen(["ip", "netns", "exec", self.ns, "python3", str(script),
                                                str(cert), str(key), str(self.request_log)]))
            self.dns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            self.dns.bind(("127.0.0.1", 0))
            self.dns_port = self.dns.getsockname()[1]
            self.thread = threading.Thread(target=self._serve_dns, daemon=True)
            self.thread.start()
            deadline = time.time() + 10
            while True:
                try:
                    socket.create_connection((self.zone["allowed.test"], 443), timeout=1).close()
                    break
                except OSError:
                    if time.time() > deadline:
                        raise RuntimeError("the fake internet did not come up")
                    time.sleep(0.05)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _serve_dns(self) -> None:
        self.dns.settimeout(0.2)
        while not self._stop.is_set():
            try:
                q, addr = self.dns.recvfrom(4096)
            except OSError:
                continue
            self.dns.sendto(dns_answer(q, self.names, self.zone), addr)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if getattr(self, "thread", None):
            self.thread.join(2)
            self.dns.close()
        for p in self.procs:
            p.terminate()
            p.wait(5)
        subprocess.run(["ip", "link", "del", self.host_if], capture_output=True)
        subprocess.run(["ip", "netns", "del", self.ns], capture_output=True)
