"""Leak check: nothing of a sandbox outlives it. Runs LAST (marker `leak_check`, moved to the
end by conftest.py whatever the collection order): stops every server the
suite started, after deleting their sandboxes through the API, then proves
nothing is left behind: no process, no mount, no cgroup, no sandbox folder, no Docker container or
volume, no volume lease."""

from __future__ import annotations

import time

import pytest

import warren_e2e as W


@pytest.mark.leak_check
@pytest.mark.timeout(300)
def test_nothing_left_behind():
    problems: list[str] = []

    # zombies die with their parent: look while the servers still run
    deadline = time.monotonic() + 10
    while True:
        zombies = {s.name: W.zombie_children(s.proc.pid) for s in W.REGISTRY.servers if s.alive()}
        zombies = {k: v for k, v in zombies.items() if v}
        if not zombies or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    for name, pids in zombies.items():
        problems.append(f"server {name} keeps {len(pids)} zombie children: {pids[:20]}")

    for srv in W.REGISTRY.servers:
        if srv.alive():
            try:
                srv.stop()
            except AssertionError as exc:
                problems.append(f"stopping server {srv.name}: {exc}")

    data_dirs = sorted(W.REGISTRY.data_dirs)
    ids = sorted(W.REGISTRY.sandbox_ids)

    # give asynchronous teardown (runtime shims, lazy unmounts) a moment
    deadline = time.monotonic() + 10
    while True:
        procs = W.leaked_processes(data_dirs)
        mounts = W.leaked_mounts(data_dirs)
        cgroups = W.leaked_cgroups(ids, W.REGISTRY.server_pids - W.REGISTRY.killed_pids)
        dirs = W.leaked_sandbox_dirs(data_dirs, ids)
        docker = W.leaked_docker(data_dirs)
        leases = W.leaked_volume_leases(data_dirs)
        network = W.leaked_network(data_dirs)
        if not (procs or mounts or cgroups or dirs or docker or leases or network) \
                or time.monotonic() > deadline:
            break
        time.sleep(0.5)

    for title, items in (("processes", procs), ("mounts", mounts),
                         ("cgroups", cgroups), ("sandbox directories", dirs),
                         ("Docker containers and volumes", docker), ("volume leases", leases),
                         ("network links and firewall tables", network)):
        if items:
            problems.append(f"leaked {title} ({len(items)}):\n  " + "\n  ".join(items[:40]))

    if problems:
        logs = "\n".join(f"--- {s.name} log tail ({s.log_path}) ---\n{s.log_tail(30)}"
                         for s in W.REGISTRY.servers)
        pytest.fail(f"{len(ids)} sandboxes, {len(data_dirs)} data dirs checked\n"
                    + "\n".join(problems) + "\n" + logs, pytrace=False)
    W.REGISTRY.leak_check_passed = True
