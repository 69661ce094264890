"""Egress benchmark (issue 5): what the policy path adds to a sandbox's HTTPS requests.

One run builds the fake internet of the egress tests (tests/e2e/fakenet.py: a network namespace of
its own with HTTPS servers, a DNS server on loopback), starts its own `warren serve` whose DNS filter
forwards there, and runs the same Python client twice:

- direct: in the host's namespace, straight to the fake server;
- policy path: in a sandbox whose policy allows `allowed.test` (veth, nftables checks per packet,
  NAT), the name resolved once through Warren's DNS filter;

each doing --n requests, every one a new TCP connection + TLS handshake + GET, timed inside the
client. It also times DNS lookups through the filter against asking the upstream directly.
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
n, ca, mode = int(sys.argv[1]), sys.argv[2], sys.argv[3]
ctx = ssl.create_default_context(cafile=ca)
ip = socket.gethostbyname("allowed.test") if mode == "sandbox" else "198.18.0.2"
req = b"GET / HTTP/1.1\r\nHost: allowed.test\r\nConnection: close\r\n\r\n"
times, dns = [], []
for _ in range(n):
    t0 = time.perf_counter()
    with socket.create_connection((ip, 443), timeout=5) as raw:
        with ctx.wrap_socket(raw, server_hostname="allowed.test") as s:
            s.sendall(req)
            while s.recv(65536):
                pass
    times.append((time.perf_counter() - t0) * 1000)
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
print(json.dumps({"https": times, "dns": dns, "dns_retries": retries}))
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
    with FakeNet(work / "fakenet") as net:
        server = Server(Path(args.warren), "embedded", 2, extra_config=(
            f'[network]\nsubnet = "10.232.0.0/24"\ndns_upstream = "127.0.0.1:{net.dns_port}"\n'))
        try:
            from opensandbox import SandboxSync
            from opensandbox.config import ConnectionConfigSync
            from opensandbox.models.sandboxes import NetworkPolicy
            cfg = ConnectionConfigSync(domain=f"127.0.0.1:{server.port}", api_key=server.key)
            rss_before = server.rss_kib()
            sbx = SandboxSync.create("host", connection_config=cfg, network_policy=NetworkPolicy.model_validate(
                {"defaultAction": "deny", "egress": [{"action": "allow", "target": "allowed.test"}]}))
            try:
                sbx.files.write_file("/tmp/ca.pem", net.ca.read_text())
                sbx.files.write_file("/tmp/client.py", CLIENT)
                # Inside, port 53 anywhere is Warren's filter; outside, the upstream itself.
                ex = sbx.commands.run(f"python3 /tmp/client.py {args.n} /tmp/ca.pem sandbox 198.18.0.2 53")
                out = "".join(m.text for m in ex.logs.stdout)
                if ex.exit_code != 0:
                    raise SystemExit(f"sandbox client failed: {''.join(m.text for m in ex.logs.stderr)}")
                inside = json.loads(out)
                rss_linked = server.rss_kib()
            finally:
                sbx.kill()
            script = work / "client.py"
            script.write_text(CLIENT)
            direct = json.loads(subprocess.run(
                [sys.executable, str(script), str(args.n), str(net.ca), "host", "127.0.0.1", str(net.dns_port)],
                check=True, capture_output=True, text=True).stdout)
        finally:
            server.stop()
    rows = [row("HTTPS direct (host namespace)", direct["https"]),
            row("HTTPS through the policy path", inside["https"]),
            row("DNS direct to the upstream", direct["dns"]),
            row("DNS through Warren's filter", inside["dns"])]
    machine = f"{os.cpu_count()} cpus, {platform.machine()}, Linux {platform.release()}"
    print(f"# {args.n} requests per row, each a new TCP connection + TLS handshake + GET; machine: {machine}")
    print(f"{'kind':<34}{'p50 ms':>9}{'p90 ms':>9}{'p99 ms':>9}")
    for r in rows:
        print(f"{r['kind']:<34}{r['p50']:>9.3f}{r['p90']:>9.3f}{r['p99']:>9.3f}")
    print(f"added by the policy path: p50 {rows[1]['p50'] - rows[0]['p50']:+.3f} ms, "
          f"p99 {rows[1]['p99'] - rows[0]['p99']:+.3f} ms; DNS filter: p50 {rows[3]['p50'] - rows[2]['p50']:+.3f} ms")
    print(f"DNS queries answered only after a retry: {inside['dns_retries']} through the filter, "
          f"{direct['dns_retries']} direct")
    print(f"server RSS: {rss_before / 1024:.1f} MiB before, {rss_linked / 1024:.1f} MiB with a linked sandbox "
          "(no per-sandbox proxy process: the path is the kernel's)")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
