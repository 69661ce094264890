"""`warren image import/ls/rm`: a tiny busybox rootfs as a tarball, imported while the server
runs, then used by a sandbox; removal, a bad path refused cleanly, and the built-in `host` image
listed."""

from __future__ import annotations

import os
import shutil
import tarfile
import uuid

import pytest

import warren_e2e as W

BUSYBOX = "/bin/busybox"
APPLETS = ["sh", "ash", "echo", "cat", "ls", "sleep", "tail", "ps", "id", "pwd", "env", "true",
           "false", "mkdir", "rm", "uname", "sha256sum", "stat", "hostname", "grep", "tr", "head", "seq"]


def _require_busybox() -> str:
    for cand in (BUSYBOX, "/usr/bin/busybox"):
        if os.path.isfile(cand):
            return cand
    msg = "static busybox not found (apt-get install busybox-static, or run scripts/install-deps)"
    if W.allow_skip():
        pytest.skip(msg)
    pytest.fail(msg, pytrace=False)


@pytest.fixture
def busybox_tarball(work_root):
    bb = _require_busybox()
    root = work_root / f"bbroot-{uuid.uuid4().hex[:6]}"
    for d in ("bin", "etc", "tmp", "proc", "dev", "sys", "root", "workspace"):
        (root / d).mkdir(parents=True, exist_ok=True)
    shutil.copy2(bb, root / "bin/busybox")
    for a in APPLETS:
        os.symlink("busybox", root / "bin" / a)
    (root / "etc/passwd").write_text("root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534::/:/bin/false\n")
    (root / "etc/group").write_text("root:x:0:\nnogroup:x:65534:\n")
    (root / "etc/busybox-e2e").write_text("marker\n")
    tar = work_root / f"{root.name}.tar"
    with tarfile.open(tar, "w") as t:
        t.add(root, arcname=".")
    shutil.rmtree(root)
    yield tar
    tar.unlink(missing_ok=True)


def test_import_tarball_and_use_it(server, busybox_tarball, make_sandbox):
    server.require_image_store("Warren's image store (where an engine brings images, they are its own)")
    name = f"busybox-e2e:{uuid.uuid4().hex[:6]}"
    server.cli("image", "import", name, str(busybox_tarball))
    ls = server.cli("image", "ls")
    assert name in ls.stdout, f"`warren image ls` does not list {name}:\n{ls.stdout}"

    sbx = make_sandbox(name, entrypoint=["/bin/sleep", "100000"])
    code, out, err = W.sh(sbx, "cat /etc/busybox-e2e; echo hi > /tmp/x && cat /tmp/x; ls /usr 2>&1 | head -1")
    assert code == 0, err
    lines = out.strip().splitlines()
    assert lines[0] == "marker" and lines[1] == "hi"
    sbx.files.write_file("/tmp/y", "via execd")
    assert sbx.files.read_file("/tmp/y") == "via execd"
    # the image itself is not modified by a sandbox's writes
    sbx.kill()
    sbx2 = make_sandbox(name, entrypoint=["/bin/sleep", "100000"])
    code, out, _ = W.sh(sbx2, "test -e /tmp/x && echo leaked || echo clean")
    assert out.strip() == "clean"
    sbx2.kill()


def test_image_rm(server, busybox_tarball):
    name = f"busybox-rm:{uuid.uuid4().hex[:6]}"
    server.cli("image", "import", name, str(busybox_tarball))
    assert name in server.cli("image", "ls").stdout
    server.cli("image", "rm", name)
    assert name not in server.cli("image", "ls").stdout
    with server.client() as c:
        r = c.post("/v1/sandboxes", json=W.create_body(name))
    W.assert_error_body(r, codes=range(400, 500))


def test_import_bad_path_fails_cleanly(server, work_root):
    res = server.cli("image", "import", "nothing:here", str(work_root / "does-not-exist"), check=False)
    assert res.returncode != 0
    assert res.stderr.strip(), "a failed import should explain itself on stderr"
    assert "nothing:here" not in server.cli("image", "ls").stdout


def test_host_image_listed(server):
    assert "host" in server.cli("image", "ls").stdout.split()


def test_folders_warren_needs_come_from_a_base_layer_and_the_image_wins(server, work_root, make_sandbox):
    """/.warren, /tmp, /workspace and the mount points /dev, /proc, /sys come from a base layer under
    every image: an image without them
    still gets them (with the right modes) and nothing is made in the sandbox's own writable layer;
    an image that has its own /tmp (here a symlink) keeps it."""
    server.require_image_store("Warren's image store (where an engine brings images, they are its own)")
    bb = _require_busybox()
    for variant in ("bare", "own-tmp"):
        root = work_root / f"base-{variant}-{uuid.uuid4().hex[:6]}"
        (root / "bin").mkdir(parents=True)
        (root / "etc").mkdir()
        (root / "var/scratch").mkdir(parents=True)
        shutil.copy2(bb, root / "bin/busybox")
        for a in APPLETS:
            os.symlink("busybox", root / "bin" / a)
        (root / "etc/passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
        if variant == "own-tmp":
            os.symlink("var/scratch", root / "tmp")
        name = f"base-{variant}:{uuid.uuid4().hex[:6]}"
        server.cli("image", "import", name, str(root))
        sbx = make_sandbox(name, entrypoint=["/bin/sleep", "100000"])
        code, out, err = W.sh(sbx, "stat -c '%a %F' /tmp /workspace; ls -a / | tr '\\n' ' '; echo; "
                                   "echo x > /workspace/w && cat /workspace/w")
        assert code == 0, err
        lines = out.strip().splitlines()
        if variant == "bare" or server.gvisor:  # gVisor mounts a tmpfs of its own on /tmp
            assert lines[0] == "1777 directory", lines
        else:
            assert lines[0] == "777 symbolic link", f"the image's own /tmp wins: {lines}"
        assert lines[1] == "755 directory", lines
        assert lines[-1] == "x"
        if server.caps.snapshots:  # a writable layer on this host (gVisor keeps writes in its own overlay)
            upper = W.upper_dir(server.data_dir, sbx.id)
            made = sorted(p.name for p in upper.iterdir())
            assert made == ["workspace"], f"only what the sandbox wrote is in its upper dir: {made}"
        sbx.kill()
        shutil.rmtree(root)
