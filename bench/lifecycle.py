#!/usr/bin/env python3
"""Warren lifecycle benchmark: create -> first command output -> delete.

Side by side in one process and one run:
  * fork+exec   - a plain subprocess running the same command (the floor),
  * unshare+overlay+chroot - the bare bones of a sandbox, what any sandbox does at least: `unshare` into
                 new mount, PID, network, UTS and IPC namespaces, an overlay of the test image
                 ($WARREN_TEST_ROOTFS) on a fresh upper dir, `chroot` and the command; its folder
                 removed after (no cgroup, no API, no agent). Omitted when the test image is absent.
  * raw API     - httpx against Warren's REST API and its endpoint proxy,
  * SDK         - the official OpenSandbox Python SDK (opensandbox==1.1.1),
  * docker run  - `docker run --rm --network none` of the same command, when a Docker engine answers,
  * warren raw API no-userns - the raw API against a second native server with
                 `user_namespaces = false` (with --no-userns): what a user namespace per sandbox costs
                 (the embedded runtime's default has them),
  * warren on Docker - the raw API against a second `warren serve` with `runtime.kind = "docker"`
                 (with --docker; DOCKER_HOST is honoured), on the same image as `docker run`,
each serial and at N concurrent, with p50/p90/p99, success counts and the p50 ratio to fork+exec.

It starts its own `warren serve` (release build by default) on a free loopback port with a temp data
dir and stops it by PID at the end. Usage:
    bench/lifecycle.py [--n 50] [--concurrency 10] [--image host|test] [--oci embedded] [--no-userns] [--docker] [--json OUT]
`--image test` imports the debootstrap test image ($WARREN_TEST_ROOTFS) into the native server under the
name the Docker rows use (warren-test:bookworm), so all rows run the same root filesystem.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
COMMAND = "echo hi"


def pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    k = (len(s) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A `warren serve` of our own, stopped by PID."""

    def __init__(self, binary: Path, oci: str, standby: int, kind: str = "native",
                 max_parallel: int | None = None, extra_config: str = "", top_config: str = ""):
        self.dir = Path(tempfile.mkdtemp(prefix="warren-bench-"))
        self.port = free_port()
        self.key = secrets.token_hex(16)
        cfg = self.dir / "config.toml"
        if kind == "kubernetes":
            cfg.write_text(top_config + '[runtime]\nkind = "kubernetes"\n' + extra_config)
        elif kind == "docker":
            host = os.environ.get("DOCKER_HOST", "")
            cfg.write_text('[runtime]\nkind = "docker"\n[docker]\npull = "never"\n'
                           + (f'host = "{host}"\n' if host else ""))
        else:
            cfg.write_text(top_config + f'[runtime]\nkind = "native"\noci_runtime = "{oci}"\nstandby_helpers = {standby}\n'
                           + (f"max_parallel_creates = {max_parallel}\n" if max_parallel is not None else "")
                           + extra_config)
        self.env = dict(os.environ, WARREN_API_KEY=self.key, WARREN_LOG="warn")
        self.cmd = [str(binary), "serve", "--listen", f"127.0.0.1:{self.port}", "--data-dir",
                    str(self.dir / "data"), "--config", str(cfg)]
        self.log = open(self.dir / "server.log", "ab")
        self.restart()

    def restart(self):
        """Starts the server (again, after a kill: same data dir, port and key)."""
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=self.log, env=self.env,
                                     start_new_session=True)
        deadline = time.time() + 30
        while time.time() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise SystemExit(f"warren did not start; see {self.dir / 'server.log'}")

    def rss_kib(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        return 0

    def stop(self, keep: bool = False):
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if not keep:
            self.cleanup()

    def cleanup(self):
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


# --- one sandbox's life, per client kind -------------------------------------------------------

async def raw_once(client: httpx.AsyncClient, base: str, key: str, image: str,
                   track: dict[str, set] | None = None) -> float:
    """One cycle; `track` (soak.py) collects the ids whose create was answered, whose delete was
    sent, and whose delete was answered."""
    t0 = time.perf_counter()
    h = {"OPEN-SANDBOX-API-KEY": key}
    r = await client.post(f"{base}/v1/sandboxes", headers=h, json={
        "image": {"uri": image}, "timeout": 600, "resourceLimits": {"cpu": "1", "memory": "2Gi"},
        "entrypoint": ["tail", "-f", "/dev/null"]})
    if r.status_code != 202:
        raise RuntimeError(f"create: {r.status_code} {r.text}")
    sid = r.json()["id"]
    if track is not None:
        track["created"].add(sid)
    try:
        ep = (await client.get(f"{base}/v1/sandboxes/{sid}/endpoints/44772", headers=h)).json()
        first = None
        async with client.stream("POST", f"http://{ep['endpoint']}/command", headers=ep.get("headers", {}),
                                 json={"command": COMMAND}) as resp:
            async for line in resp.aiter_lines():
                if not line.strip():
                    continue
                ev = json.loads(line.removeprefix("data:"))
                if ev["type"] == "stdout" and first is None:
                    first = time.perf_counter() - t0
                if ev["type"] == "error":
                    raise RuntimeError(f"command failed: {ev}")
        if first is None:
            raise RuntimeError("no output")
        return first
    finally:
        if track is not None:
            track["delete_sent"].add(sid)
        d = await client.delete(f"{base}/v1/sandboxes/{sid}", headers=h)
        if d.status_code != 204:
            raise RuntimeError(f"delete: {d.status_code} {d.text}")
        if track is not None:
            track["deleted"].add(sid)


async def sdk_once(cfg, image: str) -> float:
    from opensandbox import Sandbox
    from opensandbox.models.execd import ExecutionHandlers

    t0 = time.perf_counter()
    sb = await Sandbox.create(image, connection_config=cfg)
    first: list[float] = []

    async def on_stdout(_msg):
        if not first:
            first.append(time.perf_counter() - t0)

    try:
        ex = await sb.commands.run(COMMAND, handlers=ExecutionHandlers(on_stdout=on_stdout))
        if ex.exit_code != 0 or not first:
            raise RuntimeError(f"sdk command failed: {ex}")
        return first[0]
    finally:
        await sb.kill()
        await sb.close()


async def fork_once() -> float:
    t0 = time.perf_counter()
    p = await asyncio.create_subprocess_exec("sh", "-c", COMMAND, stdout=asyncio.subprocess.PIPE)
    await p.stdout.readline()
    elapsed = time.perf_counter() - t0
    await p.wait()
    return elapsed


async def bare_once(lower: str, scratch: Path) -> float:
    d = Path(tempfile.mkdtemp(dir=scratch))
    script = (f"mkdir {d}/u {d}/w {d}/m && "
              f"mount -t overlay overlay -o lowerdir={lower},upperdir={d}/u,workdir={d}/w {d}/m && "
              f"exec chroot {d}/m sh -c '{COMMAND}'")
    try:
        t0 = time.perf_counter()
        p = await asyncio.create_subprocess_exec(
            "unshare", "--mount", "--propagation", "private", "--pid", "--fork", "--net", "--uts", "--ipc",
            "sh", "-c", script, stdout=asyncio.subprocess.PIPE)
        line = await p.stdout.readline()
        elapsed = time.perf_counter() - t0
        if await p.wait() != 0 or not line:
            raise RuntimeError("unshare+overlay+chroot failed")
        return elapsed
    finally:
        # the overlay went with the mount namespace
        await asyncio.to_thread(shutil.rmtree, d, True)


async def docker_once(image: str) -> float:
    t0 = time.perf_counter()
    p = await asyncio.create_subprocess_exec("docker", "run", "--rm", "--network", "none", image, "sh", "-c", COMMAND,
                                             stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)
    line = await p.stdout.readline()
    elapsed = time.perf_counter() - t0
    if await p.wait() != 0 or not line:
        raise RuntimeError("docker run failed")
    return elapsed


# --- drivers ---------------------------------------------------------------------------------

def busy_jiffies() -> int:
    """The machine's CPU time so far (all cores, idle and iowait excepted), in clock ticks."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return sum(fields) - fields[3] - fields[4]


def cpu_ms_per_cycle(jiffies: int, cycles: int) -> float:
    return jiffies * 1000 / os.sysconf("SC_CLK_TCK") / cycles if cycles else float("nan")


async def measure(make, n: int, concurrency: int) -> dict:
    times: list[float] = []
    errors: list[str] = []
    sem = asyncio.Semaphore(concurrency)

    async def one():
        async with sem:
            try:
                times.append(await make())
            except Exception as e:  # noqa: BLE001 - counted and reported
                errors.append(str(e)[:200])

    t0, cpu0 = time.perf_counter(), busy_jiffies()
    await asyncio.gather(*(one() for _ in range(n)))
    cpu = cpu_ms_per_cycle(busy_jiffies() - cpu0, len(times))
    ms = [t * 1000 for t in times]
    return {"n": n, "concurrency": concurrency, "ok": len(times), "failed": len(errors), "cpu_ms": cpu,
            "p50_ms": pct(ms, 50), "p90_ms": pct(ms, 90), "p99_ms": pct(ms, 99),
            "mean_ms": statistics.fmean(ms) if ms else float("nan"), "wall_s": time.perf_counter() - t0,
            "errors": errors[:3]}


def rust_client_run(load: Path, port: int, key: str, image: str, n: int, concurrency: int,
                    pause_ms: int = 0) -> dict:
    """The same cycle as raw_once, driven by the compiled warren-sdk client (bench/load) in its own
    process, so no Python CPU competes with the server for the machine's cores; `pause_ms` between
    cycles."""
    cpu0 = busy_jiffies()
    out = subprocess.run([str(load), "--domain", f"127.0.0.1:{port}", "--api-key", key, "--image", image,
                          "--command", COMMAND, "--n", str(n), "--concurrency", str(concurrency),
                          "--pause-ms", str(pause_ms)],
                         check=True, capture_output=True, text=True, timeout=600)
    busy = busy_jiffies() - cpu0
    r = json.loads(out.stdout)
    ms = r["times_ms"]
    cpu = cpu_ms_per_cycle(busy, len(ms))
    return {"n": n, "concurrency": concurrency, "ok": len(ms), "failed": len(r["errors"]), "cpu_ms": cpu,
            "p50_ms": pct(ms, 50), "p90_ms": pct(ms, 90), "p99_ms": pct(ms, 99),
            "mean_ms": statistics.fmean(ms) if ms else float("nan"), "wall_s": r["wall_s"],
            "errors": [e[:200] for e in r["errors"][:3]]}


def docker_available() -> bool:
    if not shutil.which("docker"):
        return False
    try:
        return subprocess.run(["docker", "info"], capture_output=True, timeout=10).returncode == 0
    except subprocess.TimeoutExpired:
        return False


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=50)
    ap.add_argument("--concurrency", type=int, default=10)
    ap.add_argument("--image", default="host")
    ap.add_argument("--oci", default="embedded")
    ap.add_argument("--standby", type=int, default=2, help="[runtime] standby_helpers of the server")
    ap.add_argument("--max-parallel", type=int, default=None,
                    help="[runtime] max_parallel_creates of the server (default: its own, the CPU count)")
    ap.add_argument("--docker-image", default=os.environ.get("WARREN_BENCH_DOCKER_IMAGE", "warren-test:bookworm"))
    ap.add_argument("--warren", default=str(REPO / "target/x86_64-unknown-linux-gnu/release/warren"))
    ap.add_argument("--docker", action="store_true",
                    help="also run Warren on the Docker runtime (and `docker run`), when a daemon answers")
    ap.add_argument("--no-userns", action="store_true",
                    help="also run the raw API rows against a server without user namespaces")
    ap.add_argument("--no-disk", action="store_true",
                    help="also run the raw API and Rust rows against a server whose sandboxes get no disk "
                         "of their own by default ([limits] default_ephemeral_storage = \"none\")")
    ap.add_argument("--load", help="the warren-load binary (default: beside --warren)")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    use_docker = args.docker and docker_available()

    os.environ["OPENSANDBOX_DISABLE_METRICS"] = "1"
    server = Server(Path(args.warren), args.oci, args.standby, max_parallel=args.max_parallel)
    docker_server = Server(Path(args.warren), args.oci, 0, kind="docker") if use_docker else None
    plain_server = (Server(Path(args.warren), args.oci, args.standby, max_parallel=args.max_parallel,
                            extra_config="user_namespaces = false\n") if args.no_userns else None)
    nodisk_server = (Server(Path(args.warren), args.oci, args.standby, max_parallel=args.max_parallel,
                            extra_config='[limits]\ndefault_ephemeral_storage = "none"\n')
                     if args.no_disk else None)
    image = args.image
    if image == "test":
        image = args.docker_image
        rootfs = os.environ.get("WARREN_TEST_ROOTFS", "/var/cache/warren/test-rootfs")
        for srv in (server, plain_server, nodisk_server):
            if srv:
                subprocess.run([args.warren, "image", "import", image, rootfs, "--data-dir", str(srv.dir / "data")],
                               check=True, capture_output=True)
    results: dict[str, dict] = {}
    try:
        from opensandbox.config import ConnectionConfig
        base = f"http://127.0.0.1:{server.port}"
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
        from opensandbox.transport import RetryAsyncTransport, RetryPolicy
        # The SDK's documented way to create many sandboxes: one transport shared by all of them.
        # Without it every Sandbox.create builds a fresh httpx transport, and with it a TLS context
        # that loads the CA bundle (~20 ms of client CPU here) even for plain-HTTP endpoints.
        shared = RetryAsyncTransport(httpx.AsyncHTTPTransport(limits=limits), RetryPolicy(), owns_inner=True)
        async with httpx.AsyncClient(timeout=60, limits=limits) as client:
            cfg = ConnectionConfig(domain=f"127.0.0.1:{server.port}", api_key=server.key)
            cfg_shared = ConnectionConfig(domain=f"127.0.0.1:{server.port}", api_key=server.key,
                                          transport=shared)
            for _ in range(3):  # warm-up: page cache, first-use paths
                await raw_once(client, base, server.key, image)
                await fork_once()
            # and as many at once as the concurrent rows run: what a server makes once per sandbox
            # slot (a user namespace per id range) is made before the measured rows
            await asyncio.gather(*(raw_once(client, base, server.key, image) for _ in range(args.concurrency)))
            kinds = {"fork+exec": fork_once}
            bare_lower = os.environ.get("WARREN_TEST_ROOTFS", "/var/cache/warren/test-rootfs")
            if Path(bare_lower, "bin/sh").exists() and shutil.which("unshare"):
                scratch = server.dir / "bare"
                scratch.mkdir()
                for _ in range(3):
                    await bare_once(bare_lower, scratch)
                kinds["unshare+overlay+chroot"] = lambda: bare_once(bare_lower, scratch)
            else:
                print(f"# no test image at {bare_lower}: the unshare+overlay+chroot rows are omitted")
            kinds |= {
                "warren raw API": lambda: raw_once(client, base, server.key, image),
                "warren SDK": lambda: sdk_once(cfg, image),
                "warren SDK shared": lambda: sdk_once(cfg_shared, image),
            }
            async def paired(other: Server, name: str) -> None:
                """`name`'s row against `other`, right after the raw API rows it is compared with,
                so a drift of the machine's speed between them stays small."""
                nonlocal kinds
                obase = f"http://127.0.0.1:{other.port}"
                for _ in range(3):
                    await raw_once(client, obase, other.key, image)
                await asyncio.gather(*(raw_once(client, obase, other.key, image)
                                       for _ in range(args.concurrency)))
                row = lambda: raw_once(client, obase, other.key, image)  # noqa: E731
                kinds = {k2: v2 for k, v in kinds.items()
                         for k2, v2 in ([(k, v), (name, row)] if k == "warren raw API" else [(k, v)])}
            if nodisk_server:
                await paired(nodisk_server, "warren raw API no-disk")
            if plain_server:
                await paired(plain_server, "warren raw API no-userns")
            if docker_server:
                dbase = f"http://127.0.0.1:{docker_server.port}"
                for _ in range(3):
                    await raw_once(client, dbase, docker_server.key, args.docker_image)
                    await docker_once(args.docker_image)
                kinds["warren on docker raw API"] = lambda: raw_once(client, dbase, docker_server.key,
                                                                     args.docker_image)
                kinds["docker run --rm"] = lambda: docker_once(args.docker_image)
            for name, make in kinds.items():
                for conc in (1, args.concurrency):
                    results[f"{name} c={conc}"] = await measure(make, args.n, conc)
            load = Path(args.load or Path(args.warren).with_name("warren-load"))
            if load.exists():
                for conc in (1, args.concurrency):
                    results[f"warren Rust SDK c={conc}"] = rust_client_run(
                        load, server.port, server.key, image, args.n, conc)
                    if nodisk_server:
                        results[f"warren Rust SDK no-disk c={conc}"] = rust_client_run(
                            load, nodisk_server.port, nodisk_server.key, image, args.n, conc)
            else:
                print(f"# {load} not built (cargo build --release -p warren-bench): Rust SDK rows omitted")
        await shared.aclose()
        rss = server.rss_kib()
    finally:
        server.stop()
        if docker_server:
            docker_server.stop()
        if plain_server:
            plain_server.stop()
        if nodisk_server:
            nodisk_server.stop()

    machine = f"{os.cpu_count()} cpus, {platform.machine()}, Linux {platform.release()}"
    print(f"# create -> first output of {COMMAND!r} -> delete; image {image!r}, oci runtime {args.oci}, "
          f"standby helpers {args.standby}, n={args.n} per row")
    print(f"# machine: {machine}; server RSS after the run: {rss / 1024:.1f} MiB")
    print(f"{'kind':<30}{'ok/n':>9}{'p50 ms':>10}{'p90 ms':>10}{'p99 ms':>10}{'p50 / fork':>12}"
          f"{'CPU ms/cycle':>14}" + (f"{'p50 / docker':>14}" if use_docker else ""))
    for name, r in results.items():
        conc = name.rsplit("c=", 1)[1]
        floor = results.get(f"fork+exec c={conc}")
        ratio = r["p50_ms"] / floor["p50_ms"] if floor and floor["p50_ms"] else float("nan")
        line = (f"{name:<30}{r['ok']:>4}/{r['n']:<4}{r['p50_ms']:>10.1f}{r['p90_ms']:>10.1f}"
                f"{r['p99_ms']:>10.1f}{ratio:>12.1f}{r['cpu_ms']:>14.1f}")
        docker = results.get(f"docker run --rm c={conc}")
        if docker and docker["p50_ms"]:
            line += f"{r['p50_ms'] / docker['p50_ms']:>14.2f}"
        print(line)
        for e in r["errors"]:
            print(f"    error: {e}")
    if not use_docker:
        print("# Docker rows omitted (no --docker, or no Docker engine answered)")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine, "server_rss_kib": rss, "results": results},
                                              indent=2))


if __name__ == "__main__":
    asyncio.run(main())
