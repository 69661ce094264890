#!/usr/bin/env python3
"""Image pull benchmark: pull + unpack of one image from one local registry.

Side by side in one run, each from a cold local cache, N times:
  * warren image pull      - Warren's pull into a fresh data dir (download, verify, unpack, commit),
  * skopeo copy + umoci    - `skopeo copy docker://… oci:DIR` then `umoci unpack` (the usual
                             daemonless pair), and each half alone,
  * docker pull            - when a Docker engine answers (DOCKER_HOST honoured), then `docker rmi`,
and then, on a running `warren serve`:
  * re-pull, layers cached - `warren image pull` of an image already in the store (manifest + config),
  * create → first output → delete on the cached image (raw API), and the first create of another
    tag of the same image (the create pulls its manifest and config; the layers are cached).

The image is the debootstrap test rootfs ($WARREN_TEST_ROOTFS, ~180 MB) as a gzip base layer plus
two small layers, all gzip (umoci 0.4 reads no zstd), pushed to Debian's `docker-registry` on a free loopback port started
and stopped by this script. Usage:
    bench/pull.py [--n 5] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests/e2e"))
sys.path.insert(0, str(REPO / "bench"))

import registry as R  # noqa: E402
from lifecycle import Server, pct  # noqa: E402


def warren_bin() -> Path:
    profile = os.environ.get("WARREN_PROFILE", "release")
    return REPO / "target/x86_64-unknown-linux-gnu" / profile / "warren"


def timed(cmd: list[str], env: dict | None = None) -> float:
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    elapsed = time.perf_counter() - t0
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:3])}…: exit {r.returncode}: {r.stderr[-500:]}")
    return elapsed


def row(name: str, secs: list[float]) -> dict:
    ms = [s * 1000 for s in secs]
    return {"kind": name, "n": len(ms), "p50_ms": pct(ms, 50), "min_ms": min(ms) if ms else float("nan"),
            "max_ms": max(ms) if ms else float("nan"), "mean_ms": statistics.fmean(ms) if ms else float("nan")}


def docker_available() -> bool:
    try:
        return subprocess.run(["docker", "version"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=5)
    ap.add_argument("--creates", type=int, default=30)
    ap.add_argument("--json")
    args = ap.parse_args()
    binary = warren_bin()
    if not binary.is_file():
        raise SystemExit(f"{binary} missing: cargo build --release -p warren")
    rootfs = Path(os.environ.get("WARREN_TEST_ROOTFS", "/var/cache/warren/test-rootfs"))
    work = Path(tempfile.mkdtemp(prefix="warren-pull-bench-"))
    reg = R.Registry(work / "registry").start()
    server = None
    try:
        build = R.ImageBuilder(work / "build")
        print("building the image …", flush=True)
        base = build.layer_from_dir(rootfs, compression="gzip")
        extra = build.layer({"etc/bench-layer": b"1\n", "usr/share/doc/.wh.bench": ("whiteout",)}, compression="gzip")
        top = build.layer({"etc/bench-top": b"2\n"}, compression="gzip")
        image = build.image([base, extra, top], env=["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"])
        R.registry_push(reg, "bench/img", "v1", image)
        R.registry_push(reg, "bench/img2", "v1", image)
        ref = f"{reg.host}/bench/img:v1"
        compressed = sum(l.size for l in image.layers)
        print(f"image {ref}: {len(image.layers)} layers, {compressed / 2**20:.1f} MiB compressed", flush=True)

        results: list[dict] = []
        times: list[float] = []
        for i in range(args.n):
            data = work / f"warren-data-{i}"
            times.append(timed([str(binary), "image", "pull", "-q", "--insecure-registry", reg.host, ref,
                                "--data-dir", str(data)]))
        results.append(row("warren image pull", times))

        if shutil.which("skopeo") and shutil.which("umoci"):
            copy, unpack, both = [], [], []
            for i in range(args.n):
                layout, bundle = work / f"oci-{i}", work / f"bundle-{i}"
                c = timed(["skopeo", "copy", "--quiet", "--src-tls-verify=false", f"docker://{ref}", f"oci:{layout}:v1"])
                u = timed(["umoci", "unpack", "--image", f"{layout}:v1", str(bundle)])
                copy.append(c)
                unpack.append(u)
                both.append(c + u)
            results += [row("skopeo copy + umoci unpack", both), row("  skopeo copy alone", copy),
                        row("  umoci unpack alone", unpack)]
        else:
            print("skopeo/umoci not installed: their rows are skipped", flush=True)

        # Deleting thousands of files makes ext4 slow to allocate inodes for minutes afterwards
        # (`recently_deleted`), so every output stays until the end; docker's row (which must
        # `docker rmi` to pull again) comes last.

        # On a server: re-pull of a cached image, creates on it, and a create that pulls.
        extra_config = (f'[network]\ndns_upstream = "127.0.0.1:9"\n'
                        f'[registries."{reg.host}"]\ninsecure = true\n')
        server = Server(binary, "embedded", 2, extra_config=extra_config)
        data_dir = server.dir / "data"
        timed([str(binary), "image", "pull", "-q", "--insecure-registry", reg.host, ref, "--data-dir", str(data_dir)])
        repulls = [timed([str(binary), "image", "pull", "-q", "--insecure-registry", reg.host, ref,
                          "--data-dir", str(data_dir)]) for _ in range(args.n)]
        results.append(row("re-pull, layers cached", repulls))

        base_url = f"http://127.0.0.1:{server.port}"
        h = {"OPEN-SANDBOX-API-KEY": server.key}
        with httpx.Client(timeout=300) as c:
            def create_run_delete(image_ref: str) -> float:
                t0 = time.perf_counter()
                r = c.post(f"{base_url}/v1/sandboxes", headers=h, json={
                    "image": {"uri": image_ref}, "timeout": 600, "entrypoint": ["tail", "-f", "/dev/null"],
                    "resourceLimits": {"cpu": "1", "memory": "2Gi"}})
                if r.status_code != 202:
                    raise RuntimeError(f"create: {r.status_code} {r.text}")
                sid = r.json()["id"]
                try:
                    ep = c.get(f"{base_url}/v1/sandboxes/{sid}/endpoints/44772", headers=h).json()
                    with c.stream("POST", f"http://{ep['endpoint']}/command", headers=ep.get("headers", {}),
                                  json={"command": "echo hi"}) as resp:
                        for line in resp.iter_lines():
                            if line.strip() and json.loads(line.removeprefix("data:"))["type"] == "stdout":
                                return time.perf_counter() - t0
                    raise RuntimeError("no output")
                finally:
                    c.delete(f"{base_url}/v1/sandboxes/{sid}", headers=h)

            creates = [create_run_delete(ref) for _ in range(args.creates)]
            results.append(row("create → first output, cached image", creates))
            results.append(row("create → first output, create pulls a new tag (layers cached)",
                                [create_run_delete(f"{reg.host}/bench/img2:v1")]))
        if docker_available():
            pulls = []
            for _ in range(args.n):
                pulls.append(timed(["docker", "pull", "-q", ref]))
                subprocess.run(["docker", "rmi", "-f", ref], capture_output=True)
            results.insert(4 if len(results) > 4 else len(results), row("docker pull", pulls))
        else:
            print("no Docker engine: the docker pull row is skipped", flush=True)
    finally:
        if server:
            server.stop()
        reg.stop()
        shutil.rmtree(work, ignore_errors=True)

    baseline = next((r["p50_ms"] for r in results if r["kind"] == "skopeo copy + umoci unpack"), None)
    print(f"\nmachine: {platform.machine()}, {os.cpu_count()} cores, {platform.release()}; n={args.n}")
    print("| kind | n | p50 ms | min ms | max ms | p50 / skopeo+umoci |")
    print("|---|---|---|---|---|---|")
    for r in results:
        ratio = f"{r['p50_ms'] / baseline:.2f}" if baseline else "-"
        print(f"| {r['kind']} | {r['n']} | {r['p50_ms']:.1f} | {r['min_ms']:.1f} | {r['max_ms']:.1f} | {ratio} |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
