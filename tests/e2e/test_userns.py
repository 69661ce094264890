"""User namespaces (`[runtime] user_namespaces = true`, the default of the embedded runtime and
runc): sandbox root is a range of 65,536 unprivileged host ids of its own.

Inside, root still does what root does in a container (chown, setuid programs, port 80, files API);
on the host, every file the sandbox makes belongs to its range, image layers stay root's and
unchanged, two sandboxes never share a range, and a root-only host file the `host` image binds in
is unreadable (root inside has no override on ids outside its range)."""

from __future__ import annotations

import os
import secrets
import uuid
from pathlib import Path

import pytest

import warren_e2e as W

BASE = 1 << 31
SIZE = 65536


@pytest.fixture(scope="module")
def userns_server(server, work_root):
    server.require("userNamespaces", "user namespaces: the embedded runtime and runc (gVisor's Sentry is a "
                                     "kernel of its own; Docker's are the daemon's to set up)")
    srv = W.WarrenServer(server.runtime, work_root, f"userns-{uuid.uuid4().hex[:6]}")
    srv.runtime_config = "user_namespaces = true\n"
    srv.start()
    srv.import_image(W.TEST_IMAGE_NAME, W.test_rootfs())
    yield srv
    srv.delete_all_sandboxes()
    srv.stop()


def make(srv, image=None, **kw):
    from opensandbox import SandboxSync
    sbx = SandboxSync.create(image or W.TEST_IMAGE_NAME, connection_config=srv.sdk_config(), **kw)
    W.track_sandbox(sbx.id)
    return sbx


def range_of(sbx) -> int:
    code, out, err = W.sh(sbx, "cat /proc/self/uid_map /proc/self/gid_map")
    assert code == 0, err
    lines = [l.split() for l in out.strip().splitlines()]
    assert len(lines) == 2 and all(l[0] == "0" and l[2] == str(SIZE) for l in lines), out
    assert lines[0][1] == lines[1][1], "uids and gids share the range"
    return int(lines[0][1])


def upper(srv, sbx) -> Path:
    return W.upper_dir(srv.data_dir, sbx.id)


def test_root_is_a_range_of_its_own(userns_server):
    a, b = make(userns_server), make(userns_server)
    try:
        ra, rb = range_of(a), range_of(b)
        assert ra >= BASE and rb >= BASE and (ra - BASE) % SIZE == 0
        assert abs(ra - rb) >= SIZE, "two live sandboxes never share ids"
        code, out, err = W.sh(a, "id -u; id -g; touch /root/made && chown 100:100 /root/made && "
                                 "stat -c %u:%g /root/made /etc/passwd")
        assert code == 0, err
        assert out.split() == ["0", "0", "100:100", "0:0"], out
        made = os.stat(upper(userns_server, a) / "root" / "made")
        assert (made.st_uid, made.st_gid) == (ra + 100, ra + 100), "on the host: the sandbox's range"
        # The image's layers are root's on disk and stay so: a chown inside copies the file up.
        W.sh(a, "chown 5:5 /etc/passwd")
        layer_passwd = [p for p in (userns_server.data_dir / "images").rglob("etc/passwd")]
        assert layer_passwd and all(os.stat(p).st_uid == 0 for p in layer_passwd), layer_passwd
        assert os.stat(upper(userns_server, a) / "etc" / "passwd").st_uid == ra + 5
    finally:
        a.kill()
        b.kill()


def test_root_keeps_what_containers_need(userns_server):
    sbx = make(userns_server)
    try:
        # setuid programs work inside, and mean nothing outside
        code, out, err = W.sh(sbx, "cp /usr/bin/id /tmp/suid-id && chmod 4755 /tmp/suid-id && "
                                   "setpriv --reuid=1000 --regid=1000 --clear-groups /tmp/suid-id -u && "
                                   "setpriv --reuid=1000 --regid=1000 --clear-groups id -u")
        assert code == 0 and out.split() == ["0", "1000"], (out, err)
        st = os.stat(upper(userns_server, sbx) / "tmp" / "suid-id")
        assert st.st_mode & 0o4000 and st.st_uid == range_of(sbx), "setuid, but to an unprivileged host id"
        # a server on port 80
        code, out, err = W.sh(sbx, "nohup python3 -m http.server 80 >/dev/null 2>&1 & sleep 1; "
                                   "python3 -c \"import urllib.request; print(urllib.request.urlopen("
                                   "'http://127.0.0.1:80/', timeout=5).status)\"")
        assert code == 0 and out.strip() == "200", (out, err)
        # the files API writes as the sandbox's root
        sbx.files.write_file("/workspace/up.txt", "hello")
        code, out, _ = W.sh(sbx, "stat -c %u /workspace/up.txt")
        assert out.strip() == "0", out
        assert os.stat(upper(userns_server, sbx) / "workspace" / "up.txt").st_uid == range_of(sbx)
        # no privilege over the host's namespaces: no mounts, no new namespaces
        assert W.sh(sbx, "mount -t tmpfs none /mnt")[0] != 0
        assert W.sh(sbx, "unshare -U true")[0] != 0
    finally:
        sbx.kill()


def test_root_only_host_files_stay_unreadable_in_the_host_image(userns_server):
    """The `host` image binds the host's /etc in; a 0600 root file there is not the sandbox's (host
    root is no id of its range), so its root cannot read it. World-readable files still are."""
    canary = Path("/etc") / f"warren-canary-{secrets.token_hex(4)}"
    secret = secrets.token_hex(16)
    canary.write_text(secret)
    os.chmod(canary, 0o600)
    sbx = make(userns_server, userns_server.sandbox_image("host"))
    try:
        code, out, _ = W.sh(sbx, f"cat {canary}")
        assert code != 0 and secret not in out, "a root-only host file was read"
        code, out, _ = W.sh(sbx, "head -1 /etc/passwd")
        assert code == 0 and out.startswith("root:"), out
        code, out, _ = W.sh(sbx, f"stat -c %u {canary}")
        assert out.strip() == "65534", "host root shows as nobody"
    finally:
        sbx.kill()
        canary.unlink()


VOLUME_BASE = 0x7FFF0000


def test_a_users_folder_is_root_owned_inside_and_nothing_lands_as_a_host_account(userns_server):
    """A host folder owned by a host account, with that account's own group (a person's): inside,
    its root is that account and its group, and what it makes there is theirs on the host. Every
    other id of the sandbox is the volume range's on disk, never a host account or group: a setuid
    or setgid file it makes there (the way to root, or to group `shadow` or `docker`, for any host
    user who runs it) belongs to an id no host account has. Files of other host users, and a folder
    whose group is another host group, are nobody's inside and not writable. (Volumes were idmapped
    through the sandbox's own namespace: its root wrote host uid 0, setuid-root programs included;
    and a folder's group, whatever it was, became the sandbox's root group.)"""
    from opensandbox.models.sandboxes import Host, Volume
    uid, gid = W.host_account()
    host_dir = userns_server.host_volumes / uuid.uuid4().hex[:8]
    host_dir.mkdir(parents=True)
    (host_dir / "shared").mkdir()
    os.chmod(host_dir / "shared", 0o777)
    os.chown(host_dir, uid, gid)
    os.chown(host_dir / "shared", uid, 4343)  # the owner's, but in another group
    for name, owner in (("from-user", (uid, gid)), ("from-other", (4242, 4242)), ("from-root", (0, 0))):
        (host_dir / name).write_text("hi\n")
        os.chmod(host_dir / name, 0o666)
        os.chown(host_dir / name, *owner)
    sbx = make(userns_server, volumes=[Volume(name="h", host=Host(path=str(host_dir)), mount_path="/mnt/h")])
    try:
        code, out, err = W.sh(sbx, "cd /mnt/h && stat -c %u:%g . from-user from-other from-root shared && "
                                   "echo x > made && echo more >> from-user && cat from-other from-root && "
                                   "cp /usr/bin/id suid && chmod 4755 suid && "
                                   "cp /usr/bin/id sgid && chown 7:42 sgid && chmod 6755 sgid && "
                                   "chown 0:0 made && touch by-1001 && chown 1001:1001 by-1001 && echo ok")
        assert code == 0, (out, err)
        assert out.split()[:5] == ["0:0", "0:0", "65534:65534", "65534:65534", "0:65534"], out
        for path in ("from-other", "from-root", "shared/f"):
            code, _, err = W.sh(sbx, f"echo no >> /mnt/h/{path}")
            assert code != 0, f"root wrote {path}, which another host user or group has"
        assert not (host_dir / "shared" / "f").exists()
        assert (host_dir / "from-other").read_text() == (host_dir / "from-root").read_text() == "hi\n"
        ids = lambda n: (os.stat(host_dir / n).st_uid, os.stat(host_dir / n).st_gid)  # noqa: E731
        assert ids("made") == (uid, gid), "root's files are the folder owner's"
        assert (host_dir / "from-user").read_text() == "hi\nmore\n"
        # setuid to the folder's owner, as its owner could make; no other host account or group
        assert os.stat(host_dir / "suid").st_mode & 0o4000 and ids("suid") == (uid, gid)
        assert os.stat(host_dir / "sgid").st_mode & 0o6000 == 0o6000
        assert ids("sgid") == (VOLUME_BASE + 7, VOLUME_BASE + 42), ids("sgid")
        assert ids("by-1001") == (VOLUME_BASE + 1001, VOLUME_BASE + 1001), "not host uid 1001's"
        volumes = range(VOLUME_BASE, VOLUME_BASE + SIZE)
        made = {n: ids(n) for n in ("made", "suid", "sgid", "by-1001")}
        assert all(i in (uid, gid) or i in volumes for pair in made.values() for i in pair), made
    finally:
        sbx.kill()


def test_a_root_owned_folder_never_gets_host_roots_files(userns_server):
    """A host folder of host root's: the sandbox's root is the volume range's root there. Host
    root's files are nobody's inside and, like every file of an id the mount does not map, not
    writable at all (a 1777 folder included): the sandbox only reads. A folder in it given to the
    volume range's root is the sandbox's, and a setuid file made there, even chowned to 0 inside,
    belongs to no host account."""
    from opensandbox.models.sandboxes import Host, Volume
    host_dir = userns_server.host_volumes / uuid.uuid4().hex[:8]
    (host_dir / "open").mkdir(parents=True)
    os.chmod(host_dir / "open", 0o1777)
    (host_dir / "given").mkdir()
    os.chown(host_dir / "given", VOLUME_BASE, VOLUME_BASE)
    (host_dir / "readme").write_text("from the host\n")
    sbx = make(userns_server, volumes=[Volume(name="h", host=Host(path=str(host_dir)), mount_path="/mnt/h")])
    try:
        code, out, err = W.sh(sbx, "stat -c %u /mnt/h /mnt/h/given && cat /mnt/h/readme")
        assert code == 0 and out.split() == ["65534", "0", "from", "the", "host"], (out, err)
        for path in ("/mnt/h/top", "/mnt/h/open/f", "/mnt/h/readme"):
            assert W.sh(sbx, f"echo x >> {path}")[0] != 0, f"wrote {path}, which is host root's"
        code, out, err = W.sh(sbx, "cp /usr/bin/id /mnt/h/given/suid && chown 0:0 /mnt/h/given/suid && "
                                   "chmod 4755 /mnt/h/given/suid && echo ok")
        assert code == 0, (out, err)
        st = os.stat(host_dir / "given" / "suid")
        assert st.st_mode & 0o4000 and (st.st_uid, st.st_gid) == (VOLUME_BASE, VOLUME_BASE), (st.st_uid, st.st_gid)
        assert sorted(p.name for p in host_dir.rglob("*")) == ["given", "open", "readme", "suid"]
        assert (host_dir / "readme").read_text() == "from the host\n"
    finally:
        sbx.kill()


def test_a_named_volume_is_one_owner_for_every_sandbox(userns_server):
    """A named volume keeps its files under the volume range, whatever the range of the sandbox that
    wrote them: a later sandbox, in another range, sees them as its own root's and writes them, and
    nothing there is a host account's. A `subPath` Warren makes belongs to the volume's root."""
    from opensandbox.models.sandboxes import PVC, Volume
    claim = f"ns-{uuid.uuid4().hex[:6]}"
    vols = [Volume(name="n", pvc=PVC(claim_name=claim), mount_path="/mnt/n"),
            Volume(name="s", pvc=PVC(claim_name=claim), mount_path="/mnt/s", sub_path="made/by/warren")]
    a = make(userns_server, volumes=vols)
    try:
        code, out, err = W.sh(a, "echo a > /mnt/n/f && chown 5:5 /mnt/n/f && "
                                 "echo s > /mnt/s/g && stat -c %u /mnt/n /mnt/s /mnt/s/g")
        assert code == 0 and out.split() == ["0", "0", "0"], (out, err)
        b = make(userns_server, volumes=vols)
        try:
            assert range_of(a) != range_of(b)
            code, out, err = W.sh(b, "stat -c %u:%g /mnt/n/f && echo b >> /mnt/s/g && cat /mnt/s/g")
            assert code == 0 and out.split() == ["5:5", "s", "b"], (out, err)
        finally:
            b.kill()
        folder = userns_server.data_dir / "volumes" / claim
        owners = {str(p.relative_to(folder)): os.stat(p).st_uid for p in [folder, *folder.rglob("*")]}
        assert owners["f"] == VOLUME_BASE + 5 and owners["made/by/warren/g"] == VOLUME_BASE, owners
        assert all(VOLUME_BASE <= u < VOLUME_BASE + SIZE for u in owners.values()), owners
    finally:
        a.kill()
        import shutil
        shutil.rmtree(userns_server.data_dir / "volumes" / claim, ignore_errors=True)


def test_a_snapshot_records_the_sandboxs_own_ids(userns_server):
    """A snapshot's layer holds the sandbox's ids (7, not its range's 2³¹ + 7): a sandbox made from it,
    with a range of its own, sees the same owners."""
    src = make(userns_server)
    try:
        code, _, err = W.sh(src, "echo keep > /root/kept && chown 7:7 /root/kept")
        assert code == 0, err
        info = src.create_snapshot(name="userns-snap")
        from opensandbox import SandboxSync

        def ready():
            with userns_server.client() as c:
                st = c.get(f"/v1/snapshots/{info.id}").json()["status"]
            assert st["state"] != "Failed", st
            return st["state"] == "Ready"
        W.wait_until(ready, 120, interval=0.1, message="snapshot to be Ready")
        restored = SandboxSync.create(snapshot_id=info.id, connection_config=userns_server.sdk_config())
        W.track_sandbox(restored.id)
        try:
            assert range_of(restored) != range_of(src)
            code, out, err = W.sh(restored, "stat -c %u:%g /root/kept && cat /root/kept")
            assert code == 0 and out.split() == ["7:7", "keep"], (out, err)
        finally:
            restored.kill()
        layers = [p for p in (userns_server.data_dir / "images").rglob("root/kept")]
        assert layers and all(os.stat(p).st_uid == 7 for p in layers), [(p, os.stat(p).st_uid) for p in layers]
    finally:
        src.kill()


def test_servers_on_one_host_never_share_a_range(userns_server, work_root):
    """Ranges are unique on the host, across servers. Two servers with live
    sandboxes hand out different ranges; a server that stops leaves its sandboxes running, and a
    server started on another data dir meanwhile (a blue/green successor) skips their ranges too.
    Each server used to start at 2^31 with its slots in memory: the first sandbox of each got the
    same 65,536 ids."""
    other = W.WarrenServer(userns_server.runtime, work_root, f"userns-b-{uuid.uuid4().hex[:6]}")
    other.runtime_config = "user_namespaces = true\n"
    other.start()
    third = None
    try:
        other.import_image(W.TEST_IMAGE_NAME, W.test_rootfs())
        mine = [make(userns_server) for _ in range(2)]
        theirs = [make(other) for _ in range(2)]
        ranges = [range_of(s) for s in mine + theirs]
        assert len(set(ranges)) == 4, f"a range was handed out twice: {ranges}"
        # The second server stops; its sandboxes run on (as they do across a restart).
        other.terminate()
        for base, s in zip(ranges[2:], theirs):
            owner, sandbox = Path(f"/run/warren/id-ranges/{base}").read_text().rsplit(" ", 1)
            assert (Path(owner).resolve(), sandbox) == (other.data_dir.resolve(), f"{s.id}\n")
        third = W.WarrenServer(userns_server.runtime, work_root, f"userns-c-{uuid.uuid4().hex[:6]}")
        third.runtime_config = "user_namespaces = true\n"
        third.start()
        third.import_image(W.TEST_IMAGE_NAME, W.test_rootfs())
        newcomer = [make(third) for _ in range(3)]
        got = [range_of(s) for s in newcomer]
        assert not set(got) & set(ranges), f"a live sandbox's range was handed out again: {got} vs {ranges}"
    finally:
        if third is not None:
            third.stop()
        if not other.alive():
            other.start()
        other.stop()

