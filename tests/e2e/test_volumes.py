"""Volumes on every runtime: host folders only from under the server's
`allowed_host_paths` (read-only honoured, `subPath`), and named volumes (`pvc`) that outlive the
sandbox and are shared by later ones — a folder Warren keeps on native, a Docker named volume on Docker."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import pytest
from opensandbox.exceptions import SandboxException
from opensandbox.models.execd import RunCommandOpts
from opensandbox.models.sandboxes import PVC, Host, Volume

import warren_e2e as W

sh = W.sh


def remove_named_volume(server, claim: str) -> None:
    if server.kind == "docker":
        subprocess.run(["docker", "volume", "rm", "-f", claim], capture_output=True)
    else:
        shutil.rmtree(server.data_dir / "volumes" / claim, ignore_errors=True)


def named_volume_dir(server, claim: str) -> Path:
    """Where the named volume's files are on this host."""
    if server.kind == "docker":
        out = subprocess.run(["docker", "volume", "inspect", "-f", "{{.Mountpoint}}", claim],
                             capture_output=True, text=True, check=True).stdout
        return Path(out.strip())
    return server.data_dir / "volumes" / claim


def named_volume_exists(server, claim: str) -> bool:
    if server.kind == "docker":
        return subprocess.run(["docker", "volume", "inspect", claim], capture_output=True).returncode == 0
    return (server.data_dir / "volumes" / claim).is_dir()


@pytest.fixture
def host_dir(server):
    """A person's folder (a host account's, with its own group): with user namespaces the sandbox's
    root is its owner there (a folder of host root's is not the sandbox's to write; see
    test_userns.py)."""
    d = server.host_volumes / uuid.uuid4().hex[:8]
    (d / "sub").mkdir(parents=True)
    (d / "hello.txt").write_text("from the host\n")
    (d / "sub" / "inner.txt").write_text("inner\n")
    uid, gid = W.host_account()
    for p in (d, d / "sub", d / "hello.txt", d / "sub" / "inner.txt"):
        os.chown(p, uid, gid)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def claim(server):
    """A volume name, removed after the test (tests list it before `make_sandbox`, so their sandboxes
    are gone by then: Docker refuses to remove a volume in use)."""
    name = f"e2e-vol-{uuid.uuid4().hex[:8]}"
    yield name
    remove_named_volume(server, name)


def test_host_folder_read_write_and_read_only(make_sandbox, host_dir):
    sbx = make_sandbox("host", volumes=[
        Volume(name="rw", host=Host(path=str(host_dir)), mount_path="/mnt/rw"),
        Volume(name="ro", host=Host(path=str(host_dir)), mount_path="/mnt/ro", read_only=True),
    ])
    code, out, _ = sh(sbx, "cat /mnt/rw/hello.txt /mnt/ro/hello.txt")
    assert code == 0 and out == "from the host\nfrom the host\n"
    code, _, _ = sh(sbx, "echo written-inside > /mnt/rw/new.txt")
    assert code == 0
    assert (host_dir / "new.txt").read_text() == "written-inside\n", "writes reach the host folder"
    code, _, err = sh(sbx, "echo nope > /mnt/ro/blocked.txt")
    assert code != 0 and "Read-only" in err
    assert not (host_dir / "blocked.txt").exists()


def test_host_folder_sub_path(make_sandbox, host_dir):
    sbx = make_sandbox("host", volumes=[
        Volume(name="sub", host=Host(path=str(host_dir)), mount_path="/data", sub_path="sub"),
    ])
    # (python, not ls: Debian's gVisor refuses coreutils' statx on bind mounts)
    code, out, _ = sh(sbx, "python3 -c 'import os; print(os.listdir(\"/data\"))'; cat /data/inner.txt")
    assert code == 0 and out == "['inner.txt']\ninner\n"


def test_disallowed_host_paths_are_refused(server, api, host_dir):
    before = {i["id"] for i in api.get("/v1/sandboxes").json()["items"]}
    for path in ["/etc", str(server.data_dir), str(host_dir.parent.parent)]:
        body = W.create_body(server.sandbox_image("host"), volumes=[
            {"name": "v", "host": {"path": path}, "mountPath": "/mnt/x"}])
        r = api.post("/v1/sandboxes", json=body)
        W.assert_error_body(r, codes=[403])
        assert r.json()["code"] == "VOLUME::HOST_PATH_NOT_ALLOWED", r.text
    # a symlink inside the allowed folder that leads out of it
    (host_dir / "escape").symlink_to("/etc")
    r = api.post("/v1/sandboxes", json=W.create_body(server.sandbox_image("host"), volumes=[
        {"name": "v", "host": {"path": str(host_dir)}, "subPath": "escape", "mountPath": "/mnt/x"}]))
    W.assert_error_body(r, codes=[403])
    assert {i["id"] for i in api.get("/v1/sandboxes").json()["items"]} == before, "nothing half-made"


@pytest.mark.parametrize("volume, status", [
    ({"name": "v", "pvc": {"claimName": "ok"}, "mountPath": "relative/path"}, 400),
    ({"name": "v", "pvc": {"claimName": "ok"}, "mountPath": "/proc/x"}, 400),
    ({"name": "v", "pvc": {"claimName": "ok"}, "mountPath": "/"}, 400),
    ({"name": "v", "pvc": {"claimName": "../x"}, "mountPath": "/m"}, 400),
    ({"name": "v", "pvc": {"claimName": "ok"}, "subPath": "../up", "mountPath": "/m"}, 400),
    ({"name": "v", "mountPath": "/m"}, 400),
    ({"name": "v", "ossfs": {"bucket": "b", "endpoint": "e"}, "mountPath": "/m"}, 400),
])
def test_bad_volume_specs(server, api, volume, status):
    r = api.post("/v1/sandboxes", json=W.create_body(server.sandbox_image("host"), volumes=[volume]))
    W.assert_error_body(r, codes=[status])


def test_named_volume_outlives_its_sandbox_and_is_shared(server, claim, make_sandbox):
    first = make_sandbox("host", volumes=[Volume(name="data", pvc=PVC(claim_name=claim), mount_path="/data")])
    code, _, _ = sh(first, "echo kept > /data/state.txt")
    assert code == 0
    first.kill()
    assert named_volume_exists(server, claim), "the volume outlives the sandbox"
    # a later sandbox sees it, without creating it, and another one at the same time
    later = make_sandbox("host", volumes=[
        Volume(name="data", pvc=PVC(claim_name=claim, create_if_not_exists=False), mount_path="/restored")])
    other = make_sandbox("host", volumes=[
        Volume(name="data", pvc=PVC(claim_name=claim), mount_path="/data", read_only=True)])
    assert sh(later, "cat /restored/state.txt")[1] == "kept\n"
    assert sh(other, "cat /data/state.txt")[1] == "kept\n"
    assert sh(other, "touch /data/x")[0] != 0, "read-only named volume"
    assert sh(later, "echo more >> /restored/state.txt")[0] == 0
    assert sh(other, "cat /data/state.txt")[1] == "kept\nmore\n", "both see one volume"


def test_named_volume_sub_path(claim, make_sandbox):
    sbx = make_sandbox("host", volumes=[
        Volume(name="a", pvc=PVC(claim_name=claim), mount_path="/a", sub_path="one"),
        Volume(name="b", pvc=PVC(claim_name=claim), mount_path="/b", sub_path="two"),
    ])
    assert sh(sbx, "echo 1 > /a/f && echo 2 > /b/f && cat /a/f /b/f")[1] == "1\n2\n"


def test_volume_deleted_with_the_sandbox_that_created_it(server, claim, make_sandbox):
    sbx = make_sandbox("host", volumes=[
        Volume(name="tmp", pvc=PVC(claim_name=claim, delete_on_sandbox_termination=True), mount_path="/scratch")])
    assert sh(sbx, "echo x > /scratch/f")[0] == 0
    assert named_volume_exists(server, claim)
    sbx.kill()
    assert W.wait_until(lambda: not named_volume_exists(server, claim), 10)


def test_missing_volume_without_create_is_refused(server, api, claim):
    before = {i["id"] for i in api.get("/v1/sandboxes").json()["items"]}
    r = api.post("/v1/sandboxes", json=W.create_body(server.sandbox_image("host"), volumes=[
        {"name": "v", "pvc": {"claimName": claim, "createIfNotExists": False}, "mountPath": "/m"}]))
    W.assert_error_body(r, codes=[400])
    assert claim in r.json()["message"]
    assert not named_volume_exists(server, claim)
    assert {i["id"] for i in api.get("/v1/sandboxes").json()["items"]} == before


def test_failed_create_removes_the_volume_it_made(server, api, claim):
    """The second volume is refused by the runtime after the first was created: nothing stays."""
    missing = f"{claim}-missing"
    r = api.post("/v1/sandboxes", json=W.create_body(server.sandbox_image("host"), volumes=[
        {"name": "a", "pvc": {"claimName": claim}, "mountPath": "/a"},
        {"name": "b", "pvc": {"claimName": missing, "createIfNotExists": False}, "mountPath": "/b"}]))
    W.assert_error_body(r, codes=[400])
    assert not named_volume_exists(server, claim)


def test_sdk_rejects_nothing_it_should_not(make_sandbox, host_dir):
    """Volumes through the async-free SDK path with every field the SDK sends."""
    sbx = make_sandbox("host", volumes=[
        Volume(name="v", host=Host(path=str(host_dir)), mount_path="/v", read_only=True, sub_path="sub")])
    assert sh(sbx, "cat /v/inner.txt")[1] == "inner\n"
    with pytest.raises(SandboxException):
        sbx.files.write_file("/v/new.txt", "x")


def _decoy(tmp_path):
    """A host folder no sandbox may reach: the target of the links the tests plant."""
    decoy = tmp_path / "decoy"
    decoy.mkdir()
    (decoy / "secret.txt").write_text("host secret\n")
    return decoy


def test_a_link_left_in_a_named_volume_leads_nowhere(server, api, claim, make_sandbox, tmp_path):
    """Root in one sandbox plants links in a shared volume; a later create whose `subPath` goes
    through one is refused, and nothing is made or mounted on the host where the link points."""
    decoy = _decoy(tmp_path)
    first = make_sandbox("host", volumes=[Volume(name="v", pvc=PVC(claim_name=claim), mount_path="/v")])
    code, out, err = sh(first, f"ln -s {decoy} /v/esc && ln -s {decoy}/secret.txt /v/file && mkdir /v/real && echo ok")
    assert code == 0, (out, err)
    for sub in ("esc", "esc/newdir", "file", "real/../esc"):
        r = api.post("/v1/sandboxes", json=W.create_body(server.sandbox_image("host"), volumes=[
            {"name": "v", "pvc": {"claimName": claim}, "subPath": sub, "mountPath": "/m"}]))
        W.assert_error_body(r, codes=[400])
    assert sorted(p.name for p in decoy.iterdir()) == ["secret.txt"], "something was made through the link"
    # the real folder still works
    ok = make_sandbox("host", volumes=[Volume(name="v", pvc=PVC(claim_name=claim), mount_path="/m", sub_path="real")])
    assert sh(ok, "echo in > /m/f && cat /m/f")[1] == "in\n"


# Swaps /v/real (a folder) and /v/swap (a link to the decoy) in a loop with renameat2(RENAME_EXCHANGE),
# each state held for a random 0-4 ms, so that whatever looks at /v/real sees one or the other.
_RACER = r"""
import ctypes, os, random, sys, time
libc = ctypes.CDLL(None, use_errno=True)
os.makedirs('/v/real/x', exist_ok=True)
if not os.path.lexists('/v/swap'):
    os.symlink(sys.argv[1], '/v/swap')
open('/v/racing', 'w').close()
while os.path.exists('/v/racing'):
    libc.syscall(316, -100, b'/v/real', -100, b'/v/swap', 2)
    time.sleep(random.random() * 0.004)
"""


def test_a_folder_swapped_for_a_link_during_create_is_never_mounted(server, api, claim, make_sandbox, tmp_path):
    """A sandbox races later creates: it swaps a folder of a shared volume for a link to a host folder
    over and over. Whatever the moment, a create that mounts that folder (as a volume's `subPath`, and
    as the way to another volume's mount point) either fails or gets the real folder — never the host
    folder, and nothing is made there. (The native runtime mounts volumes from handles, with runc
    and runsc too: inside the root before the runtime starts; the Docker runtime stages what it
    opened in a folder of its own and gives the daemon that.)"""
    if server.gvisor:
        pytest.skip("under gVisor a command reading a volume that another sandbox renames in a tight "
                    "loop stalls (whether the volume is mounted by path or from a handle)")
    decoy = _decoy(tmp_path)
    racer = make_sandbox("host", volumes=[Volume(name="v", pvc=PVC(claim_name=claim), mount_path="/v")])
    racer_dir = named_volume_dir(server, claim)
    racer.commands.run(f"python3 -c \"{_RACER}\" {decoy}", opts=RunCommandOpts(background=True))
    for _ in range(100):
        if (racer_dir / "racing").exists():
            break
        time.sleep(0.05)
    assert (racer_dir / "racing").exists(), "the racer did not start"
    outcomes = []
    try:
        for i in range(40):
            r = api.post("/v1/sandboxes", json=W.create_body(server.sandbox_image("host"), volumes=[
                {"name": "a", "pvc": {"claimName": claim}, "subPath": "real", "mountPath": "/m"},
                {"name": "b", "pvc": {"claimName": claim}, "mountPath": "/n"},
                {"name": "c", "pvc": {"claimName": claim}, "subPath": "real", "mountPath": f"/n/real/x/nested{i}"},
            ]))
            if r.status_code != 202:
                outcomes.append(r.status_code)
                continue
            sid = r.json()["id"]
            try:
                body = api.post(f"/sandboxes/{sid}/proxy/44772/command", json={"command": "cat /m/secret.txt /n/real/secret.txt 2>/dev/null; ls /m"},
                                timeout=30).text
                outcomes.append("mounted")
                assert "host secret" not in body, f"the host folder was mounted: {body[:500]}"
            finally:
                api.delete(f"/v1/sandboxes/{sid}")
    finally:
        (racer_dir / "racing").unlink(missing_ok=True)
    assert sorted(p.name for p in decoy.iterdir()) == ["secret.txt"], "something was made in the host folder"
    print("outcomes:", outcomes)
    # Refused when the server looked (400) or when the sandbox's setup did (500), or mounted with the
    # real folder: the race must have reached the setup at least once for this to show anything.
    assert set(outcomes) <= {400, 500, "mounted"}, outcomes
    assert any(o in (500, "mounted") for o in outcomes), f"the race never reached a sandbox's setup: {outcomes}"


def test_read_only_reaches_mounts_below_the_volume(server, make_sandbox, host_dir):
    """A read-only host folder with a separate filesystem mounted below it (as /usr/local often is
    below /usr): the mount below is read-only inside the sandbox too. (Docker 20.10's read-only binds
    are read-only at the top only, but the Docker runtime stages the folder read-only all through.)"""
    below = host_dir / "sub"
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "e2e-below", str(below)], check=True)
    try:
        (below / "there.txt").write_text("below\n")
        sbx = make_sandbox("host", volumes=[
            Volume(name="ro", host=Host(path=str(host_dir)), mount_path="/mnt/ro", read_only=True)])
        code, out, _ = sh(sbx, "cat /mnt/ro/sub/there.txt")
        assert code == 0 and out == "below\n", out
        code, _, err = sh(sbx, "echo nope > /mnt/ro/sub/blocked.txt")
        assert code != 0 and "Read-only" in err, err
        assert not (below / "blocked.txt").exists()
    finally:
        subprocess.run(["umount", "-l", str(below)], check=False)
