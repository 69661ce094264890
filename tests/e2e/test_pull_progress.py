"""`warren image pull` on a terminal draws a progress bar per layer it fetches, and stays
quiet when its output is not a terminal. The pull comes from Debian's docker-registry on loopback;
the terminal is a real pseudo-terminal (Python's `pty`)."""

from __future__ import annotations

import os
import pty
import re
import select
import subprocess
import time

import pytest

import registry as R
import warren_e2e as W


def _run_on_pty(cmd: list[str], timeout: float = 120) -> tuple[int, str]:
    """Runs `cmd` with stdin/stdout/stderr on a new pseudo-terminal; returns (exit code, output)."""
    primary, secondary = pty.openpty()
    proc = subprocess.Popen(cmd, stdin=secondary, stdout=secondary, stderr=secondary, close_fds=True,
                            start_new_session=True)
    os.close(secondary)
    out = bytearray()
    deadline = time.time() + timeout
    try:
        while time.time() < deadline:
            ready, _, _ = select.select([primary], [], [], 0.2)
            if ready:
                try:
                    chunk = os.read(primary, 65536)
                except OSError:  # EIO: the other side closed
                    break
                if not chunk:
                    break
                out += chunk
            elif proc.poll() is not None:
                break
        code = proc.wait(timeout=max(1.0, deadline - time.time()))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(primary)
    return code, out.decode(errors="replace")


@pytest.fixture(scope="module")
def pushed(tmp_path_factory):
    if not W.warren_bin().is_file():
        pytest.fail(f"warren binary missing: {W.warren_bin()}")
    root = tmp_path_factory.mktemp("pull-progress")
    try:
        reg = R.Registry(root / "registry").start()
    except RuntimeError as e:
        if W.allow_skip():
            pytest.skip(str(e))
        raise
    build = R.ImageBuilder(root / "build")
    big = build.random_layer(8 << 20, compression="gzip")
    small = build.layer({"etc/progress": b"1\n"}, compression="zstd")
    image = build.image([big, small])
    R.registry_push(reg, "e2e/progress", "v1", image)
    yield reg, image, root
    reg.stop()


def test_pull_draws_a_bar_per_layer_on_a_terminal(pushed):
    reg, image, root = pushed
    ref = f"{reg.host}/e2e/progress:v1"
    data = root / "data-tty"
    code, out = _run_on_pty([str(W.warren_bin()), "image", "pull", "--insecure-registry", reg.host, ref,
                             "--data-dir", str(data)])
    assert code == 0, out
    assert f"pulling {ref}: 2 layers, 2 to fetch" in out, out
    plain = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out)
    for layer in image.layers:
        short = layer.digest.removeprefix("sha256:")[:12]
        assert short in plain, f"no bar for layer {short}:\n{plain}"
    assert re.search(r"\[[=> ]{30}\]", plain), f"no bar drawn:\n{plain}"
    assert image.manifest_digest in plain, "the result line names the digest"

    # Pulled again: nothing to fetch, so no bars.
    code, out = _run_on_pty([str(W.warren_bin()), "image", "pull", "--insecure-registry", reg.host, ref,
                             "--data-dir", str(data)])
    assert code == 0, out
    assert "2 layers, 0 to fetch" in out, out


def test_pull_is_quiet_without_a_terminal(pushed):
    reg, image, root = pushed
    ref = f"{reg.host}/e2e/progress:v1"
    r = subprocess.run([str(W.warren_bin()), "image", "pull", "--insecure-registry", reg.host, ref,
                        "--data-dir", str(root / "data-pipe"), "-o", "json"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stderr == "", r.stderr
    import json
    rec = json.loads(r.stdout)
    assert rec["name"] == ref and rec["digest"] == image.manifest_digest
