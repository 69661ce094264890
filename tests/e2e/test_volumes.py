"""Volumes (issue 4 item 3) on every runtime: host folders only from under the server's
`allowed_host_paths` (read-only honoured, `subPath`), and named volumes (`pvc`) that outlive the
sandbox and are shared by later ones — a folder Warren keeps on native, a Docker named volume on Docker."""

from __future__ import annotations

import shutil
import subprocess
import uuid

import pytest
from opensandbox.exceptions import SandboxException
from opensandbox.models.sandboxes import PVC, Host, Volume

import warren_e2e as W

sh = W.sh


def remove_named_volume(server, claim: str) -> None:
    if server.is_docker:
        subprocess.run(["docker", "volume", "rm", "-f", claim], capture_output=True)
    else:
        shutil.rmtree(server.data_dir / "volumes" / claim, ignore_errors=True)


def named_volume_exists(server, claim: str) -> bool:
    if server.is_docker:
        return subprocess.run(["docker", "volume", "inspect", claim], capture_output=True).returncode == 0
    return (server.data_dir / "volumes" / claim).is_dir()


@pytest.fixture
def host_dir(server):
    d = server.host_volumes / uuid.uuid4().hex[:8]
    (d / "sub").mkdir(parents=True)
    (d / "hello.txt").write_text("from the host\n")
    (d / "sub" / "inner.txt").write_text("inner\n")
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
