#!/usr/bin/env python3
"""What the flight recorder costs: a command's round trip through the endpoint proxy (POST /command,
read to the end of its event stream), an output-heavy command (50,000 lines), and an 8 MiB upload, on two
`warren serve` of our own (release build, the `host` image, embedded runtime) that differ only in
`[timeline] enabled`, plus a third with the recorder off as a control: its ratio to the first
"off" is what the same build differs by from one server to another (the noise floor). The servers
are measured in rounds of rotating order (this machine drifts), and each row reports p50 and mean
with the recorder on and off, their ratio, the control's ratio, and the servers' CPU per call
(the scheduler's run time of all the server's threads over the calls). The floor: fork+exec of the same command.

    bench/timeline.py [--n 400] [--rounds 8] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lifecycle import REPO, Server, pct  # noqa: E402

UPLOAD = os.urandom(8 << 20)


def server_cpu_ms(pid: int) -> float:
    """CPU time of every thread of the server so far, from the scheduler's nanosecond counters
    (clock ticks are too coarse for calls of a few hundred microseconds)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            pass  # a thread that ended meanwhile
    return total / 1e6


class Side:
    """One server, one sandbox, one keep-alive client to its execd endpoint."""

    def __init__(self, binary: Path, recorder: bool):
        self.recorder = recorder
        self.server = Server(binary, "embedded", 1,
                             extra_config="" if recorder else "[timeline]\nenabled = false\n")
        base = f"http://127.0.0.1:{self.server.port}"
        self.api = httpx.Client(base_url=base, headers={"OPEN-SANDBOX-API-KEY": self.server.key}, timeout=60)
        r = self.api.post("/v1/sandboxes", json={"image": {"uri": "host"}, "timeout": 3600,
                                                 "entrypoint": ["tail", "-f", "/dev/null"]})
        assert r.status_code == 202, r.text
        self.sid = r.json()["id"]
        ep = self.api.get(f"/v1/sandboxes/{self.sid}/endpoints/44772").json()
        self.execd = httpx.Client(base_url=f"http://{ep['endpoint']}", headers=ep.get("headers", {}), timeout=60)
        self.times: dict[str, list[float]] = {}
        self.cpu: dict[str, float] = {}

    def command(self, text: str) -> None:
        ended = False
        with self.execd.stream("POST", "/command", json={"command": text}) as resp:
            for line in resp.iter_lines():
                if line.startswith('{"type":"execution_complete"'):
                    ended = True
                elif line.startswith('{"type":"error"'):
                    raise RuntimeError(line)
        assert ended

    def upload(self) -> None:
        files = [("metadata", (None, json.dumps({"path": "/tmp/upload.bin"}), "application/json")),
                 ("file", ("upload.bin", UPLOAD, "application/octet-stream"))]
        r = self.execd.post("/files/upload", files=files)
        assert r.status_code == 200, r.text

    def run(self, row: str, call, n: int) -> None:
        cpu0 = server_cpu_ms(self.server.proc.pid)
        for _ in range(n):
            t0 = time.perf_counter()
            call()
            self.times.setdefault(row, []).append((time.perf_counter() - t0) * 1000)
        self.cpu[row] = self.cpu.get(row, 0.0) + server_cpu_ms(self.server.proc.pid) - cpu0

    def events(self) -> int:
        r = self.api.get(f"/v1/sandboxes/{self.sid}/timeline")
        return len(r.text.splitlines()) if r.status_code == 200 else 0

    def close(self) -> None:
        self.api.delete(f"/v1/sandboxes/{self.sid}")
        self.server.stop()


def fork_exec(n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        subprocess.run(["sh", "-c", "echo hi"], stdout=subprocess.DEVNULL, check=True)
        out.append((time.perf_counter() - t0) * 1000)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--warren", default=str(REPO / "target/x86_64-unknown-linux-gnu/release/warren"))
    ap.add_argument("--n", type=int, default=400, help="short commands per side")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--json")
    args = ap.parse_args()
    binary = Path(args.warren)
    rows = {
        "echo hi": (lambda s: s.command("echo hi"), args.n),
        "seq 1 50000 (290 KB out)": (lambda s: s.command("seq 1 50000"), max(args.n // 10, 8)),
        "upload 8 MiB": (lambda s: s.upload(), max(args.n // 10, 8)),
    }
    sides = [Side(binary, True), Side(binary, False), Side(binary, False)]
    try:
        for s in sides:  # warm both: connections, page cache
            s.command("true")
        for rnd in range(args.rounds):
            for row, (call, n) in rows.items():
                order = sides[rnd % 3:] + sides[:rnd % 3]
                for s in order:
                    s.run(row, lambda s=s, call=call: call(s), max(n // args.rounds, 1))
        floor = fork_exec(100)
        results = {"fork_exec_p50_ms": pct(floor, 50), "rows": {}, "events_recorded": sides[0].events()}
        print(f"fork+exec p50 {pct(floor, 50):.2f} ms;  recorder on kept {results['events_recorded']} events")
        print(f"{'call':<28}{'on p50':>9}{'off p50':>9}{'p50 ratio':>11}{'mean ratio':>12}"
              f"{'control':>9}{'cpu/call on':>13}{'off':>8}")
        for row in rows:
            on, off, control = (s.times[row] for s in sides)
            cpu_on, cpu_off, _ = (s.cpu[row] / len(s.times[row]) for s in sides)
            r = {"n": len(on), "on_p50_ms": pct(on, 50), "off_p50_ms": pct(off, 50),
                 "p50_ratio": pct(on, 50) / pct(off, 50),
                 "mean_ratio": statistics.fmean(on) / statistics.fmean(off),
                 "control_p50_ratio": pct(control, 50) / pct(off, 50),
                 "cpu_ms_on": cpu_on, "cpu_ms_off": cpu_off}
            results["rows"][row] = r
            print(f"{row:<28}{r['on_p50_ms']:>9.2f}{r['off_p50_ms']:>9.2f}{r['p50_ratio']:>11.3f}"
                  f"{r['mean_ratio']:>12.3f}{r['control_p50_ratio']:>9.3f}{cpu_on:>13.2f}{cpu_off:>8.2f}")
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=2))
    finally:
        for s in sides:
            s.close()


if __name__ == "__main__":
    main()
