#!/usr/bin/env python3
"""Speed at scale: warm pools, forks from a snapshot, sustained creates, idle sandboxes.

One `warren serve` of its own (release build, embedded runtime), raw REST API through httpx, and,
side by side in the same run, `docker run --rm` when a Docker engine answers (DOCKER_HOST honoured).
Rows:
  * the floor: `sh -c 'echo hi'` as a plain subprocess, serial;
  * create → first output → delete without a pool, serial and at 10/50/100 concurrent;
  * the same from a warm pool (bufferMax = poolMax = P): serial claims (from the compiled client
    back to back and 300 ms apart too), and bursts of 1×, 2×, 4× P concurrent creates against it
    (queued up to maxWaitSeconds; success ratio);
  * creates/s sustained for --sustain seconds (create → first output → delete, 10 in flight), from
    Python and from the compiled warren-load client;
  * fork: N sandboxes from one snapshot (--fork, 10 in flight), total wall time and per-create p50;
  * idle sandboxes: memory per idle sandbox (MemTotal − MemAvailable before/after, server RSS), and
    --idle of them held at once (all running `tail -f /dev/null`, each answering a command);
  * wake on access (`lifecycle.idlePolicy`): a command's first output from a running sandbox, from a
    paused one after an explicit resume, and from a paused one that the request itself wakes.
The reference OpenSandbox server on Docker cannot be run here (its images come from registries this
machine does not reach); its published figures are quoted in bench/README.md instead.
Usage: bench/scale.py [--pool 25] [--sustain 60] [--fork 50] [--idle 500] [--image host|test] [--json OUT]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

from lifecycle import Server, docker_available, docker_once, fork_once, measure, rust_client_run  # noqa: E402


def mem_used_kib() -> int:
    info = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        k, v = line.split(":", 1)
        info[k] = int(v.split()[0])
    return info["MemTotal"] - info["MemAvailable"]


def body(image: str, **extra) -> dict:
    b = {"image": {"uri": image}, "timeout": 3600, "resourceLimits": {"cpu": "1", "memory": "2Gi"},
         "entrypoint": ["tail", "-f", "/dev/null"]}
    b.update(extra)
    return b


async def first_output(client: httpx.AsyncClient, base: str, h: dict, sid: str) -> None:
    ep = (await client.get(f"{base}/v1/sandboxes/{sid}/endpoints/44772", headers=h)).json()
    async with client.stream("POST", f"http://{ep['endpoint']}/command", headers=ep.get("headers", {}),
                             json={"command": "echo hi"}) as resp:
        async for line in resp.aiter_lines():
            if line.strip() and json.loads(line.removeprefix("data:"))["type"] == "stdout":
                return
    raise RuntimeError("no output")


async def cycle(client, base, h, create_body) -> float:
    """create → first output (timed) → delete (not timed)."""
    t0 = time.perf_counter()
    r = await client.post(f"{base}/v1/sandboxes", headers=h, json=create_body)
    if r.status_code != 202:
        raise RuntimeError(f"create: {r.status_code} {r.text[:200]}")
    sid = r.json()["id"]
    try:
        await first_output(client, base, h, sid)
        return time.perf_counter() - t0
    finally:
        d = await client.delete(f"{base}/v1/sandboxes/{sid}", headers=h)
        if d.status_code != 204:
            raise RuntimeError(f"delete: {d.status_code} {d.text[:200]}")


async def wake_rows(client: httpx.AsyncClient, base: str, h: dict, image: str, n: int) -> dict:
    """One sandbox with a wake-only idle policy: `n` times each, a command's first output while it
    runs; paused, then resumed by the API, then the command (both timed together); paused, then the
    command alone, which wakes it."""
    r = await client.post(f"{base}/v1/sandboxes", headers=h,
                          json=body(image, lifecycle={"idlePolicy": {"wakeOnAccess": True}}))
    assert r.status_code == 202, r.text
    sid = r.json()["id"]

    async def command() -> float:
        t0 = time.perf_counter()
        await first_output(client, base, h, sid)
        return time.perf_counter() - t0

    async def pause() -> None:
        r = await client.post(f"{base}/v1/sandboxes/{sid}/pause", headers=h)
        assert r.status_code in (200, 202, 204), r.text
        while (await client.get(f"{base}/v1/sandboxes/{sid}", headers=h)).json()["status"]["state"] != "Paused":
            await asyncio.sleep(0.01)

    async def resumed() -> float:
        await pause()
        t0 = time.perf_counter()
        r = await client.post(f"{base}/v1/sandboxes/{sid}/resume", headers=h)
        assert r.status_code in (200, 202, 204), r.text
        await first_output(client, base, h, sid)
        return time.perf_counter() - t0

    async def woken() -> float:
        await pause()
        return await command()

    try:
        await command()
        return {
            "command, running c=1": await measure(command, n, 1),
            "resume + command, paused c=1": await measure(resumed, n, 1),
            "wake on access (command alone), paused c=1": await measure(woken, n, 1),
        }
    finally:
        await client.delete(f"{base}/v1/sandboxes/{sid}", headers=h)


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pool", type=int, default=25)
    ap.add_argument("--n", type=int, default=100)
    ap.add_argument("--sustain", type=float, default=60)
    ap.add_argument("--fork", type=int, default=50)
    ap.add_argument("--idle", type=int, default=500)
    ap.add_argument("--image", default="host")
    ap.add_argument("--warren", default=str(REPO / "target/x86_64-unknown-linux-gnu/release/warren"))
    ap.add_argument("--only", choices=["idle", "wake"], help="run only the idle sandboxes' or the wake rows")
    ap.add_argument("--wake", type=int, default=50, help="pause/wake rounds of the wake rows")
    ap.add_argument("--no-disk", action="store_true",
                    help="sandboxes without a disk of their own ([limits] default_ephemeral_storage = \"none\")")
    ap.add_argument("--json")
    args = ap.parse_args()
    server = Server(Path(args.warren), "embedded", 2,
                    extra_config='[network]\ndns_upstream = "127.0.0.1:9"\n[images]\npull = "never"\n'
                    + ('[limits]\ndefault_ephemeral_storage = "none"\n' if args.no_disk else ""))
    image = args.image
    if image == "test":
        image = "warren-test:bookworm"
        rootfs = os.environ.get("WARREN_TEST_ROOTFS", "/var/cache/warren/test-rootfs")
        subprocess.run([args.warren, "image", "import", image, rootfs, "--data-dir", str(server.dir / "data")],
                       check=True, capture_output=True)
    base = f"http://127.0.0.1:{server.port}"
    h = {"OPEN-SANDBOX-API-KEY": server.key}
    results: dict[str, dict] = {}
    notes: dict[str, object] = {}
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    try:
        async with httpx.AsyncClient(timeout=300, limits=limits) as client:
            plain = body(image)
            if args.only == "wake":
                results["fork+exec c=1 (sh -c, no sandbox)"] = await measure(fork_once, args.wake, 1)
                results.update(await wake_rows(client, base, h, image, args.wake))
            if args.only is None:
                # The floor, in the same run: this machine's speed at starting a process moves every row
                # (it has differed by 2x from one day to the next), so read the rows against it.
                results["fork+exec c=1 (sh -c, no sandbox)"] = await measure(fork_once, args.n, 1)
                for _ in range(3):
                    await cycle(client, base, h, plain)
                print("no pool …", flush=True)
                for conc in (1, 10, 50, 100):
                    results[f"no pool c={conc}"] = await measure(lambda: cycle(client, base, h, plain), args.n, conc)
                if docker_available():
                    print("docker run …", flush=True)
                    for conc in (1, 10):
                        results[f"docker run --rm c={conc}"] = await measure(lambda: docker_once("warren-test:bookworm"),
                                                                             min(args.n, 50), conc)

                # --- warm pool ---
                p = args.pool
                pool_body = body(image, env={"BENCH_POOL": "1"})
                spec = {"name": "bench", "template": pool_body, "maxWaitSeconds": 120,
                        "capacitySpec": {"bufferMin": p, "bufferMax": p, "poolMin": 0, "poolMax": p}}
                r = await client.post(f"{base}/v1/pools", headers=h, json=spec)
                assert r.status_code == 201, r.text

                async def warm():
                    while (await client.get(f"{base}/v1/pools/bench", headers=h)).json()["status"]["available"] < p:
                        await asyncio.sleep(0.05)
                print("pool …", flush=True)
                await warm()
                serial = []
                for _ in range(min(args.n, p)):
                    serial.append(await cycle(client, base, h, pool_body))
                    await warm()
                ms = sorted(x * 1000 for x in serial)
                results["pool claim c=1"] = {"n": len(ms), "concurrency": 1, "ok": len(ms), "failed": 0,
                                             "p50_ms": ms[len(ms) // 2], "p90_ms": ms[int(len(ms) * 0.9)],
                                             "p99_ms": ms[-1], "errors": []}
                # The same claims from a compiled client (warren-load, on warren-sdk): its create body is
                # exactly a template without env, so a pool of that template serves it automatically.
                load = Path(args.warren).with_name("warren-load")
                if load.exists():
                    rust_spec = {**spec, "name": "bench-rust", "template": plain}
                    r = await client.post(f"{base}/v1/pools", headers=h, json=rust_spec)
                    assert r.status_code == 201, r.text
                    while (await client.get(f"{base}/v1/pools/bench-rust", headers=h)).json()["status"]["available"] < p:
                        await asyncio.sleep(0.05)
                    results["pool claim c=1, Rust SDK client"] = rust_client_run(load, server.port, server.key, image,
                                                                                p, 1)
                    # The same claims 300 ms apart: each from a full, quiet pool, with the previous
                    # cycle's refill done (back to back, each claim shares the CPUs with the refill
                    # its predecessor's delete started).
                    while (await client.get(f"{base}/v1/pools/bench-rust", headers=h)).json()["status"]["available"] < p:
                        await asyncio.sleep(0.05)
                    results["pool claim c=1, Rust SDK client, 300 ms apart"] = rust_client_run(
                        load, server.port, server.key, image, p, 1, pause_ms=300)
                    await client.delete(f"{base}/v1/pools/bench-rust", headers=h)
                    results["no pool c=1, Rust SDK client"] = rust_client_run(load, server.port, server.key, image,
                                                                             p, 1)
                else:
                    print(f"# {load} not built (cargo build --release -p warren-bench): Rust SDK rows omitted")
                for mult in (1, 2, 4):
                    await warm()
                    n = mult * p
                    results[f"pool burst {mult}x ({n}) c={n}"] = await measure(
                        lambda: cycle(client, base, h, pool_body), n, n)
                await client.delete(f"{base}/v1/pools/bench", headers=h)

                # --- sustained creates ---
                print(f"sustained for {args.sustain:.0f} s …", flush=True)
                done = 0
                errors = 0
                stop = time.perf_counter() + args.sustain

                async def worker():
                    nonlocal done, errors
                    while time.perf_counter() < stop:
                        try:
                            await cycle(client, base, h, plain)
                            done += 1
                        except Exception:  # noqa: BLE001 - counted
                            errors += 1
                t0 = time.perf_counter()
                await asyncio.gather(*(worker() for _ in range(10)))
                wall = time.perf_counter() - t0
                notes["sustained"] = {"seconds": wall, "cycles": done, "errors": errors, "per_second": done / wall}
                # The same for the compiled client: on 2 cores the Python client above takes about a third
                # of the machine's CPU, so its rate says as much about httpx as about the server.
                load = Path(args.warren).with_name("warren-load")
                if load.exists():
                    print(f"sustained for {args.sustain:.0f} s, compiled client …", flush=True)
                    out = subprocess.run([str(load), "--domain", f"127.0.0.1:{server.port}", "--api-key", server.key,
                                          "--image", image, "--seconds", str(args.sustain), "--concurrency", "10"],
                                         check=True, capture_output=True, text=True, timeout=args.sustain + 300)
                    r = json.loads(out.stdout)
                    ms = sorted(r["times_ms"])
                    notes["sustained_rust_client"] = {
                        "seconds": r["wall_s"], "cycles": len(ms), "errors": len(r["errors"]),
                        "per_second": len(ms) / r["wall_s"],
                        "create_to_first_output_p50_ms": ms[len(ms) // 2] if ms else None,
                        "create_to_first_output_p99_ms": ms[int(len(ms) * 0.99)] if ms else None}

                # --- fork from a snapshot ---
                if image != "host":
                    print("fork …", flush=True)
                    r = await client.post(f"{base}/v1/sandboxes", headers=h, json=plain)
                    src = r.json()["id"]
                    ep = (await client.get(f"{base}/v1/sandboxes/{src}/endpoints/44772", headers=h)).json()
                    await client.post(f"http://{ep['endpoint']}/command", headers=ep.get("headers", {}),
                                      json={"command": "seq 1 100000 > /root/state && pip --version >/dev/null 2>&1; true"})
                    t0 = time.perf_counter()
                    snap = (await client.post(f"{base}/v1/sandboxes/{src}/snapshots", headers=h, json={})).json()
                    while (await client.get(f"{base}/v1/snapshots/{snap['id']}", headers=h)).json()["status"]["state"] != "Ready":
                        await asyncio.sleep(0.01)
                    notes["snapshot_ms"] = (time.perf_counter() - t0) * 1000
                    fork_body = {k: v for k, v in plain.items() if k != "image"} | {"snapshotId": snap["id"]}
                    t0 = time.perf_counter()
                    results[f"fork of {args.fork} c=10"] = await measure(
                        lambda: cycle(client, base, h, fork_body), args.fork, 10)
                    notes["fork_wall_ms"] = (time.perf_counter() - t0) * 1000
                    await client.delete(f"{base}/v1/sandboxes/{src}", headers=h)
                    await client.delete(f"{base}/v1/snapshots/{snap['id']}", headers=h)

            if args.only != "wake":
                # --- idle sandboxes ---
                print(f"{args.idle} idle sandboxes …", flush=True)
                await asyncio.sleep(2)
                mem0, rss0 = mem_used_kib(), server.rss_kib()
                ids: list[str] = []
                sem = asyncio.Semaphore(10)

                async def make():
                    async with sem:
                        r = await client.post(f"{base}/v1/sandboxes", headers=h, json=plain)
                        if r.status_code == 202:
                            ids.append(r.json()["id"])
                t0 = time.perf_counter()
                await asyncio.gather(*(make() for _ in range(args.idle)))
                made_s = time.perf_counter() - t0
                await asyncio.sleep(3)
                mem1, rss1 = mem_used_kib(), server.rss_kib()
                alive = 0
                for sid in ids[:: max(1, len(ids) // 50)]:
                    try:
                        await first_output(client, base, h, sid)
                        alive += 1
                    except Exception:  # noqa: BLE001 - counted
                        pass
                notes["idle"] = {"requested": args.idle, "created": len(ids), "create_seconds": made_s,
                                 "sampled_answering": alive, "sampled": len(ids[:: max(1, len(ids) // 50)]),
                                 "mem_per_sandbox_kib": (mem1 - mem0) / max(1, len(ids)),
                                 "server_rss_per_sandbox_kib": (rss1 - rss0) / max(1, len(ids))}
                dsem = asyncio.Semaphore(20)

                async def drop(sid):
                    async with dsem:
                        d = await client.delete(f"{base}/v1/sandboxes/{sid}", headers=h)
                        if d.status_code != 204:
                            notes.setdefault("delete_errors", []).append(f"{d.status_code} {d.text[:200]}")
                await asyncio.gather(*(drop(s) for s in ids))
        # Everything made was deleted, warm sandboxes (unlisted) included: the server keeps none.
        left = sorted(p.name for p in (server.dir / "data" / "sandboxes").iterdir())
        notes["sandboxes_left_behind"] = left
        if left:
            print(f"# WARNING: {len(left)} sandboxes left behind: {left[:5]}", flush=True)
    finally:
        server.stop()

    machine = f"{os.cpu_count()} cpus, {platform.machine()}, Linux {platform.release()}"
    print(f"\n# create → first output of 'echo hi' (raw REST API); image {image!r}; machine: {machine}")
    print("| kind | ok/n | p50 ms | p90 ms | p99 ms |")
    print("|---|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['ok']}/{r['n']} | {r['p50_ms']:.1f} | {r['p90_ms']:.1f} | {r['p99_ms']:.1f} |")
        for e in r.get("errors", []):
            print(f"|   error: {e} |")
    print(json.dumps(notes, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine, "results": results, "notes": notes}, indent=2))


if __name__ == "__main__":
    asyncio.run(main())
