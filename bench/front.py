#!/usr/bin/env python3
"""What slow clients cost everyone else: `/health` and a create -> first output -> delete cycle, served
with no other connections open and then beside N slowloris connections (each sent half a request's
headers and then nothing), in one run against one `warren serve` of our own (release build, the
`host` image, stopped by PID at the end). The slow connections are reopened as the server closes them
(`[http] header_timeout_seconds`, 20 by default), so N stay open throughout.

    bench/front.py [--slow 1000] [--n 200] [--cycles 30] [--json OUT]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import resource
import socket
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lifecycle import REPO, Server, pct, raw_once  # noqa: E402


class Slowloris:
    """`count` connections that each sent half a request's headers; reopened when closed."""

    def __init__(self, port: int, count: int):
        self.port, self.count = port, count
        self.socks: list[socket.socket] = []
        self.reopened = 0
        self.stop = threading.Event()
        for _ in range(count):
            self.socks.append(self.open())
        self.thread = threading.Thread(target=self.keep, daemon=True)
        self.thread.start()

    def open(self) -> socket.socket:
        s = socket.create_connection(("127.0.0.1", self.port), timeout=10)
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        s.setblocking(False)
        return s

    def keep(self) -> None:
        while not self.stop.wait(0.5):
            for i, s in enumerate(self.socks):
                try:
                    if s.recv(4096) == b"":
                        raise ConnectionResetError
                except BlockingIOError:
                    continue
                except OSError:
                    pass
                s.close()
                self.socks[i] = self.open()
                self.reopened += 1

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        for s in self.socks:
            s.close()


def health(base: str, n: int) -> list[float]:
    out = []
    with httpx.Client(base_url=base, timeout=30) as c:
        for _ in range(n):
            t0 = time.perf_counter()
            assert c.get("/health").status_code == 200
            out.append((time.perf_counter() - t0) * 1000)
    return out


async def cycles(base: str, key: str, n: int) -> list[float]:
    async with httpx.AsyncClient(timeout=60) as client:
        return [await raw_once(client, base, key, "host") * 1000 for _ in range(n)]


def row(name: str, ms: list[float]) -> dict:
    return {"kind": name, "n": len(ms), "p50": pct(ms, 50), "p90": pct(ms, 90), "p99": pct(ms, 99)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--slow", type=int, default=1000)
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--cycles", type=int, default=30)
    ap.add_argument("--warren", default=str(REPO / "target/x86_64-unknown-linux-gnu/release/warren"))
    ap.add_argument("--json")
    args = ap.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, args.slow + 1024)), hard))

    srv = Server(Path(args.warren), "embedded", 2)
    base = f"http://127.0.0.1:{srv.port}"
    rows = []
    try:
        health(base, 20)
        asyncio.run(cycles(base, srv.key, 3))
        rows.append(row("health, alone", health(base, args.n)))
        rows.append(row("create->output->delete, alone", asyncio.run(cycles(base, srv.key, args.cycles))))
        slow = Slowloris(srv.port, args.slow)
        try:
            rows.append(row(f"health, {args.slow} slow open", health(base, args.n)))
            rows.append(row(f"create->output->delete, {args.slow} slow open",
                            asyncio.run(cycles(base, srv.key, args.cycles))))
        finally:
            reopened = slow.reopened
            slow.close()
        rss = srv.rss_kib()
    finally:
        srv.stop()
    print(f"# {args.slow} slowloris connections (reopened {reopened} times as the server closed them); "
          f"server RSS after: {rss / 1024:.1f} MiB")
    print(f"{'kind':48} {'n':>4} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8}")
    for r in rows:
        print(f"{r['kind']:48} {r['n']:>4} {r['p50']:>8.2f} {r['p90']:>8.2f} {r['p99']:>8.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "reopened": reopened, "rss_kib": rss}, indent=1))


if __name__ == "__main__":
    main()
