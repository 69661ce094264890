"""Snapshots and forks, and pause that keeps memory, driven through the
official SDK: a running sandbox's file system captured without stopping it, restored into new
sandboxes with `snapshot_id`, N restores from one snapshot (a fork), and a paused sandbox whose
processes use no CPU and continue where they were after resume."""

from __future__ import annotations

import concurrent.futures
import time
from datetime import timedelta
from pathlib import Path

import pytest

import warren_e2e as W


def _snapshot_capable(server) -> None:
    server.require("snapshots", "snapshots copy the runtime's writable layer (embedded, runc)")


def _wait_ready(mgr, snapshot_id: str, timeout: float = 120):
    def ready():
        info = mgr.get_snapshot(snapshot_id)
        assert info.status.state != "Failed", f"snapshot failed: {info.status}"
        return info if info.status.state == "Ready" else None
    return W.wait_until(ready, timeout, interval=0.1, message=f"snapshot {snapshot_id} to be Ready")


@pytest.fixture
def manager(server):
    from opensandbox import SandboxManagerSync
    mgr = SandboxManagerSync.create(connection_config=server.sdk_config())
    yield mgr
    mgr.close()


# The state the source sandbox builds: a new file, a deleted image file (whiteout), a directory of the
# image replaced wholesale (opaque), a file changed in place, and a busy process.
SETUP = (
    "echo kept > /root/state.txt && mkdir -p /data/deep && seq 1 1000 > /data/deep/numbers && "
    "rm /etc/issue && rm -rf /usr/share/doc && mkdir /usr/share/doc && echo only > /usr/share/doc/only && "
    "echo changed >> /etc/hostname.e2e"
)
CHECK = (
    "cat /root/state.txt; wc -l < /data/deep/numbers; test -e /etc/issue && echo issue-present || echo issue-gone; "
    "ls /usr/share/doc; cat /etc/hostname.e2e"
)
EXPECTED = "kept\n1000\nissue-gone\nonly\nchanged\n"


@pytest.mark.timeout(300)
def test_snapshot_restore_and_fork(server, test_image, make_sandbox, manager):
    _snapshot_capable(server)
    src = make_sandbox(test_image)
    code, _, err = W.sh(src, SETUP)
    assert code == 0, err
    # A process whose in-memory counter must survive the capture (the sandbox is frozen, not stopped).
    # (written aside and renamed in: a reader never sees the file empty between open and write)
    src.commands.run("python3 -c 'import os, time\ni=0\nwhile True:\n i+=1\n open(\"/tmp/count.new\",\"w\").write(str(i))\n os.rename(\"/tmp/count.new\", \"/tmp/count\")\n time.sleep(0.05)' ",
                     opts=_background())
    W.wait_until(lambda: W.sh(src, "cat /tmp/count")[1].strip().isdigit(), 30, message="the counter to start")

    info = src.create_snapshot(name="e2e-snap")
    assert info.status.state in ("Creating", "Ready") and info.sandbox_id == src.id and info.name == "e2e-snap"
    ready = _wait_ready(manager, info.id)
    assert ready.id == info.id

    # The source kept running: same counter process, still counting.
    before = int(W.sh(src, "cat /tmp/count")[1])
    time.sleep(0.3)
    assert int(W.sh(src, "cat /tmp/count")[1]) > before, "the source sandbox's process stopped"

    # Restore, through the SDK.
    from opensandbox import SandboxSync
    restored = SandboxSync.create(snapshot_id=info.id, connection_config=server.sdk_config(),
                                  timeout=timedelta(minutes=10), ready_timeout=timedelta(seconds=60))
    W.track_sandbox(restored.id)
    make_sandbox.created.append(restored)
    code, out, err = W.sh(restored, CHECK)
    assert code == 0 and out == EXPECTED, (out, err)
    assert restored.get_info().id == restored.id

    # Changes after the snapshot are not in it.
    W.sh(src, "echo later > /root/after.txt")
    assert W.sh(restored, "test -e /root/after.txt")[0] != 0

    # Fork: 8 sandboxes from the snapshot at once, each with its own writable layer.
    def restore(i):
        sbx = SandboxSync.create(snapshot_id=info.id, connection_config=server.sdk_config(),
                                 timeout=timedelta(minutes=10), ready_timeout=timedelta(seconds=60))
        W.track_sandbox(sbx.id)
        return sbx
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        forks = list(pool.map(restore, range(8)))
    make_sandbox.created.extend(forks)
    for i, f in enumerate(forks):
        code, out, err = W.sh(f, f"{CHECK}; echo fork-{i} > /root/mine")
        assert code == 0 and out == EXPECTED, (i, out, err)
    for i, f in enumerate(forks):
        assert W.sh(f, "cat /root/mine")[1] == f"fork-{i}\n", "forks share no writable state"

    # Listing and deleting; restored sandboxes outlive their snapshot.
    from opensandbox.models.sandboxes import SnapshotFilter
    listed = manager.list_snapshots(SnapshotFilter(sandbox_id=src.id))
    assert [s.id for s in listed.snapshot_infos] == [info.id]
    manager.delete_snapshot(info.id)
    with server.client() as c:
        r = c.get(f"/v1/snapshots/{info.id}")
        W.assert_error_body(r, codes=[404])
        assert r.json()["code"] == "SNAPSHOT::NOT_FOUND"
        r = c.post("/v1/sandboxes", json={**W.create_body(), "image": None, "snapshotId": info.id})
        W.assert_error_body(r, codes=[404])
    assert W.sh(forks[0], CHECK)[1] == EXPECTED, "a restored sandbox must keep working after its snapshot is deleted"


def _background():
    from opensandbox.models.execd import RunCommandOpts
    return RunCommandOpts(background=True)


@pytest.mark.timeout(120)
def test_snapshot_bad_requests(server, api, make_sandbox):
    r = api.post("/v1/sandboxes/does-not-exist/snapshots", json={})
    W.assert_error_body(r, codes=[404])
    r = api.post("/v1/sandboxes", json={**W.create_body(), "snapshotId": "x"})
    W.assert_error_body(r, codes=[400])  # image and snapshotId together
    body = W.create_body()
    del body["image"]
    r = api.post("/v1/sandboxes", json={**body, "snapshotId": "no-such-snapshot"})
    W.assert_error_body(r, codes=[404])
    assert r.json()["code"] == "SNAPSHOT::NOT_FOUND"
    assert api.get("/v1/snapshots/nope").status_code == 404
    assert api.delete("/v1/snapshots/nope").status_code == 404
    r = api.get("/v1/snapshots", params={"pageSize": "0"})
    W.assert_error_body(r, codes=[400])
    if not server.caps.snapshots:
        sbx = make_sandbox("host")
        r = api.post(f"/v1/sandboxes/{sbx.id}/snapshots", json={})
        # accepted and then failed, or refused at once: never a half-made image
        if r.status_code == 202:
            snap = r.json()["id"]
            W.wait_until(lambda: api.get(f"/v1/snapshots/{snap}").json()["status"]["state"] == "Failed", 30)
            api.delete(f"/v1/snapshots/{snap}")
        else:
            W.assert_error_body(r, codes=[400, 409])
        return
    # the host image has no layers to capture: the snapshot fails with a reason, and leaves nothing
    sbx = make_sandbox("host")
    r = api.post(f"/v1/sandboxes/{sbx.id}/snapshots", content=b"")
    assert r.status_code == 202, r.text
    snap = r.json()["id"]
    W.wait_until(lambda: api.get(f"/v1/snapshots/{snap}").json()["status"]["state"] == "Failed", 30)
    failed = api.get(f"/v1/snapshots/{snap}").json()
    assert "host" in failed["status"]["message"], failed
    assert api.delete(f"/v1/snapshots/{snap}").status_code == 204
    images = Path(server.data_dir) / "images" / "tmp"
    assert not any(images.iterdir()), "a failed snapshot leaves no staging behind"


def _cpu_usage_ns(sandbox_id: str) -> int | None:
    """The sandbox cgroup's CPU time, read on the host (v1 cpuacct or v2 cpu.stat)."""
    for path in Path("/sys/fs/cgroup").rglob(f"*{sandbox_id}*"):
        acct = path / "cpuacct.usage"
        if acct.is_file():
            return int(acct.read_text())
        stat = path / "cpu.stat"
        if stat.is_file():
            for line in stat.read_text().splitlines():
                if line.startswith("usage_usec "):
                    return int(line.split()[1]) * 1000
    return None


@pytest.mark.timeout(180)
def test_a_disk_bounded_sandbox_snapshots_and_restores_bounded(server, test_image, make_sandbox, manager):
    """A sandbox with `ephemeral-storage` keeps its writable layer on a disk of its own: the
    snapshot captures it from there, and a restore asking for a bound gets one too."""
    _snapshot_capable(server)
    bounded = {"cpu": "1", "memory": "512Mi", "ephemeral-storage": "64Mi"}
    src = make_sandbox(test_image, resource=bounded)
    code, _, err = W.sh(src, SETUP)
    assert code == 0, err
    info = src.create_snapshot(name="e2e-bounded")
    _wait_ready(manager, info.id)
    from opensandbox import SandboxSync
    restored = SandboxSync.create(snapshot_id=info.id, connection_config=server.sdk_config(),
                                  resource=bounded, timeout=timedelta(minutes=10),
                                  ready_timeout=timedelta(seconds=60))
    W.track_sandbox(restored.id)
    make_sandbox.created.append(restored)
    code, out, err = W.sh(restored, CHECK)
    assert code == 0 and out == EXPECTED, (out, err)
    code, out, _ = W.sh(restored, "dd if=/dev/zero of=/root/big bs=1M count=100 2>&1; echo exit=$?",
                        timeout=timedelta(seconds=60))
    assert "No space left on device" in out and "exit=1" in out, out


@pytest.mark.timeout(180)
def test_pause_keeps_memory_and_uses_no_cpu(server, test_image, make_sandbox):
    if server.kind == "docker":
        pytest.skip("the Docker runtime's pause is docker pause (covered by test_lifecycle)")
    sbx = make_sandbox(test_image)
    # Busy, with its state only in memory: a counter that spins and reports itself. The report is
    # renamed into place, never truncated and rewritten: a pause can land between a truncate and
    # its write (it did on gVisor, where each is a trip through the sentry), and the first read
    # after the resume must see a whole number.
    sbx.commands.run(
        "python3 -c 'import os,time\ni=0\nt=time.time()\nwhile True:\n i+=1\n "
        "if time.time()-t>0.05:\n  open(\"/tmp/mem.new\",\"w\").write(str(i)); "
        "os.replace(\"/tmp/mem.new\",\"/tmp/mem\"); t=time.time()' ",
        opts=_background())
    W.wait_until(lambda: W.sh(sbx, "cat /tmp/mem")[1].strip().isdigit(), 30, message="the counter to start")
    pid_before = W.sh(sbx, "pgrep -f 'while True' | head -1")[1].strip()
    sbx.pause()
    with server.client() as c:
        W.wait_until(lambda: c.get(f"/v1/sandboxes/{sbx.id}").json()["status"]["state"] == "Paused", 30)
    cpu0 = _cpu_usage_ns(sbx.id)
    time.sleep(1.5)
    cpu1 = _cpu_usage_ns(sbx.id)
    if cpu0 is not None and not server.gvisor:
        assert cpu1 - cpu0 < 20_000_000, f"a paused sandbox used {(cpu1 - cpu0) / 1e6:.1f} ms of CPU in 1.5 s"
    from opensandbox import SandboxSync
    sbx = SandboxSync.resume(sbx.id, connection_config=server.sdk_config())
    make_sandbox.created.append(sbx)
    code, out, err = W.sh(sbx, "cat /tmp/mem")
    assert code == 0 and out.strip().isdigit(), f"after the resume /tmp/mem read {out!r} (exit {code}, {err!r})"
    value = int(out)
    W.wait_until(lambda: int(W.sh(sbx, "cat /tmp/mem")[1]) > value, 30, message="the counter to continue")
    assert W.sh(sbx, "pgrep -f 'while True' | head -1")[1].strip() == pid_before, "the same process continues"


@pytest.mark.timeout(300)
def test_snapshot_images_without_a_snapshot_are_removed(fresh_server, work_root):
    """A snapshot deleted while it is being taken leaves no image once the capture ends; and an
    image of the snapshot repository that no snapshot owns (a capture cut off by a stop after its
    snapshot was deleted) is removed at the next start, not kept forever."""
    import uuid
    from opensandbox import SandboxSync
    srv = fresh_server
    _snapshot_capable(srv)
    srv.import_image(W.TEST_IMAGE_NAME, W.test_rootfs())
    sbx = SandboxSync.create(W.TEST_IMAGE_NAME, connection_config=srv.sdk_config(),
                             timeout=timedelta(minutes=10))
    W.track_sandbox(sbx.id)
    try:
        code, _, err = W.sh(sbx, "head -c 64M /dev/urandom > /root/big && echo done")
        assert code == 0, err
        with srv.client() as api:
            r = api.post(f"/v1/sandboxes/{sbx.id}/snapshots")
            assert r.status_code == 202, r.text
            snap = r.json()["id"]
            assert api.delete(f"/v1/snapshots/{snap}").status_code == 204
            W.wait_until(lambda: f"warren-snapshot/{snap}" not in srv.cli("image", "ls").stdout, 60,
                         interval=0.5, message="the deleted snapshot's image to go")
            time.sleep(1)
            assert api.get(f"/v1/snapshots/{snap}").status_code == 404
            assert f"warren-snapshot/{snap}" not in srv.cli("image", "ls").stdout
    finally:
        sbx.kill()
        sbx.close()
    srv.terminate()
    folder = work_root / f"orphan-{uuid.uuid4().hex[:6]}"
    folder.mkdir()
    (folder / "marker").write_text("x")
    orphan = f"warren-snapshot/{uuid.uuid4()}"
    srv.cli("image", "import", orphan, str(folder))
    assert orphan in srv.cli("image", "ls").stdout
    srv.start()
    assert orphan not in srv.cli("image", "ls").stdout, "an image no snapshot owns survived a start"
