#!/usr/bin/env python3
"""Warren on Kubernetes at scale, in simulation: N sandboxes as Pods of the test cluster
(tests/e2e/fakekube.py) with its kubelet simulated — every Pod is Running at once at one address,
where a single listener stands in for every execd — so what is measured is Warren's side: the API
requests a create and a delete cost (counted by the fake API server), the watch events Warren
receives, Warren's CPU per create and memory per sandbox, and creates/s.

Baseline, same run: the same N Pods created straight against the fake API server by this process
at the same concurrency (no Warren), which is the fake's own ceiling.

Then, with --replicas R (2 by default; 0 skips it): R servers sharing one key serve one set of N
sandboxes (creates spread over them, each renewed once and deleted through another replica than
its maker), measuring what sharing the records costs: API requests per create, renew and delete,
how long until every replica knows every sandbox, and each replica's CPU per sandbox it made and
per sandbox another made (the follower's share).
Usage: bench/kubernetes.py [--n 1000] [--concurrency 32] [--replicas 2] [--json OUT]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO / "tests" / "e2e"))

from fakekube import FakeKube  # noqa: E402
from lifecycle import Server  # noqa: E402

EXECD_STAND_IN = "127.0.0.3"


def listen_forever(ip: str) -> socket.socket:
    """Accepts and closes connections at ip:44772: Warren's readiness check for every Pod."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((ip, 44772))
    s.listen(1024)

    def loop():
        while True:
            try:
                c, _ = s.accept()
                c.close()
            except OSError:
                return

    threading.Thread(target=loop, daemon=True).start()
    return s


def cpu_ms(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * 1000 / os.sysconf("SC_CLK_TCK")


async def run_all(n: int, concurrency: int, one) -> float:
    sem = asyncio.Semaphore(concurrency)

    async def guarded(i):
        async with sem:
            await one(i)

    t0 = time.perf_counter()
    await asyncio.gather(*(guarded(i) for i in range(n)))
    return time.perf_counter() - t0


def per(n: int, before: dict, after: dict) -> dict:
    return {k: (after.get(k, 0) - before.get(k, 0)) / n for k in after if after.get(k, 0) != before.get(k, 0)}


def replicas(fake, args) -> dict:
    """R servers of one service over the fake cluster: see the module's documentation."""
    key = Path(os.environ.get("TMPDIR", "/tmp")) / f"warren-bench-key-{os.getpid()}"
    key.write_bytes(os.urandom(32).hex().encode())
    servers = [Server(Path(args.binary), "embedded", 0, kind="kubernetes",
                      top_config='[limits]\nmax_sandboxes = 100000\n',
                      extra_config=f'[kubernetes]\napi_server = "{fake.url}"\nnamespace = "shared"\n'
                                   f'instance = "svc"\nshared_key_file = "{key}"\n')
               for _ in range(args.replicas)]
    r = len(servers)
    out: dict = {"replicas": r}
    ids: list[tuple[int, str]] = []
    cpu0 = [cpu_ms(s.proc.pid) for s in servers]
    before = dict(fake.requests)
    events_before = len(fake.events)

    async def creates():
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=args.concurrency)) as c:
            async def one(i):
                s = servers[i % r]
                resp = await c.post(f"http://127.0.0.1:{s.port}/v1/sandboxes",
                                    headers={"OPEN-SANDBOX-API-KEY": s.key}, json={
                                        "image": {"uri": "registry.invalid/agent:1"}, "timeout": 3600,
                                        "resourceLimits": {"cpu": "500m", "memory": "512Mi"}})
                assert resp.status_code == 202, resp.text
                ids.append((i % r, resp.json()["id"]))
            return await run_all(args.n, args.concurrency, one)

    t = asyncio.run(creates())
    out["creates_per_s"] = args.n / t
    # Until every replica lists every sandbox.
    t0 = time.perf_counter()
    for s in servers:
        while True:
            listed = httpx.get(f"http://127.0.0.1:{s.port}/v1/sandboxes", params={"pageSize": 1},
                               headers={"OPEN-SANDBOX-API-KEY": s.key}, timeout=60).json()
            if listed["pagination"]["totalItems"] >= args.n:
                break
            time.sleep(0.01)
    out["all_replicas_know_all_ms_after_last_create"] = (time.perf_counter() - t0) * 1000
    cpu1 = [cpu_ms(s.proc.pid) for s in servers]
    out["api_requests_per_create"] = per(args.n, before, dict(fake.requests))
    out["watch_events_per_create"] = (len(fake.events) - events_before) / args.n
    out["watch_events_delivered_per_create"] = out["watch_events_per_create"] * r
    # Each replica made n/r and followed the others' n - n/r; CPU over both, per sandbox it serves.
    out["cpu_ms_per_sandbox_per_replica"] = [(cpu1[i] - cpu0[i]) / args.n for i in range(r)]

    before = dict(fake.requests)
    at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + 7200))

    async def renews():
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=args.concurrency)) as c:
            async def one(i):
                s = servers[(ids[i][0] + 1) % r]
                resp = await c.post(f"http://127.0.0.1:{s.port}/v1/sandboxes/{ids[i][1]}/renew-expiration",
                                    headers={"OPEN-SANDBOX-API-KEY": s.key}, json={"expiresAt": at})
                assert resp.status_code == 200, resp.text
            return await run_all(len(ids), args.concurrency, one)

    t = asyncio.run(renews())
    out["renews_per_s"] = len(ids) / t
    out["api_requests_per_renew"] = per(len(ids), before, dict(fake.requests))

    before = dict(fake.requests)
    cpu0 = [cpu_ms(s.proc.pid) for s in servers]

    async def deletes():
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=args.concurrency)) as c:
            async def one(i):
                s = servers[(ids[i][0] + 1) % r]
                resp = await c.delete(f"http://127.0.0.1:{s.port}/v1/sandboxes/{ids[i][1]}",
                                      headers={"OPEN-SANDBOX-API-KEY": s.key})
                assert resp.status_code == 204, resp.text
            return await run_all(len(ids), args.concurrency, one)

    t = asyncio.run(deletes())
    out["deletes_per_s"] = len(ids) / t
    out["api_requests_per_delete"] = per(len(ids), before, dict(fake.requests))
    out["cpu_ms_per_delete_per_replica"] = [(cpu_ms(s.proc.pid) - cpu0[i]) / len(ids)
                                            for i, s in enumerate(servers)]
    for s in servers:
        s.stop()
    key.unlink()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--binary", default=str(REPO / "target/x86_64-unknown-linux-gnu/release/warren"))
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--json")
    args = ap.parse_args()
    listener = listen_forever(EXECD_STAND_IN)
    fake = FakeKube(None, simulate_ip=EXECD_STAND_IN, validate=False)
    results: dict = {"n": args.n, "concurrency": args.concurrency}

    # Baseline: Pods straight to the fake API server.
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"labels": {"io.warren.owner": "baseline"}},
           "spec": {"containers": [{"name": "sandbox", "image": "x"}]}}

    async def baseline():
        async with httpx.AsyncClient(base_url=fake.url, timeout=60) as c:
            async def one(i):
                body = json.loads(json.dumps(pod))
                body["metadata"]["name"] = f"baseline-{i}"
                r = await c.post("/api/v1/namespaces/baseline/pods", json=body)
                assert r.status_code == 201, r.text
            return await run_all(args.n, args.concurrency, one)

    t = asyncio.run(baseline())
    results["baseline_creates_per_s"] = args.n / t

    srv = Server(Path(args.binary), "embedded", 0, kind="kubernetes",
                 top_config='[limits]\nmax_sandboxes = 100000\n',
                 extra_config=f'[kubernetes]\napi_server = "{fake.url}"\nnamespace = "sim"\ninstance = "sim-0"\n')
    base = f"http://127.0.0.1:{srv.port}"
    h = {"OPEN-SANDBOX-API-KEY": srv.key}
    ids: list[str] = []
    before = dict(fake.requests)
    events_before = len(fake.events)
    cpu0 = cpu_ms(srv.proc.pid)
    rss0 = srv.rss_kib()

    async def creates():
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=args.concurrency)) as c:
            async def one(i):
                r = await c.post(f"{base}/v1/sandboxes", headers=h, json={
                    "image": {"uri": "registry.invalid/agent:1"}, "timeout": 3600,
                    "resourceLimits": {"cpu": "500m", "memory": "512Mi"}})
                assert r.status_code == 202, r.text
                ids.append(r.json()["id"])
            return await run_all(args.n, args.concurrency, one)

    t = asyncio.run(creates())
    cpu1 = cpu_ms(srv.proc.pid)
    results["creates_per_s"] = args.n / t
    results["server_cpu_ms_per_create"] = (cpu1 - cpu0) / args.n
    results["server_rss_kib_per_sandbox"] = (srv.rss_kib() - rss0) / args.n
    after = dict(fake.requests)
    results["api_requests_per_create"] = {k: (after.get(k, 0) - before.get(k, 0)) / args.n
                                          for k in after if after.get(k, 0) != before.get(k, 0)}
    results["watch_events_per_create"] = (len(fake.events) - events_before) / args.n

    before = dict(fake.requests)
    cpu0 = cpu_ms(srv.proc.pid)

    async def deletes():
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=args.concurrency)) as c:
            async def one(i):
                r = await c.delete(f"{base}/v1/sandboxes/{ids[i]}", headers=h)
                assert r.status_code == 204, r.text
            return await run_all(len(ids), args.concurrency, one)

    t = asyncio.run(deletes())
    results["deletes_per_s"] = len(ids) / t
    results["server_cpu_ms_per_delete"] = (cpu_ms(srv.proc.pid) - cpu0) / len(ids)
    after = dict(fake.requests)
    results["api_requests_per_delete"] = {k: (after.get(k, 0) - before.get(k, 0)) / len(ids)
                                          for k in after if after.get(k, 0) != before.get(k, 0)}
    srv.stop()
    if args.replicas > 1:
        results["replicas"] = replicas(fake, args)
    fake.close()
    listener.close()
    print(json.dumps(results, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
