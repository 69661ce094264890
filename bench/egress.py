"""Egress benchmark: what the policy path adds to a sandbox's HTTPS requests.

One run builds the fake internet of the egress tests (tests/e2e/fakenet.py: a network namespace of
its own with HTTPS servers, a DNS server on loopback), starts its own `warren serve` whose DNS filter
forwards there, and runs the same Python client twice:

- direct: in the host's namespace, straight to the fake server;
- policy path: in a sandbox whose policy allows `allowed.test` (veth, nftables checks per packet,
  NAT), the name resolved once through Warren's DNS filter;
- vault path: in a sandbox with the credential proxy and a binding for `allowed.test` (every request
  intercepted: TLS with the sandbox's CA, a header injected, TLS again to the server);

each doing --n requests with a new TCP connection + TLS handshake each, then --n requests over one
kept connection, timed inside the client. It also times DNS lookups through the filter against
asking the upstream directly.
    .ci/cache/venv/bin/python bench/egress.py --n 300
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "e2e"))
sys.path.insert(0, str(REPO / "bench"))

from fakenet import FakeNet  # noqa: E402
from lifecycle import Server, pct  # noqa: E402

CLIENT = r'''
import json, socket, ssl, sys, time
n, ca, target = int(sys.argv[1]), sys.argv[2], sys.argv[3]
ctx = ssl.create_default_context(cafile=None if ca == "default" else ca)
ip = socket.gethostbyname("allowed.test") if target == "sandbox" else target
def get(s, path):
    s.sendall(f"GET {path} HTTP/1.1\r\nHost: allowed.test\r\n\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head:
        head += s.recv(65536)
    head, _, body = head.partition(b"\r\n\r\n")
    lengths = [int(l.split(b":")[1]) for l in head.split(b"\r\n") if l.lower().startswith(b"content-length")]
    if lengths:
        while len(body) < lengths[0]:
            body += s.recv(65536)
    else:  # chunked (the vault proxy re-frames answers it may redact)
        while not body.endswith(b"0\r\n\r\n"):
            body += s.recv(65536)
    return body
def connect():
    raw = socket.create_connection((ip, 443), timeout=5)
    raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return ctx.wrap_socket(raw, server_hostname="allowed.test")
fresh, reuse, dns = [], [], []
for _ in range(n):  # a new TCP connection and TLS handshake per request
    t0 = time.perf_counter()
    with connect() as s:
        get(s, "/v1/fresh")
    fresh.append((time.perf_counter() - t0) * 1000)
with connect() as s:  # one connection, request after request (as API clients do)
    for _ in range(n):
        t0 = time.perf_counter()
        get(s, "/v1/reuse")
        reuse.append((time.perf_counter() - t0) * 1000)
retries = 0
def query(name, server):
    global retries
    q = bytes.fromhex("abcd01000001000000000000") + b"".join(bytes([len(l)]) + l.encode() for l in name.split(".")) + bytes.fromhex("0000010001")
    u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u.settimeout(1)
    t0 = time.perf_counter()
    for _ in range(5):  # as a stub resolver would
        u.sendto(q, server)
        try:
            u.recv(512)
            break
        except TimeoutError:
            retries += 1
    return (time.perf_counter() - t0) * 1000
server = (sys.argv[4], int(sys.argv[5]))
for _ in range(n):
    dns.append(query("allowed.test", server))
print(json.dumps({"fresh": fresh, "reuse": reuse, "dns": dns, "dns_retries": retries}))
'''


def row(name: str, ms: list[float]) -> dict:
    return {"kind": name, "n": len(ms), "p50": pct(ms, 50), "p90": pct(ms, 90), "p99": pct(ms, 99),
            "mean": statistics.fmean(ms)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=300)
    ap.add_argument("--warren", default=str(REPO / "target/x86_64-unknown-linux-gnu/release/warren"))
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="warren-egress-bench-"))
    rootfs = os.environ.get("WARREN_TEST_ROOTFS", "/var/cache/warren/test-rootfs")
    with FakeNet(work / "fakenet") as net:
        allowed_ip = net.zone["allowed.test"]
        server = Server(Path(args.warren), "embedded", 2, extra_config=(
            f'[network]\nsubnet = "10.232.0.0/24"\ndns_upstream = "127.0.0.1:{net.dns_port}"\n'
            f'upstream_ca_files = ["{net.ca}"]\n'))
        try:
            from opensandbox import SandboxSync
            from opensandbox.config import ConnectionConfigSync
            from opensandbox.models.sandboxes import (Credential, CredentialAuth, CredentialBinding,
                                                      CredentialMatch, CredentialProxyConfig,
                                                      InlineCredentialSource, NetworkPolicy)
            cfg = ConnectionConfigSync(domain=f"127.0.0.1:{server.port}", api_key=server.key)
            policy = NetworkPolicy.model_validate(
                {"defaultAction": "deny", "egress": [{"action": "allow", "target": "allowed.test"}]})
            rss_before = server.rss_kib()

            def run_in(sbx, ca: str) -> dict:
                sbx.files.write_file("/tmp/client.py", CLIENT)
                # Inside, port 53 anywhere is Warren's filter.
                ex = sbx.commands.run(f"python3 /tmp/client.py {args.n} {ca} sandbox {allowed_ip} 53")
                if ex.exit_code != 0:
                    raise SystemExit(f"sandbox client failed: {''.join(m.text for m in ex.logs.stderr)}")
                return json.loads("".join(m.text for m in ex.logs.stdout))

            sbx = SandboxSync.create("host", connection_config=cfg, network_policy=policy)
            try:
                sbx.files.write_file("/tmp/ca.pem", net.ca.read_text())
                inside = run_in(sbx, "/tmp/ca.pem")
                rss_linked = server.rss_kib()
            finally:
                sbx.kill()
            # The vault path: a binding for allowed.test, so every request is intercepted (TLS
            # terminated with the sandbox's CA, header injected, re-encrypted to the server).
            subprocess.run([args.warren, "image", "import", "bench-test", rootfs, "--data-dir",
                            str(server.dir / "data")], check=True, capture_output=True)
            sbx = SandboxSync.create("bench-test", connection_config=cfg, network_policy=policy,
                                     credential_proxy=CredentialProxyConfig(enabled=True))
            try:
                sbx.credential_vault.create(
                    credentials=[Credential(name="k", source=InlineCredentialSource(value="bench-secret-value"))],
                    bindings=[CredentialBinding(name="b", match=CredentialMatch(hosts=["allowed.test"]),
                                                auth=CredentialAuth(type="bearer", credential="k"))])
                vault = run_in(sbx, "default")
            finally:
                sbx.kill()
            script = work / "client.py"
            script.write_text(CLIENT)
            direct = json.loads(subprocess.run(
                [sys.executable, str(script), str(args.n), str(net.ca), allowed_ip, "127.0.0.1", str(net.dns_port)],
                check=True, capture_output=True, text=True).stdout)
        finally:
            server.stop()
    rows = [row("HTTPS new conn, direct", direct["fresh"]),
            row("HTTPS new conn, policy path", inside["fresh"]),
            row("HTTPS new conn, vault path", vault["fresh"]),
            row("HTTPS kept conn, direct", direct["reuse"]),
            row("HTTPS kept conn, policy path", inside["reuse"]),
            row("HTTPS kept conn, vault path", vault["reuse"]),
            row("DNS direct to the upstream", direct["dns"]),
            row("DNS through Warren's filter", inside["dns"])]
    machine = f"{os.cpu_count()} cpus, {platform.machine()}, Linux {platform.release()}"
    print(f"# {args.n} requests per row, each a new TCP connection + TLS handshake + GET; machine: {machine}")
    print(f"{'kind':<34}{'p50 ms':>9}{'p90 ms':>9}{'p99 ms':>9}")
    for r in rows:
        print(f"{r['kind']:<34}{r['p50']:>9.3f}{r['p90']:>9.3f}{r['p99']:>9.3f}")
    for what, (d, x) in {"policy path, new conn": (0, 1), "vault path, new conn": (0, 2),
                         "policy path, kept conn": (3, 4), "vault path, kept conn": (3, 5),
                         "DNS filter": (6, 7)}.items():
        print(f"added by the {what}: p50 {rows[x]['p50'] - rows[d]['p50']:+.3f} ms, "
              f"p99 {rows[x]['p99'] - rows[d]['p99']:+.3f} ms")
    print(f"DNS queries answered only after a retry: {inside['dns_retries']} through the filter, "
          f"{direct['dns_retries']} direct")
    print(f"server RSS: {rss_before / 1024:.1f} MiB before, {rss_linked / 1024:.1f} MiB with a linked sandbox "
          "(no per-sandbox proxy process: the path is the kernel's)")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
