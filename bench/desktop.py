#!/usr/bin/env python3
"""Desktop benchmark: how soon a desktop sandbox shows its first screenshot, cold and from a warm
pool; one computer-use action's round trip; a 1280x800 screenshot; an idle desktop's memory.

Side by side in one process and one run:
  * bare Xvfb       - `Xvfb` started by hand on the host until `xdpyinfo` answers (what the cold
                      create's X server costs at the least), and `xwd -root` of it (a screenshot
                      with no PNG and no HTTP: the floor of the screenshot row),
  * proxy floor     - `GET /ping` of the sandbox's execd through Warren's proxy: what any action
                      pays before it touches X,
  * plain create    - `POST /sandboxes` without a desktop until execd's `/ping` answers (the
                      sandbox's own share of the cold row),
  * cold            - `POST /sandboxes` with `extensions.desktop` until `GET /desktop/screenshot`
                      answers 200,
  * warm pool       - the same from a pool whose template asks for the desktop (`poolRef`),
  * action          - `POST /desktop/mouse` (a move), and `POST /desktop/keyboard` (one key),
  * screenshot      - `GET /desktop/screenshot` of the whole 1280x800 screen, and scaled by 0.5,
  * memory          - the idle desktop sandbox's memory (execd's `/metrics`: the sandbox's cgroup).

It starts its own `warren serve` (release build, embedded runtime, the `host` image: the host's own
Xvfb, openbox, x11vnc and noVNC; apt packages xvfb openbox x11vnc novnc websockify x11-apps) and
stops it by PID at the end. Usage:
    bench/desktop.py [--cold 5] [--warm 5] [--actions 300] [--shots 60] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lifecycle import REPO, Server, pct  # noqa: E402

SIZE = "1280x800"


def ms(values: list[float]) -> dict:
    return {"p50_ms": round(pct(values, 50) * 1000, 2), "p99_ms": round(pct(values, 99) * 1000, 2),
            "n": len(values)}


def bare_xvfb(n: int) -> tuple[list[float], list[float]]:
    """Starts and stops Xvfb by hand `n` times (time until xdpyinfo answers); xwd of the last."""
    starts, shots = [], []
    display = f":{90 + os.getpid() % 9}"
    for i in range(n):
        t0 = time.perf_counter()
        x = subprocess.Popen(["Xvfb", display, "-screen", "0", f"{SIZE}x24", "-nolisten", "tcp"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            while subprocess.run(["xdpyinfo", "-display", display], stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL).returncode != 0:
                time.sleep(0.005)
            starts.append(time.perf_counter() - t0)
            if i == n - 1:
                for _ in range(30):
                    t0 = time.perf_counter()
                    subprocess.run(["xwd", "-root", "-silent", "-display", display], stdout=subprocess.DEVNULL,
                                   check=True)
                    shots.append(time.perf_counter() - t0)
        finally:
            x.terminate()
            x.wait()
    return starts, shots


class Api:
    def __init__(self, srv: Server):
        self.base = f"http://127.0.0.1:{srv.port}"
        self.c = httpx.Client(base_url=self.base, headers={"OPEN-SANDBOX-API-KEY": srv.key}, timeout=120)

    def body(self, **extra) -> dict:
        return {"image": {"uri": "host"}, "timeout": 900, "entrypoint": ["tail", "-f", "/dev/null"],
                "resourceLimits": {"cpu": "1", "memory": "1Gi"}, **extra}

    def desk(self, sid: str, path: str) -> str:
        return f"/v1/sandboxes/{sid}/proxy/44772/desktop{path}"

    def first_screenshot(self, body: dict, path: str = "/desktop/screenshot") -> tuple[str, float]:
        t0 = time.perf_counter()
        r = self.c.post("/v1/sandboxes", json=body)
        if r.status_code != 202:
            raise SystemExit(f"create: {r.status_code} {r.text}")
        sid = r.json()["id"]
        while (s := self.c.get(f"/v1/sandboxes/{sid}/proxy/44772{path}")).status_code != 200:
            if time.perf_counter() - t0 > 60:
                raise SystemExit(f"no screenshot: {s.status_code} {s.text[:200]}")
            time.sleep(0.005)
        return sid, time.perf_counter() - t0

    def delete(self, sid: str):
        self.c.delete(f"/v1/sandboxes/{sid}")


def busy_seconds() -> float:
    """The machine's CPU time so far (all cores, not idle or iowait), from /proc/stat."""
    f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(f) - f[3] - f[4]) / os.sysconf("SC_CLK_TCK")


CPU: dict[str, float] = {}


def timed(fn, n: int, name: str | None = None) -> list[float]:
    """`n` calls of `fn`, each timed; with `name`, the machine's CPU per call is kept in CPU."""
    out = []
    cpu0 = busy_seconds()
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    if name:
        CPU[name] = round((busy_seconds() - cpu0) / n * 1000, 2)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--binary", default=str(REPO / "target/x86_64-unknown-linux-gnu/release/warren"))
    ap.add_argument("--cold", type=int, default=5)
    ap.add_argument("--warm", type=int, default=5)
    ap.add_argument("--actions", type=int, default=300)
    ap.add_argument("--shots", type=int, default=60)
    ap.add_argument("--json")
    a = ap.parse_args()

    xvfb_starts, xwd = bare_xvfb(a.cold)
    srv = Server(Path(a.binary), "embedded", standby=2)
    api = Api(srv)
    out: dict = {"machine": platform.node(), "bare_xvfb_start": ms(xvfb_starts), "bare_xwd": ms(xwd)}
    try:
        desktop = {"extensions": {"desktop": SIZE}}
        plain = []
        for _ in range(a.cold):
            sid, took = api.first_screenshot(api.body(), "/ping")
            plain.append(took)
            api.delete(sid)
        out["plain_create_first_ping"] = ms(plain)
        cold = []
        for _ in range(a.cold):
            sid, took = api.first_screenshot(api.body(**desktop))
            cold.append(took)
            api.delete(sid)
        out["cold_first_screenshot"] = ms(cold)

        pool = f"bench-{uuid.uuid4().hex[:6]}"
        template = api.body(**desktop, env={"BENCH_POOL": pool})
        r = api.c.post("/v1/pools", json={"name": pool, "template": template, "maxWaitSeconds": 30,
                                          "capacitySpec": {"bufferMin": 1, "bufferMax": 1, "poolMin": 0,
                                                           "poolMax": 3}})
        if r.status_code != 201:
            raise SystemExit(f"pool: {r.status_code} {r.text}")
        warm = []
        for _ in range(a.warm):
            while api.c.get(f"/v1/pools/{pool}").json()["status"]["available"] < 1:
                time.sleep(0.05)
            time.sleep(1)  # the refill's own CPU done
            sid, took = api.first_screenshot({**template, "extensions": {"poolRef": pool}})
            warm.append(took)
            api.delete(sid)
        api.c.delete(f"/v1/pools/{pool}")
        out["warm_pool_first_screenshot"] = ms(warm)

        sid, _ = api.first_screenshot(api.body(**desktop))
        time.sleep(2)
        execd = f"/v1/sandboxes/{sid}/proxy/44772"
        out["proxy_floor_ping"] = ms(timed(lambda: api.c.get(f"{execd}/ping"), a.actions, "proxy_floor_ping"))
        xy = iter(range(10**9))
        out["action_mouse_move"] = ms(timed(lambda: api.c.post(api.desk(sid, "/mouse"), json={
            "action": "move", "x": 100 + next(xy) % 800, "y": 300}), a.actions, "action_mouse_move"))
        out["action_key"] = ms(timed(lambda: api.c.post(api.desk(sid, "/keyboard"), json={
            "action": "key", "keys": ["shift"]}), a.actions, "action_key"))
        out["screenshot_1280x800"] = ms(timed(lambda: api.c.get(api.desk(sid, "/screenshot")), a.shots,
                                              "screenshot_1280x800"))
        out["screenshot_scaled_0.5"] = ms(timed(lambda: api.c.get(api.desk(sid, "/screenshot"),
                                                                  params={"scale": 0.5}), a.shots))
        # A screen with content: an xterm full of text.
        api.c.post(api.desk(sid, "/launch"), json={"command": "xterm -geometry 200x60+0+0 -e 'ls -lR /usr; sleep 600'"})
        time.sleep(3)
        out["screenshot_1280x800_busy"] = ms(timed(lambda: api.c.get(api.desk(sid, "/screenshot")), a.shots))
        time.sleep(2)
        m = api.c.get(f"{execd}/metrics").json()
        out["idle_desktop_memory_mib"] = round(m["mem_used_mib"], 1)
        out["png_bytes_1280x800"] = len(api.c.get(api.desk(sid, "/screenshot")).content)
        api.delete(sid)
        out["machine_cpu_ms_per_call"] = CPU
    finally:
        srv.stop()
    print(json.dumps(out, indent=2))
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
