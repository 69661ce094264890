#!/usr/bin/env python3
"""Soak: many create -> command -> delete cycles at N concurrent against one `warren serve` of our own
(release build, embedded runtime, the `host` image), then what was left behind on the host. With
`--chaos S`, the server is SIGKILLed every S seconds under that load and started again on the same
data dir; afterwards every sandbox whose create was acknowledged must be listed (running, or ended
with a reason) or deleted by its client — none may vanish.

Counted before and after (only what this run's server could have made): mounts under its data dir
and its roots folder, sandbox cgroups, veth links, nftables rules, processes in sandbox cgroups, loop
devices, folders in its `sandboxes/` and `trash/`. The server's RSS and open descriptors are sampled
every `--sample` cycles: a flat curve is the goal.

    bench/soak.py [--cycles 10000] [--concurrency 10] [--chaos 0] [--retention S] [--json OUT]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lifecycle import REPO, Server, raw_once  # noqa: E402


def count_lines(cmd: list[str]) -> int:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return -1
    return len([l for l in out.splitlines() if l.strip()])


def host_state(data: Path) -> dict:
    mountinfo = Path("/proc/self/mountinfo").read_text().splitlines()
    roots = Path("/run/warren/roots")
    key = f"{os.stat(data).st_dev}-{os.stat(data).st_ino}" if data.exists() else "-"
    cgroups = [p for p in Path("/sys/fs/cgroup").glob("*/warren/*") if p.is_dir() and not p.name.startswith(".")]
    in_sandboxes = 0
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                cg = Path(f"/proc/{pid}/cgroup").read_text()
                # (standby setup helpers wait in `.standby-*` cgroups: the server's, not sandboxes')
                if "/warren/" in cg and "/warren/.standby-" not in cg:
                    in_sandboxes += 1
            except OSError:
                pass
    return {
        "mounts": sum(1 for l in mountinfo if str(data) in l or f"{roots}/{key}" in l),
        "cgroups": len(cgroups),
        "veths": count_lines(["ip", "-o", "link", "show", "type", "veth"]),
        "nft_lines": count_lines(["nft", "list", "ruleset"]),
        "processes_in_sandbox_cgroups": in_sandboxes,
        "loop_devices": count_lines(["losetup", "-a"]),
        "sandbox_folders": len(list((data / "sandboxes").iterdir())) if (data / "sandboxes").exists() else 0,
        "trash": len(list((data / "trash").iterdir())) if (data / "trash").exists() else 0,
    }


def server_sample(srv: Server) -> tuple[int, int]:
    try:
        return srv.rss_kib(), len(os.listdir(f"/proc/{srv.proc.pid}/fd"))
    except OSError:
        return 0, 0


async def run(srv: Server, cycles: int, concurrency: int, sample: int, chaos: float) -> dict:
    base = lambda: f"http://127.0.0.1:{srv.port}"  # noqa: E731 (the port is kept across restarts)
    done = failed = 0
    errors: dict[str, int] = {}
    track: dict[str, set] = {"created": set(), "delete_sent": set(), "deleted": set()}
    samples = [(0, *server_sample(srv))]
    restarts = 0
    sem = asyncio.Semaphore(concurrency)

    async def kill_now_and_then() -> None:
        # Under the load: creates, commands and deletes are in flight when the kill lands.
        nonlocal restarts
        while True:
            await asyncio.sleep(chaos)
            srv.proc.send_signal(signal.SIGKILL)
            await asyncio.to_thread(srv.proc.wait)
            await asyncio.to_thread(srv.restart)
            restarts += 1

    async def one(client: httpx.AsyncClient) -> None:
        nonlocal done, failed
        async with sem:
            try:
                await raw_once(client, base(), srv.key, "host", track)
                done += 1
            except Exception as e:  # noqa: BLE001 - counted, by kind
                failed += 1
                kind = type(e).__name__ + (": " + str(e)[:60] if not chaos else "")
                errors[kind] = errors.get(kind, 0) + 1

    killer = asyncio.create_task(kill_now_and_then()) if chaos else None
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=concurrency * 2)) as client:
        started = 0
        while started < cycles:
            batch = min(sample, cycles - started)
            await asyncio.gather(*(one(client) for _ in range(batch)))
            started += batch
            samples.append((started, *server_sample(srv)))
    if killer:
        killer.cancel()
        try:
            await killer
        except asyncio.CancelledError:
            pass
        if srv.proc.poll() is not None:
            srv.restart()
    return {"ok": done, "failed": failed, "errors": errors, "samples": samples,
            "restarts": restarts, "track": track}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cycles", type=int, default=10000)
    ap.add_argument("--concurrency", type=int, default=10)
    ap.add_argument("--sample", type=int, default=500, help="cycles between samples of the server")
    ap.add_argument("--chaos", type=float, default=0, help="SIGKILL and restart the server every S seconds")
    ap.add_argument("--retention", type=int, default=None,
                    help="terminated_retention_seconds of the server (default: its own, an hour)")
    ap.add_argument("--warren", default=str(REPO / "target/x86_64-unknown-linux-gnu/release/warren"))
    ap.add_argument("--json")
    args = ap.parse_args()

    top = f"terminated_retention_seconds = {args.retention}\n" if args.retention is not None else ""
    srv = Server(Path(args.warren), "embedded", 2, top_config=top)
    data = srv.dir / "data"
    before = host_state(data)
    t0 = time.monotonic()
    result = asyncio.run(run(srv, args.cycles, args.concurrency, args.sample, args.chaos))
    elapsed = time.monotonic() - t0
    # Every acknowledged sandbox is either gone because its client deleted it (a deleted sandbox
    # leaves the list at once; a delete whose answer a kill cut off may have been done) or still
    # listed, running or ended with a reason: none vanished.
    created, deleted = result["track"]["created"], result["track"]["deleted"]
    delete_sent = result["track"]["delete_sent"]
    with httpx.Client(base_url=f"http://127.0.0.1:{srv.port}", timeout=60,
                      headers={"OPEN-SANDBOX-API-KEY": srv.key}) as c:
        listed, page = {}, 1
        while True:
            body = c.get("/v1/sandboxes", params={"pageSize": 200, "page": page}).json()
            listed.update({s["id"]: s["status"] for s in body["items"]})
            if len(body["items"]) < 200:
                break
            page += 1
        vanished = sorted(created - delete_sent - set(listed))
        still_listed_after_delete = sorted(deleted & set(listed))
        leftover = [sid for sid in listed if sid in created and sid not in deleted]
        # Creates the server took but whose answer the kill cut off: they are real sandboxes (the
        # client saw a broken connection, as with any request in flight when a server dies) and
        # stay until deleted or expired, so they are deleted here too before the host is checked.
        unanswered = [sid for sid in listed if sid not in created]
        unexplained = [sid for sid in leftover + unanswered
                       if listed[sid]["state"] not in ("Running", "Terminated")
                       and not listed[sid].get("reason")]
        for sid in leftover + unanswered:
            if listed[sid]["state"] != "Terminated":
                c.delete(f"/v1/sandboxes/{sid}")
    time.sleep(2)
    after_live = host_state(data)
    srv.stop(keep=True)
    after = host_state(data)
    leaks = {k: after[k] - before[k] for k in before if after[k] != before[k]}
    rss = [s[1] for s in result["samples"] if s[1]]
    fds = [s[2] for s in result["samples"] if s[2]]
    print(f"# {args.cycles} cycles at {args.concurrency} concurrent in {elapsed:.0f} s "
          f"({args.cycles / elapsed:.1f}/s); ok {result['ok']}, failed {result['failed']}"
          + (f"; server SIGKILLed and restarted {result['restarts']} times" if args.chaos else ""))
    if result["errors"]:
        print("# failures by kind:", json.dumps(result["errors"]))
    print(f"# acknowledged {len(created)}, deleted by their clients {len(deleted)}, listed at the end "
          f"{len(leftover)} + {len(unanswered)} whose create was never answered (deleted now; "
          f"without a reason: {len(unexplained)}), vanished {len(vanished)}, "
          f"still listed after an answered delete {len(still_listed_after_delete)}")
    print(f"# server RSS KiB first/last/max: {rss[0]}/{rss[-1]}/{max(rss)}; open fds first/last/max: "
          f"{fds[0]}/{fds[-1]}/{max(fds)}")
    print("# host state before:", json.dumps(before))
    print("# after the run (server up): ", json.dumps(after_live))
    print("# after the server stopped:  ", json.dumps(after))
    print("# leaked:", json.dumps(leaks) if leaks else "nothing")
    if args.json:
        out = dict(result, track=None, acknowledged=len(created), deleted=len(deleted),
                   listed_at_end=len(leftover), unanswered=len(unanswered),
                   unexplained=unexplained, vanished=vanished,
                   still_listed_after_delete=still_listed_after_delete, before=before, after=after,
                   leaks=leaks, elapsed=elapsed)
        Path(args.json).write_text(json.dumps(out, indent=1))
    srv.cleanup()


if __name__ == "__main__":
    main()
