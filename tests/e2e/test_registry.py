"""Pulling OCI images from registries into the native image store: `warren image pull` and pull-on-create.

Everything runs against registries on loopback (registry.py): Debian's docker-registry (plain HTTP, and
HTTPS + htpasswd with a throwaway CA), behind in-process fronts that count requests, stall a body to
cut a pull deterministically, or add Docker's bearer-token flow. The images are built here in Python
(registry.ImageBuilder), so every layer, whiteout and manifest is exactly what the test says.

Native runtime only (the Docker runtime pulls with the daemon: test_docker.py), and only once per session:
on the first native runtime of WARREN_E2E_OCI_RUNTIMES. One module-level server is configured with:

    [registries."docker.io"]       mirrors = ["<front>"], upstream = false   Docker Hub names via the
                                                             counting front, never the real Hub
    [registries."<front>"]         insecure = true           plain registry, counting/stalling front
    [registries."<token front>"]   insecure = true           same registry, bearer-token flow
    [registries."<crash front>"]   insecure = true           a second registry we kill mid-pull
    [registries."<tls registry>"]  ca_file = ".../ca.pem"    HTTPS + basic auth
    (the plain registry's own address is deliberately NOT configured: plain HTTP without `insecure`)
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import threading
import time
import unicodedata
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

import registry as R
import warren_e2e as W

BB_ENTRY = ["/bin/sleep", "100000"]          # busybox images: absolute, whatever PATH says
NETWORK = '[network]\ndns_upstream = "127.0.0.1:9"\n'
TOKEN_USER, TOKEN_PASSWORD = "tokuser", "tok-" + uuid.uuid4().hex
BASIC_USER, BASIC_PASSWORD = "basicuser", "basic-" + uuid.uuid4().hex


# --------------------------------------------------------------------------
# fixtures: registries, fronts, the server
# --------------------------------------------------------------------------

def _need(ok: bool, what: str) -> None:
    if ok:
        return
    msg = f"{what} (scripts/install-deps installs it)"
    if W.allow_skip():
        pytest.skip(msg)
    pytest.fail(msg, pytrace=False)


@pytest.fixture(scope="module")
def native_once(runtime, work_root):
    """Runs this module once, on the first runtime whose images come from Warren's image store
    (/health's imageSource "store": registry pulls go there; they are the same code for every OCI
    runtime)."""
    W.skip_unless_first(runtime, work_root, "registry pulls into Warren's image store, the same code for "
                                            "every OCI runtime", imageSource="store")
    for tool in ("docker-registry", "htpasswd", "openssl", "zstd", "tar"):
        _need(shutil.which(tool) is not None, f"{tool} is needed by the registry tests")
    _need(R.busybox_path() is not None, "static busybox is needed by the registry tests")
    return runtime


@pytest.fixture(scope="module")
def builder(native_once, work_root):
    return R.ImageBuilder(work_root / "oci-build")


@pytest.fixture(scope="module")
def regs(native_once, work_root):
    """Three docker-registry processes and three fronts, all on loopback; stopped by PID at the end."""
    base = work_root / f"registries-{uuid.uuid4().hex[:6]}"
    started: list = []
    try:
        plain = R.Registry(base / "plain").start()
        started.append(plain)
        crash_reg = R.Registry(base / "crash").start()
        started.append(crash_reg)
        tls = R.Registry(base / "tls", auth=(BASIC_USER, BASIC_PASSWORD), tls=True).start()
        started.append(tls)
        front = R.RegistryFront(plain.url).start()
        started.append(front)
        tok = R.RegistryFront(plain.url, token_auth=(TOKEN_USER, TOKEN_PASSWORD)).start()
        started.append(tok)
        crash = R.RegistryFront(crash_reg.url).start()
        started.append(crash)
        yield SimpleNamespace(plain=plain, crash_reg=crash_reg, tls=tls, front=front, tok=tok, crash=crash)
    finally:
        for p in reversed(started):
            try:
                p.stop()
            except Exception:  # noqa: BLE001
                if isinstance(p, R.Registry):
                    p.stop(kill=True)


def _registries(regs, **overrides) -> dict:
    entries = {
        # upstream = false: a miss on the mirror never goes to the real Docker Hub
        "docker.io": {"mirrors": [regs.front.host], "upstream": False},
        regs.front.host: {"insecure": True},
        regs.tok.host: {"insecure": True},
        regs.crash.host: {"insecure": True},
        regs.tls.host: {"ca_file": str(regs.tls.ca_path)},
    }
    for host, keys in overrides.items():
        if keys is None:
            entries.pop(host, None)
        else:
            entries[host] = keys
    return entries


@pytest.fixture(scope="module")
def srv(native_once, regs, work_root):
    """A server of its own with the [registries] above (the shared one has none)."""
    # (native_once chose a runtime whose images come from Warren's image store, where pulls go)
    server = W.WarrenServer(native_once, work_root, f"{native_once}-registry-{uuid.uuid4().hex[:6]}")
    try:
        server.check_binary()
    except W.BinaryMissing as exc:
        pytest.fail(str(exc), pytrace=False)
    server.native_pull = True      # [images] pull = "missing" (the suite's servers never pull otherwise)
    server.extra_config = NETWORK + "\n" + R.registries_toml(_registries(regs))
    server.start()
    yield server
    try:
        server.delete_all_sandboxes()
    finally:
        server.stop()


@pytest.fixture(scope="module")
def bb_base(builder):
    """The shared busybox base layer (gzip): small, runnable, in most images here."""
    return builder.layer(R.busybox_spec("shared"), "gzip")


@pytest.fixture(scope="module")
def deb_base(builder):
    """The debootstrap rootfs as one gzip layer (built once; ~70 MB compressed)."""
    rootfs = W.test_rootfs()
    if not (rootfs / "usr/bin/python3").exists():
        msg = f"test image rootfs not found at {rootfs} (scripts/build-test-image {rootfs})"
        if W.allow_skip():
            pytest.skip(msg)
        pytest.fail(msg, pytrace=False)
    return builder.layer_from_dir(rootfs, "gzip")


# --------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------

def uid() -> str:
    return uuid.uuid4().hex[:8]


def cfg_file(server: W.WarrenServer, regs, name: str, **overrides) -> Path:
    """A copy of the server's config with other [registries] (for `image pull --config`)."""
    text = server.config_path.read_text().replace(server.extra_config, "")
    path = server.root / f"config-{server.name}-{name}.toml"
    path.write_text(text + NETWORK + "\n" + R.registries_toml(_registries(regs, **overrides)))
    return path


def cli(server: W.WarrenServer, *args: str, input: str | None = None, timeout: float = 900) -> subprocess.CompletedProcess:
    server.check_binary()
    cmd = [str(server.bin), *args, "--data-dir", str(server.data_dir)]
    return subprocess.run(cmd, env=server.env(), capture_output=True, text=True, timeout=timeout, input=input)


def pull(server: W.WarrenServer, name: str, *extra: str, config: Path | None = None, input: str | None = None,
         check: bool = True) -> subprocess.CompletedProcess:
    res = cli(server, "image", "pull", name, "--config", str(config or server.config_path), "-o", "json", *extra,
              input=input)
    if check:
        assert res.returncode == 0, (f"`warren image pull {name}` failed ({res.returncode})\n"
                                     f"stdout:\n{res.stdout[-3000:]}\nstderr:\n{res.stderr[-3000:]}")
    return res


def pulled(res: subprocess.CompletedProcess) -> dict:
    try:
        obj = json.loads(res.stdout)
    except ValueError as exc:
        raise AssertionError(f"`image pull -o json` did not print one JSON object:\n{res.stdout[-2000:]}") from exc
    assert isinstance(obj, dict), obj
    for key in ("name", "id", "digest", "layers", "size_bytes", "created_at", "builtin"):
        assert key in obj, f"`image pull -o json` lacks {key!r}: {obj}"
    return obj


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def assert_clear_text(text: str, where: str) -> None:
    """An error meant for people: no control characters (raw bytes of a broken layer, say)."""
    bad = sorted({repr(ch) for ch in text if unicodedata.category(ch) == "Cc"})
    assert not bad, f"{where} carries control characters {bad}: {text[:600]!r}"
_LOG_LINE = re.compile(r"^\s*\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\S*\s+(TRACE|DEBUG|INFO|WARN|ERROR)\s")


def cli_failure(res: subprocess.CompletedProcess, name: str, *words: str) -> str:
    """A failed CLI call: exit code != 0 and exactly one (non-log) line on stderr naming `name` and `words`."""
    assert res.returncode != 0, f"expected a failure, got exit 0:\n{res.stdout[-2000:]}"
    lines = [_ANSI.sub("", l) for l in res.stderr.splitlines() if l.strip()]
    lines = [l for l in lines if not _LOG_LINE.match(l)]
    assert len(lines) == 1, f"expected one error line on stderr, got {len(lines)}:\n{res.stderr[-3000:]}"
    line = lines[0]
    assert_clear_text(line, "the CLI's error line")
    assert name in line, f"the error line does not name {name}: {line!r}"
    for w in words:
        assert w.lower() in line.lower(), f"the error line does not mention {w!r}: {line!r}"
    return line


def ls(server: W.WarrenServer) -> list[dict]:
    res = server.cli("image", "ls", "-o", "json")
    rows = json.loads(res.stdout)
    assert isinstance(rows, list), rows
    return rows


def ls_names(server: W.WarrenServer) -> set[str]:
    return {r["name"] for r in ls(server)}


def ls_entry(server: W.WarrenServer, *names: str) -> dict | None:
    for row in ls(server):
        if row["name"] in names:
            return row
    return None


def layer_count(value) -> int:
    return len(value) if isinstance(value, list) else int(value)


def layers_dir(server: W.WarrenServer) -> Path:
    return server.data_dir / "images" / "layers"


def layer_dir(server: W.WarrenServer, diff_id: str) -> Path:
    return layers_dir(server) / R.hex_of(diff_id)


def layer_entries(server: W.WarrenServer) -> set[str]:
    d = layers_dir(server)
    return set(os.listdir(d)) if d.is_dir() else set()


def tmp_entries(server: W.WarrenServer) -> list[str]:
    d = server.data_dir / "images" / "tmp"
    return sorted(os.listdir(d)) if d.is_dir() else []


def assert_nothing_cached(server: W.WarrenServer, before: set[str], *names: str) -> None:
    """After a failed pull: no new layer dir, nothing in images/tmp, the name not listed."""
    try:
        W.wait_until(lambda: not tmp_entries(server), 15, message="images/tmp to be empty")
    except AssertionError:
        raise AssertionError(f"a failed pull left staging behind in images/tmp: {tmp_entries(server)}") from None
    new = layer_entries(server) - before
    assert not new, f"a failed pull left layers in the store: {sorted(new)}"
    listed = ls_names(server)
    for n in names:
        assert n not in listed, f"{n} is listed after a failed pull"


def create(server: W.WarrenServer, uri: str, *, auth: tuple[str, str] | None = None,
           entrypoint: list[str] | None = BB_ENTRY, timeout: float = 600, **overrides) -> httpx.Response:
    """Raw POST /v1/sandboxes (a pull on create can take long: no SDK timeout in the way)."""
    body = W.create_body(uri, **overrides)
    if entrypoint is None:
        body.pop("entrypoint", None)
    else:
        body["entrypoint"] = entrypoint
    if auth is not None:
        body["image"]["auth"] = {"username": auth[0], "password": auth[1]}
    with server.client(timeout=timeout) as c:
        r = c.post("/v1/sandboxes", json=body)
    if r.status_code == 202:
        W.track_sandbox(r.json().get("id"))
    return r


def created(r: httpx.Response) -> str:
    assert r.status_code == 202, f"create failed: {r.status_code} {r.text[:1000]}"
    return r.json()["id"]


def api_error(r: httpx.Response, status: int, code: str, name: str, *words: str) -> str:
    body = W.assert_error_body(r, codes=[status], code=code)
    msg = body["message"]
    assert_clear_text(msg, "the error message")
    assert name in msg, f"the message does not name {name}: {msg!r}"
    for w in words:
        assert w.lower() in msg.lower(), f"the message does not mention {w!r}: {msg!r}"
    return msg


def wait_running(server: W.WarrenServer, sid: str, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    state = None
    with server.client() as c:
        while time.monotonic() < deadline:
            r = c.get(f"/v1/sandboxes/{sid}")
            if r.status_code == 200:
                st = r.json()["status"]
                state = st["state"]
                if state == "Running":
                    return
                if state in ("Failed", "Terminated"):
                    raise AssertionError(f"sandbox {sid} is {state}: {st}\n{server.log_tail(30)}")
            time.sleep(0.2)
    raise AssertionError(f"sandbox {sid} not Running after {timeout}s (last state {state})")


def connect(server: W.WarrenServer, sid: str):
    from opensandbox import SandboxSync
    wait_running(server, sid)
    return SandboxSync.connect(sid, connection_config=server.sdk_config())


def delete(server: W.WarrenServer, sid: str, timeout: float = 60) -> None:
    with server.client() as c:
        c.delete(f"/v1/sandboxes/{sid}")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            r = c.get(f"/v1/sandboxes/{sid}")
            if r.status_code == 404 or (r.status_code == 200 and r.json()["status"]["state"] in ("Terminated", "Failed")):
                return
            time.sleep(0.1)
    raise AssertionError(f"sandbox {sid} still there {timeout}s after DELETE")


def run(sbx, command: str) -> str:
    code, out, err = W.sh(sbx, command)
    assert code == 0, f"`{command}` exited {code}: {err or out}"
    return out


def bb_image(builder, bb_base, files: dict, **kw) -> R.Image:
    """busybox base + one small gzip layer of `files`."""
    return builder.image([bb_base, builder.layer(files, kw.pop("compression", "gzip"))], **kw)


def unique_bb_image(builder, files: dict | None = None, **kw) -> R.Image:
    """An image none of whose layers is shared with any other image (a busybox base with a marker)."""
    tag = uid()
    base = builder.layer(R.busybox_spec(tag), "gzip")
    return builder.image([base, builder.layer(files or {"etc/e2e-unique": tag + "\n"}, "gzip")], **kw)


# --------------------------------------------------------------------------
# 0. the images these tests build are valid (checked with skopeo + umoci, without Warren)
# --------------------------------------------------------------------------

@pytest.mark.timeout(300)
def test_builder_images_unpack_with_umoci(native_once, regs, builder, bb_base, work_root):
    """Not Warren: makes sure a failure below is Warren's and not the image builder's."""
    if not (shutil.which("skopeo") and shutil.which("umoci")):
        pytest.skip("skopeo/umoci not installed (scripts/install-deps)")
    lower = builder.layer({"opt/dir/old": "old", "etc/e2e-gone": "x"}, "none")
    upper = builder.layer({"etc/e2e-base": ("whiteout",), "opt/dir": ("opaque",), "opt/dir/new": "new",
                           "opt/a": "hard", "opt/b": ("hardlink", "opt/a"), "etc/e2e-gone": ("whiteout",)}, "zstd")
    img = builder.image([bb_base, lower, upper])
    amd = bb_image(builder, bb_base, {"etc/e2e-arch": "amd64\n"})
    arm = bb_image(builder, bb_base, {"etc/e2e-arch": "arm64\n"}, arch="arm64", variant="v8")
    repo = f"e2e/selfcheck-{uid()}"
    R.registry_push(regs.plain, repo, "1", img)
    R.registry_push(regs.plain, repo, "idx", builder.index([arm, amd]))
    R.registry_push(regs.plain, repo, "list", builder.index(
        [bb_image(builder, bb_base, {"etc/e2e-arch": "arm64\n"}, arch="arm64", fmt="docker"),
         bb_image(builder, bb_base, {"etc/e2e-arch": "amd64\n"}, fmt="docker")], fmt="docker"))
    out = work_root / f"umoci-{uid()}"
    out.mkdir()
    for tag in ("1", "idx", "list"):
        r = subprocess.run(["skopeo", "copy", "--src-tls-verify=false", "--override-os", "linux",
                            "--override-arch", "amd64", "--dest-compress", "--dest-compress-format", "gzip",
                            f"docker://{regs.plain.host}/{repo}:{tag}", f"oci:{out}/layout:{tag}"],
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        r = subprocess.run(["umoci", "raw", "unpack", "--image", f"{out}/layout:{tag}", str(out / tag)],
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
    root = out / "1"
    assert (root / "bin/busybox").is_file() and not (root / "etc/e2e-base").exists()
    assert not (root / "opt/dir/old").exists() and (root / "opt/dir/new").read_text() == "new"
    assert not (root / "etc/e2e-gone").exists()
    assert os.stat(root / "opt/a").st_ino == os.stat(root / "opt/b").st_ino
    assert (out / "idx/etc/e2e-arch").read_text() == "amd64\n"
    assert (out / "list/etc/e2e-arch").read_text() == "amd64\n"
    shutil.rmtree(out, ignore_errors=True)


# --------------------------------------------------------------------------
# 1. a multi-layer image through `warren image pull`, then a sandbox from it (official SDK)
# --------------------------------------------------------------------------

@pytest.mark.timeout(900)
def test_multilayer_pull_via_cli(srv, regs, builder, deb_base):
    from opensandbox import SandboxSync

    tag = uid()
    l2 = builder.layer({
        "etc/issue.net": ("whiteout",),               # a base file deleted
        "etc/apt": ("opaque",),                        # a base dir's contents replaced
        "etc/apt/e2e-only": "the only entry\n",
        "opt/e2e/original": "linked\n",
        "opt/e2e/hardlink": ("hardlink", "opt/e2e/original"),
        "opt/e2e/over": "v1\n",
        "opt/e2e/gone-later": "x\n",
    }, "zstd")
    l3 = builder.layer({
        "opt/e2e/over": "v2\n",                        # a later layer wins
        "opt/e2e/gone-later": ("whiteout",),           # and deletes what the one below added
        "opt/e2e/link": ("symlink", "over"),
        "usr/local/bin/e2e-tool": ("file", "#!/bin/sh\necho tool-ran\n", 0o755),
        "opt/e2e/tag": tag + "\n",
    }, "none")
    img = builder.image([deb_base, l2, l3], env=[f"PATH={R.DEFAULT_PATH}", "E2E_IMAGE_ENV=yes"],
                        working_dir="/opt/e2e")
    name = f"{regs.front.host}/e2e/multi:{tag}"
    assert R.registry_push(regs.plain, "e2e/multi", tag, img) == img.manifest_digest

    obj = pulled(pull(srv, name))
    assert obj["name"] == name, obj
    assert obj["digest"] == img.manifest_digest, obj
    assert obj["id"] == img.config_digest, f"id should be the config digest {img.config_digest}: {obj}"
    assert layer_count(obj["layers"]) == 3 and obj["builtin"] is False and obj["size_bytes"] > 100 << 20, obj
    if isinstance(obj["layers"], list):
        assert obj["layers"] == img.diff_ids, obj
    row = ls_entry(srv, name)
    assert row is not None, f"{name} not in `image ls -o json`: {ls(srv)}"
    assert row["digest"] == img.manifest_digest and row["id"] == img.config_digest, row
    for diff_id in img.diff_ids:
        assert layer_dir(srv, diff_id).is_dir(), f"layer {diff_id} not stored under images/layers"
    # the hardlink is one file in the stored layer
    stored = layer_dir(srv, l2.diff_id) / "opt/e2e"
    assert os.stat(stored / "original").st_ino == os.stat(stored / "hardlink").st_ino

    sbx = SandboxSync.create(name, connection_config=srv.sdk_config(), timeout=timedelta(minutes=10),
                             ready_timeout=timedelta(seconds=120))
    W.track_sandbox(sbx.id)
    try:
        assert run(sbx, "cat /etc/debian_version").strip(), "the base layer's content is there"
        assert run(sbx, "test ! -e /etc/issue.net && test -e /etc/issue && echo ok") == "ok\n", "whiteout"
        assert run(sbx, "ls -A /etc/apt").split() == ["e2e-only"], "opaque dir keeps only the upper content"
        assert run(sbx, "cat /opt/e2e/original /opt/e2e/hardlink") == "linked\nlinked\n"
        if not srv.gvisor:
            ino = run(sbx, "stat -c '%i %h' /opt/e2e/original /opt/e2e/hardlink").split("\n")
            assert ino[0] == ino[1] and ino[0].endswith(" 2"), f"hardlink: {ino}"
        assert run(sbx, "cat /opt/e2e/over") == "v2\n"
        assert run(sbx, "test ! -e /opt/e2e/gone-later && readlink /opt/e2e/link") == "over\n"
        assert run(sbx, "echo $E2E_IMAGE_ENV") == "yes\n", "image Env is visible in commands"
        assert run(sbx, "pwd") == "/opt/e2e\n", "image WorkingDir is the commands' cwd"
        assert run(sbx, "e2e-tool") == "tool-ran\n", "image PATH is used"
        assert run(sbx, "cat /opt/e2e/tag") == tag + "\n"
    finally:
        sbx.kill()
        sbx.close()


# --------------------------------------------------------------------------
# 2. layers are shared between images
# --------------------------------------------------------------------------

@pytest.mark.timeout(900)
def test_layer_shared_between_images(srv, regs, builder, deb_base):
    first = builder.image([deb_base, builder.layer({"opt/share": "a\n"})])
    second = builder.image([deb_base, builder.layer({"opt/share": "b\n"}, "zstd")])
    R.registry_push(regs.plain, "e2e/share-a", "1", first)
    R.registry_push(regs.plain, "e2e/share-b", "1", second)
    pull(srv, f"{regs.front.host}/e2e/share-a:1")          # may already have the base (test 1)
    base_dir = layer_dir(srv, deb_base.diff_id)
    before = os.stat(base_dir)

    regs.front.reset()
    obj = pulled(pull(srv, f"{regs.front.host}/e2e/share-b:1"))
    assert obj["digest"] == second.manifest_digest
    assert regs.front.blob_gets(deb_base.digest) == 0, \
        f"the base blob was downloaded again: {regs.front.counter()}"
    assert regs.front.blob_gets(second.layers[1].digest) == 1
    after = os.stat(base_dir)
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns), \
        "the base layer dir was unpacked again"
    assert layer_dir(srv, second.layers[1].diff_id).is_dir()

    sid = created(create(srv, f"{regs.front.host}/e2e/share-b:1", entrypoint=None))
    try:
        assert run(connect(srv, sid), "cat /opt/share") == "b\n"
    finally:
        delete(srv, sid)


# --------------------------------------------------------------------------
# 3. multi-arch: an OCI index / Docker manifest list → linux/amd64
# --------------------------------------------------------------------------

@pytest.mark.timeout(300)
@pytest.mark.parametrize("fmt", ["oci", "docker"])
def test_multiarch_index_picks_amd64(srv, regs, builder, bb_base, fmt):
    arm_marker = builder.layer({"etc/e2e-arch": "arm64\n", "etc/e2e-arm-only": uid()})
    arm = builder.image([bb_base, arm_marker], arch="arm64", variant="v8", fmt=fmt)
    amd = bb_image(builder, bb_base, {"etc/e2e-arch": "amd64\n", "etc/e2e-fmt": fmt}, fmt=fmt)
    s390 = bb_image(builder, bb_base, {"etc/e2e-arch": "s390x\n"}, arch="s390x", fmt=fmt)
    idx = builder.index([arm, s390, amd], fmt=fmt)      # amd64 is not the first entry
    repo = f"e2e/multiarch-{fmt}"
    R.registry_push(regs.plain, repo, "1", idx)
    name = f"{regs.front.host}/{repo}:1"

    regs.front.reset()
    sid = created(create(srv, name))
    try:
        sbx = connect(srv, sid)
        assert run(sbx, "cat /etc/e2e-arch /etc/e2e-fmt") == f"amd64\n{fmt}\n"
    finally:
        delete(srv, sid)
    for other in (arm, s390):
        for d in [other.config_digest, other.layers[1].digest]:
            assert regs.front.blob_gets(d) == 0, f"a blob of another platform was fetched: {regs.front.counter()}"
    row = ls_entry(srv, name)
    assert row is not None
    assert row["id"] == amd.config_digest, row
    # which digest an index pull reports is open: the index's (like docker's RepoDigests) or the amd64 manifest's
    assert row["digest"] in (idx.manifest_digest, amd.manifest_digest), row


@pytest.mark.timeout(120)
def test_index_without_amd64_is_refused(srv, regs, builder, bb_base):
    arm = bb_image(builder, bb_base, {"etc/e2e-arch": "arm64\n"}, arch="arm64")
    R.registry_push(regs.plain, "e2e/arm-only", "1", builder.index([arm]))
    name = f"{regs.front.host}/e2e/arm-only:1"
    before = layer_entries(srv)
    r = create(srv, name)
    # not pinned down by the contract: "no image for linux/amd64" reads as not found (404) or invalid (422)
    assert r.status_code in (404, 422), f"{r.status_code} {r.text[:500]}"
    body = W.assert_error_body(r)
    assert body["code"] in ("SANDBOX::IMAGE_NOT_FOUND", "SANDBOX::IMAGE_INVALID"), body
    assert name in body["message"] and "amd64" in body["message"], body
    assert_nothing_cached(srv, before, name)


# --------------------------------------------------------------------------
# 4. Docker Hub names through a mirror
# --------------------------------------------------------------------------

@pytest.mark.timeout(300)
def test_docker_hub_name_through_mirror(srv, regs, builder, bb_base):
    hub = bb_image(builder, bb_base, {"etc/e2e-hub": "from the mirror\n"}, fmt="docker")
    R.registry_push(regs.plain, "library/e2e-hub", "1", hub)
    org = bb_image(builder, bb_base, {"etc/e2e-hub": "org\n"})
    R.registry_push(regs.plain, "e2eorg/hub2", "1", org)

    regs.front.reset()
    sid = created(create(srv, "e2e-hub:1"))
    try:
        assert run(connect(srv, sid), "cat /etc/e2e-hub") == "from the mirror\n"
    finally:
        delete(srv, sid)
    assert regs.front.manifest_requests("library/e2e-hub") >= 1, regs.front.counter()
    spellings = ("e2e-hub:1", "library/e2e-hub:1", "docker.io/library/e2e-hub:1")
    row = ls_entry(srv, *spellings)
    assert row is not None, f"none of {spellings} in `image ls`: {[r['name'] for r in ls(srv)]}"
    assert row["digest"] == hub.manifest_digest

    obj = pulled(pull(srv, "e2eorg/hub2:1"))
    assert obj["digest"] == org.manifest_digest
    assert regs.front.manifest_requests("e2eorg/hub2") >= 1, regs.front.counter()

    # the same image under another spelling of its name
    srv.cli("image", "rm", "docker.io/library/e2e-hub:1")
    assert ls_entry(srv, *spellings) is None, "removed under its long name, it is gone under every spelling"


# --------------------------------------------------------------------------
# 5. basic auth over TLS (ca_file)
# --------------------------------------------------------------------------

@pytest.mark.timeout(300)
def test_basic_auth_over_tls(srv, regs, builder, bb_base):
    tls = regs.tls
    img = bb_image(builder, bb_base, {"etc/e2e-tls": "tls\n"})
    for t in ("api", "cfg", "stdin", "nocreds"):
        R.registry_push(tls, "e2e/tls", t, img if t == "api" else bb_image(builder, bb_base, {"etc/e2e-tls": t}))
    name = f"{tls.host}/e2e/tls:api"

    r = create(srv, name)
    api_error(r, 403, "SANDBOX::IMAGE_PULL_DENIED", name)
    r = create(srv, name, auth=(BASIC_USER, "wrong-password"))
    api_error(r, 403, "SANDBOX::IMAGE_PULL_DENIED", name)
    r = create(srv, name, auth=(BASIC_USER, BASIC_PASSWORD))
    sid = created(r)
    assert BASIC_PASSWORD not in r.text
    try:
        assert run(connect(srv, sid), "cat /etc/e2e-tls") == "tls\n"
        with srv.client() as c:
            assert BASIC_PASSWORD not in c.get(f"/v1/sandboxes/{sid}").text
    finally:
        delete(srv, sid)

    # credentials from the config file
    with_creds = cfg_file(srv, regs, "tls-creds", **{tls.host: {"ca_file": str(tls.ca_path), "username": BASIC_USER,
                                                                 "password": BASIC_PASSWORD}})
    res = pull(srv, f"{tls.host}/e2e/tls:cfg", config=with_creds)
    assert pulled(res)["name"] == f"{tls.host}/e2e/tls:cfg"
    # credentials on stdin
    res = pull(srv, f"{tls.host}/e2e/tls:stdin", "--username", BASIC_USER, "--password-stdin",
               input=BASIC_PASSWORD + "\n")
    assert BASIC_PASSWORD not in res.stdout + res.stderr
    # none: refused, and nothing kept
    before = layer_entries(srv)
    nocreds = f"{tls.host}/e2e/tls:nocreds"
    cli_failure(pull(srv, nocreds, check=False), nocreds)
    # right credentials but the CA not trusted
    no_ca = cfg_file(srv, regs, "tls-no-ca", **{tls.host: {"username": BASIC_USER, "password": BASIC_PASSWORD}})
    cli_failure(pull(srv, nocreds, config=no_ca, check=False), nocreds)
    assert_nothing_cached(srv, before, nocreds)
    assert BASIC_PASSWORD not in srv.log_path.read_text(errors="replace"), "the password is in the server log"


# --------------------------------------------------------------------------
# 6. bearer tokens (Docker's token flow)
# --------------------------------------------------------------------------

@pytest.mark.timeout(300)
def test_token_auth(srv, regs, builder, bb_base):
    img = bb_image(builder, bb_base, {"etc/e2e-token": "token\n"})
    R.registry_push(regs.plain, "e2e/tok", "1", img)
    name = f"{regs.tok.host}/e2e/tok:1"

    regs.tok.reset()
    api_error(create(srv, name), 403, "SANDBOX::IMAGE_PULL_DENIED", name)
    api_error(create(srv, name, auth=(TOKEN_USER, "wrong")), 403, "SANDBOX::IMAGE_PULL_DENIED", name)
    assert not any(t["ok"] for t in regs.tok.token_requests)

    r = create(srv, name, auth=(TOKEN_USER, TOKEN_PASSWORD))
    sid = created(r)
    assert TOKEN_PASSWORD not in r.text
    try:
        assert run(connect(srv, sid), "cat /etc/e2e-token") == "token\n"
    finally:
        delete(srv, sid)
    good = [t for t in regs.tok.token_requests if t["ok"]]
    assert good, f"no token was fetched with the credentials: {regs.tok.token_requests}"
    assert any("repository:e2e/tok:pull" in t["scope"] for t in good), good
    assert all(t["service"] == "e2e" for t in good), good
    bearer = [f"{x.method} {x.path}" for x in regs.tok.log() if x.auth == "bearer" and x.status == 200]
    assert any("/manifests/" in p for p in bearer), regs.tok.counter()
    assert TOKEN_PASSWORD not in srv.log_path.read_text(errors="replace")


# --------------------------------------------------------------------------
# 7. plain HTTP needs `insecure`
# --------------------------------------------------------------------------

@pytest.mark.timeout(120)
def test_an_unconfigured_registry_at_an_internal_address_is_refused(srv, regs, builder, bb_base):
    """SSRF through pull-on-create: a create naming `HOST:PORT/repo:tag` made the server connect to
    any address (loopback, the host's services, private ranges) and its error told an open port
    from a closed one. A registry with no [registries] entry must be public: this one, on loopback,
    is refused before any connection, with the reason; a listener on another loopback port sees
    no connection; nothing is cached."""
    import socket
    R.registry_push(regs.plain, "e2e/plain", "1", bb_image(builder, bb_base, {"etc/e2e-plain": "x"}))
    name = f"{regs.plain.host}/e2e/plain:1"           # this host has no [registries] entry
    before = layer_entries(srv)
    api_error(create(srv, name), 502, "SANDBOX::IMAGE_PULL_FAILED", name, "internal address")
    cli_failure(pull(srv, name, check=False), name, "internal address")
    assert_nothing_cached(srv, before, name)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        listener.setblocking(False)
        port = listener.getsockname()[1]
        for target in (f"127.0.0.1:{port}/probe/x:1", f"localhost:{port}/probe/x:1"):
            api_error(create(srv, target), 502, "SANDBOX::IMAGE_PULL_FAILED", target.split("/")[0])
        try:
            listener.accept()
            raise AssertionError("the server connected to an internal address it was only named")
        except BlockingIOError:
            pass


# --------------------------------------------------------------------------
# 8. a corrupted blob
# --------------------------------------------------------------------------

@pytest.mark.timeout(180)
@pytest.mark.parametrize("which", ["layer", "config"])
def test_corrupted_blob(srv, regs, builder, bb_base, which):
    # an uncompressed layer: the bytes flipped are file data, so only the digest can tell
    layer = builder.layer({"opt/corrupt/data.bin": os.urandom(1 << 20)}, "none")
    img = builder.image([bb_base, layer], env=[f"PATH={R.DEFAULT_PATH}", f"E2E_NONCE={uid()}"])
    repo = f"e2e/corrupt-{which}"
    R.registry_push(regs.plain, repo, "1", img)
    if which == "layer":
        regs.plain.corrupt_blob(layer.digest, offset=layer.size // 2)
    else:
        regs.plain.corrupt_blob(img.config_digest, offset=10, length=4)
    name = f"{regs.front.host}/{repo}:1"
    before = layer_entries(srv)
    api_error(create(srv, name), 502, "SANDBOX::IMAGE_PULL_FAILED", name, "digest")
    assert_nothing_cached(srv, before, name)
    cli_failure(pull(srv, name, check=False), name, "digest")
    assert_nothing_cached(srv, before, name)


# --------------------------------------------------------------------------
# 9. the registry dies mid-pull, comes back
# --------------------------------------------------------------------------

@pytest.mark.timeout(600)
def test_registry_killed_mid_pull(srv, regs, builder, bb_base):
    big = builder.random_layer(64 << 20, "e2e-big.bin", "none")
    img = builder.image([bb_base, big])
    R.registry_push(regs.crash_reg, "e2e/big", "1", img)
    name = f"{regs.crash.host}/e2e/big:1"
    before = layer_entries(srv)

    regs.crash.reset()
    regs.crash.stall(big.digest, 8 << 20)
    result: dict = {}

    def do_create():
        try:
            result["r"] = create(srv, name, timeout=400)
        except Exception as exc:  # noqa: BLE001
            result["exc"] = exc

    t = threading.Thread(target=do_create, daemon=True)
    t.start()
    try:
        regs.crash.wait_stalled(240)
        regs.crash_reg.stop(kill=True)               # the registry crashes with the blob half sent
    finally:
        regs.crash.release()
    t.join(420)
    assert not t.is_alive(), "the create did not return after the registry died"
    assert "exc" not in result, result.get("exc")
    r = result["r"]
    api_error(r, 502, "SANDBOX::IMAGE_PULL_FAILED", name)
    assert_nothing_cached(srv, before, name)
    assert not layer_dir(srv, big.diff_id).exists()

    regs.crash_reg.start()                            # same port, same storage
    sid = created(create(srv, name))
    try:
        assert run(connect(srv, sid), "stat -c %s /e2e-big.bin") == f"{64 << 20}\n"
    finally:
        delete(srv, sid)
    assert layer_dir(srv, big.diff_id).is_dir()


# --------------------------------------------------------------------------
# 10. layers that try to escape, and content Warren does not take
# --------------------------------------------------------------------------

TOKEN = uid()
ESCAPES = {
    "dotdot": [R.Member("file", f"../e2e-escape-{TOKEN}", b"x")],
    "absolute-dotdot": [R.Member("file", f"/abs/../../e2e-abs-{TOKEN}", b"x")],
    "deep-dotdot": [R.Member("dir", "a"), R.Member("file", f"a/../../../../../../../tmp/e2e-deep-{TOKEN}", b"x")],
    "symlink-then-write": [R.Member("symlink", "evil", target="/etc"),
                           R.Member("file", f"evil/e2e-pwned-{TOKEN}", b"x")],
    "relative-symlink-then-write": [R.Member("symlink", "up", target="../../../../../../.."),
                                    R.Member("file", f"up/tmp/e2e-up-{TOKEN}", b"x")],
    "hardlink-outside": [R.Member("hardlink", "passwd-link", target="../../etc/passwd")],
    "whiteout-dotdot": [R.Member("file", "../.wh.etc", b"")],
}


def _assert_refused(srv, regs, img, repo: str) -> None:
    """Pushes `img` as `repo:1`; a create and a CLI pull of it are both refused as invalid (422),
    and neither leaves anything in the store."""
    R.registry_push(regs.plain, repo, "1", img)
    name = f"{regs.front.host}/{repo}:1"
    before = layer_entries(srv)
    api_error(create(srv, name), 422, "SANDBOX::IMAGE_INVALID", name)
    assert_nothing_cached(srv, before, name)
    cli_failure(pull(srv, name, check=False), name)
    assert_nothing_cached(srv, before, name)


def _escaped_files(server: W.WarrenServer) -> list[str]:
    """Files named after this run's TOKEN where an escaping entry would land: /, /etc, /tmp, the work
    folder, the data dir, and anywhere in the image store."""
    hits = []
    for where in ("/", "/etc", "/tmp", str(server.root), str(server.data_dir)):
        hits += [os.path.join(where, n) for n in os.listdir(where) if TOKEN in n]
    for dirpath, dirnames, filenames in os.walk(server.data_dir / "images"):
        hits += [os.path.join(dirpath, n) for n in filenames + dirnames if TOKEN in n]
    return hits


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", sorted(ESCAPES))
def test_escaping_layer_refused(srv, regs, builder, bb_base, case):
    passwd = hashlib.sha256(Path("/etc/passwd").read_bytes()).hexdigest()
    evil = builder.layer_from_members(ESCAPES[case])
    img = builder.image([bb_base, builder.layer({"etc/e2e-case": case}), evil])
    _assert_refused(srv, regs, img, f"e2e/evil-{case}")
    assert not _escaped_files(srv), f"written outside the layer: {_escaped_files(srv)}"
    assert hashlib.sha256(Path("/etc/passwd").read_bytes()).hexdigest() == passwd


@pytest.mark.timeout(180)
def test_device_node_in_layer(srv, regs, builder, bb_base):
    """A device node in a layer: refused (422), or skipped (the runtime provides /dev); never created."""
    evil = builder.layer_from_members([R.Member("chardev", "e2e-mem", major=1, minor=1),
                                       R.Member("blockdev", "e2e-disk", major=8, minor=0),
                                       R.Member("file", "etc/e2e-dev-marker", b"dev\n")])
    img = builder.image([bb_base, evil])
    R.registry_push(regs.plain, "e2e/devnode", "1", img)
    name = f"{regs.front.host}/e2e/devnode:1"
    r = create(srv, name)
    if r.status_code == 422:
        api_error(r, 422, "SANDBOX::IMAGE_INVALID", name)
        return
    sid = created(r)
    try:
        sbx = connect(srv, sid)
        assert run(sbx, "cat /etc/e2e-dev-marker") == "dev\n"
        assert run(sbx, "test -c /e2e-mem || test -b /e2e-disk && echo device || echo none") == "none\n"
    finally:
        delete(srv, sid)
    stored = layer_dir(srv, evil.diff_id)
    for n in ("e2e-mem", "e2e-disk"):
        p = stored / n
        assert not (p.exists() and (p.is_char_device() or p.is_block_device())), f"device node {p} in the store"


def _not_a_tar(builder, bb_base):
    return builder.image([bb_base, builder.layer_from_tar_bytes(os.urandom(4096) + b"\0" * 1024, "none")])


def _gzip_lie(builder, bb_base):
    raw = builder.layer_from_tar_bytes(os.urandom(8192), "none")      # declared gzip, is not
    return builder.image([bb_base, R.Layer(raw.path, raw.digest, raw.size, raw.diff_id, "gzip")])


def _bzip2(builder, bb_base):
    layer = builder.layer({"etc/e2e": "x"}, "none").with_media_type("application/vnd.oci.image.layer.v1.tar+bzip2")
    return builder.image([bb_base, layer])


UNSUPPORTED = {
    "layer-not-a-tar": _not_a_tar,
    "gzip-media-type-not-gzip": _gzip_lie,
    "bzip2-media-type": _bzip2,
}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", sorted(UNSUPPORTED))
def test_unsupported_content_refused(srv, regs, builder, bb_base, case):
    _assert_refused(srv, regs, UNSUPPORTED[case](builder, bb_base), f"e2e/unsupported-{case}")


@pytest.mark.timeout(180)
def test_diff_id_mismatch_refused(srv, regs, builder, bb_base):
    """The config's rootfs.diff_ids do not match the layers: the blobs are what the manifest promised,
    so the image itself is inconsistent (422, not a transfer error), and nothing is kept."""
    layer = builder.layer({"etc/e2e": uid()})
    img = builder.image([bb_base, layer], diff_ids=[bb_base.diff_id, "sha256:" + "0" * 64])
    R.registry_push(regs.plain, "e2e/diffid", "1", img)
    name = f"{regs.front.host}/e2e/diffid:1"
    before = layer_entries(srv)
    r = create(srv, name)
    assert r.status_code == 422, f"{r.status_code} {r.text[:500]}"
    body = W.assert_error_body(r)
    assert body["code"] == "SANDBOX::IMAGE_INVALID" and name in body["message"]
    assert "diff_id" in body["message"], body["message"]
    assert_clear_text(body["message"], "the error message")
    assert_nothing_cached(srv, before, name)
    cli_failure(pull(srv, name, check=False), name)
    assert_nothing_cached(srv, before, name)


# --------------------------------------------------------------------------
# image config: Entrypoint + Cmd when the create gives no entrypoint
# --------------------------------------------------------------------------

@pytest.mark.timeout(180)
def test_image_entrypoint_and_cmd(srv, regs, builder, bb_base):
    img = bb_image(builder, bb_base, {"etc/e2e-cmd": "x"}, entrypoint=["/bin/sh", "-c"],
                   cmd=["echo \"$0 $E2E_CMD_ENV\" > /tmp/e2e-cmd-ran; exec /bin/sleep 100000", "from-cmd"],
                   env=[f"PATH={R.DEFAULT_PATH}", "E2E_CMD_ENV=env-ok"], working_dir="/tmp")
    R.registry_push(regs.plain, "e2e/cmd", "1", img)
    sid = created(create(srv, f"{regs.front.host}/e2e/cmd:1", entrypoint=None))
    try:
        sbx = connect(srv, sid)
        W.wait_until(lambda: W.sh(sbx, "cat /tmp/e2e-cmd-ran")[0] == 0, 20, message="the image's command to run")
        assert run(sbx, "cat /tmp/e2e-cmd-ran") == "from-cmd env-ok\n", "Entrypoint + Cmd, with the image Env"
    finally:
        delete(srv, sid)


@pytest.mark.timeout(300)
def test_image_with_more_layers_than_a_page_of_mount_options(srv, regs, builder, bb_base):
    """61 layers: their store paths make overlay options of ~8 KB, more than the one page
    mount(2) reads (the create failed with a 500 "mount overlay" past ~40 layers, which a chain of
    snapshots of snapshots also reaches); every layer is there, in order."""
    tag = uid()
    layers = [builder.layer({f"opt/many/{i:02d}": f"{i}\n", "opt/many/top": f"{i}\n"}, "none")
              for i in range(60)]
    img = builder.image([bb_base, *layers], env=[f"PATH={R.DEFAULT_PATH}"])
    R.registry_push(regs.plain, "e2e/many", tag, img)
    sid = created(create(srv, f"{regs.front.host}/e2e/many:{tag}"))
    try:
        sbx = connect(srv, sid)
        assert run(sbx, "cat /opt/many/top") == "59\n", "the topmost layer wins"
        assert run(sbx, "ls /opt/many | wc -l").strip() == "61", "every layer is mounted"
        assert run(sbx, "cat /opt/many/00 /opt/many/59") == "0\n59\n"
        assert run(sbx, "echo written > /opt/many/new && cat /opt/many/new") == "written\n"
    finally:
        delete(srv, sid)


# --------------------------------------------------------------------------
# pinned by digest
# --------------------------------------------------------------------------

@pytest.mark.timeout(180)
def test_pull_by_digest(srv, regs, builder, bb_base):
    img = bb_image(builder, bb_base, {"etc/e2e-pinned": "pinned\n"})
    digest = R.registry_push(regs.plain, "e2e/pinned", "moving", img)
    R.registry_push(regs.plain, "e2e/pinned", "moving", bb_image(builder, bb_base, {"etc/e2e-pinned": "moved\n"}))
    name = f"{regs.front.host}/e2e/pinned@{digest}"
    sid = created(create(srv, name))
    try:
        assert run(connect(srv, sid), "cat /etc/e2e-pinned") == "pinned\n"
    finally:
        delete(srv, sid)


# --------------------------------------------------------------------------
# 11. ten creates at once pull once
# --------------------------------------------------------------------------

@pytest.mark.timeout(600)
def test_concurrent_creates_pull_once(srv, regs, builder):
    img = unique_bb_image(builder)
    R.registry_push(regs.plain, "e2e/conc", "1", img)
    name = f"{regs.front.host}/e2e/conc:1"
    regs.front.reset()
    barrier = threading.Barrier(10)

    def one(_):
        barrier.wait(30)
        return create(srv, name, timeout=400)

    with ThreadPoolExecutor(10) as ex:
        responses = list(ex.map(one, range(10)))
    ids = [r.json()["id"] for r in responses if r.status_code == 202]
    try:
        bad = [f"{r.status_code} {r.text[:300]}" for r in responses if r.status_code != 202]
        assert not bad, f"{len(bad)} of 10 creates failed: {bad}"
        for d in img.blob_digests:
            assert regs.front.blob_gets(d) == 1, \
                f"blob {d} fetched {regs.front.blob_gets(d)} times: {regs.front.counter()}"
        manifests = regs.front.manifest_requests("e2e/conc")
        assert 1 <= manifests <= 4, f"the manifest was fetched {manifests} times: {regs.front.counter()}"
        for sid in ids:
            wait_running(srv, sid)
        assert run(connect(srv, ids[-1]), "cat /etc/e2e-unique").strip()
    finally:
        for sid in ids:
            delete(srv, sid)


# --------------------------------------------------------------------------
# 13. unknown tag / repository
# --------------------------------------------------------------------------

@pytest.mark.timeout(120)
def test_unknown_tag_and_repository(srv, regs, builder, bb_base):
    R.registry_push(regs.plain, "e2e/known", "1", bb_image(builder, bb_base, {"etc/e2e": "known"}))
    before = layer_entries(srv)
    for name in (f"{regs.front.host}/e2e/known:no-such-tag", f"{regs.front.host}/e2e/never-pushed-{uid()}:1"):
        api_error(create(srv, name), 404, "SANDBOX::IMAGE_NOT_FOUND", name)
        cli_failure(pull(srv, name, check=False), name)
    assert_nothing_cached(srv, before)


# --------------------------------------------------------------------------
# 12. garbage collection: rm and prune with images in use (last: prune empties the store)
# --------------------------------------------------------------------------

@pytest.mark.timeout(400)
def test_gc_rm_and_prune(srv, regs, builder):
    g = unique_bb_image(builder, {"etc/e2e-gc": "gc\n"})
    R.registry_push(regs.plain, "e2e/gc", "1", g)
    name = f"{regs.front.host}/e2e/gc:1"
    pull(srv, name)
    dirs = [layer_dir(srv, d) for d in g.diff_ids]
    assert all(d.is_dir() for d in dirs)

    sid = created(create(srv, name))
    try:
        sbx = connect(srv, sid)
        srv.cli("image", "rm", name)
        assert name not in ls_names(srv)
        assert all(d.is_dir() for d in dirs), "layers a sandbox uses must stay after `image rm`"
        assert run(sbx, "cat /etc/e2e-gc && echo still-works") == "gc\nstill-works\n"
    finally:
        delete(srv, sid)
    W.wait_until(lambda: not any(d.exists() for d in dirs), 30,
                 message="the removed image's layers to go once its last sandbox is gone")

    used = unique_bb_image(builder, {"etc/e2e-prune": "used\n"})
    unused = unique_bb_image(builder, {"etc/e2e-prune": "unused\n"})
    # shares the in-use image's base layer: pruned all the same, the shared base stays
    sibling = builder.image([used.layers[0], builder.layer({"etc/e2e-prune": "sibling\n"}, "gzip")])
    R.registry_push(regs.plain, "e2e/prune-used", "1", used)
    R.registry_push(regs.plain, "e2e/prune-unused", "1", unused)
    R.registry_push(regs.plain, "e2e/prune-sibling", "1", sibling)
    used_name, unused_name = f"{regs.front.host}/e2e/prune-used:1", f"{regs.front.host}/e2e/prune-unused:1"
    sibling_name = f"{regs.front.host}/e2e/prune-sibling:1"
    pull(srv, used_name)
    pull(srv, unused_name)
    pull(srv, sibling_name)
    sid = created(create(srv, used_name))
    try:
        sbx = connect(srv, sid)
        dry = json.loads(srv.cli("image", "prune", "--dry-run", "-o", "json").stdout)
        assert unused_name in dry["removed"] and used_name not in dry["removed"] and "host" not in dry["removed"], dry
        assert unused_name in ls_names(srv), "--dry-run removes nothing"
        assert sibling_name in dry["removed"], dry
        res = json.loads(srv.cli("image", "prune", "-o", "json").stdout)
        assert unused_name in res["removed"] and used_name not in res["removed"], res
        assert sibling_name in res["removed"], res
        assert not layer_dir(srv, sibling.diff_ids[1]).exists(), "the sibling's own layer goes"
        assert res["reclaimed_bytes"] > 0, res
        names = ls_names(srv)
        assert used_name in names and unused_name not in names and "host" in names, names
        assert all(layer_dir(srv, d).is_dir() for d in used.diff_ids)
        assert not any(layer_dir(srv, d).exists() for d in unused.diff_ids), "pruned layers must be gone"
        assert run(sbx, "cat /etc/e2e-prune") == "used\n"
    finally:
        delete(srv, sid)
