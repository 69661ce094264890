"""Fixtures for Warren's end-to-end suite (official OpenSandbox SDK 1.1.1).

Servers are started per OCI runtime (env WARREN_E2E_OCI_RUNTIMES, comma list,
default "embedded"), each with its own temp data dir and random API key, and
stopped by PID. See README.md for the full contract.
"""

from __future__ import annotations

import faulthandler
import os
import shutil
import signal
import sys
import threading
import uuid
from datetime import timedelta
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import warren_e2e as W  # noqa: E402

LEAK_CHECK_MARKER = "leak_check"
DEFAULT_TEST_TIMEOUT = float(os.environ.get("WARREN_E2E_TEST_TIMEOUT", "180"))


# --------------------------------------------------------------------------
# pytest hooks
# --------------------------------------------------------------------------

def pytest_configure(config):
    config.addinivalue_line("markers", f"{LEAK_CHECK_MARKER}: runs after every other test")
    config.addinivalue_line("markers", "needs_test_image: uses the debootstrap test image")
    config.addinivalue_line("markers", "timeout(seconds): per-test wall clock limit")


def pytest_report_header(config):
    return [
        f"warren binary: {W.warren_bin()} ({'present' if W.warren_bin().is_file() else 'MISSING'})",
        f"OCI runtimes: {','.join(W.oci_runtimes())}",
        f"test rootfs: {W.test_rootfs()} ({'present' if (W.test_rootfs() / 'usr/bin/python3').exists() else 'MISSING'})",
        f"run id: {W.RUN_ID}",
    ]


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session, config, items):
    """Move leak-check tests to the very end, after pytest's own reordering
    of parametrized fixtures."""
    last = [i for i in items if i.get_closest_marker(LEAK_CHECK_MARKER)]
    if last:
        rest = [i for i in items if not i.get_closest_marker(LEAK_CHECK_MARKER)]
        items[:] = rest + last


class _TestTimeout(BaseException):
    """A BaseException, like KeyboardInterrupt: the SDK's loops catch `Exception` and carry on
    (the pool's release_all_idle logs and takes the next id), which would swallow the limit."""


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    """A per-test wall-clock limit (SIGALRM; no plugin needed) so that a hung
    server call fails one test instead of the whole run."""
    marker = item.get_closest_marker("timeout")
    limit = float(marker.args[0]) if marker else DEFAULT_TEST_TIMEOUT
    use_alarm = limit > 0 and threading.current_thread() is threading.main_thread()
    if use_alarm:
        def on_alarm(signum, frame):
            raise _TestTimeout(f"test exceeded {limit:.0f}s (WARREN_E2E_TEST_TIMEOUT / @pytest.mark.timeout)")
        old = signal.signal(signal.SIGALRM, on_alarm)
        signal.setitimer(signal.ITIMER_REAL, limit)
        # Last resort when even that is ignored: print every thread's stack and end the run, so a
        # hang costs minutes and names its place instead of eating the whole CI budget.
        faulthandler.dump_traceback_later(limit + 120, exit=True)
    try:
        yield
    finally:
        if use_alarm:
            faulthandler.cancel_dump_traceback_later()
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)


def pytest_sessionfinish(session, exitstatus):
    # Safety net: whatever happened, no server started by the suite outlives it.
    for srv in W.REGISTRY.servers:
        try:
            if srv.alive():
                srv.stop()
        except Exception:  # noqa: BLE001
            srv.kill9()


# --------------------------------------------------------------------------
# servers
# --------------------------------------------------------------------------

@pytest.fixture(scope="session")
def work_root(request):
    """Temp folder holding every data dir, config and server log of this run.
    Removed at the end only if nothing failed and nothing is mounted below it.
    After a failure it is kept less its image layers; when the leak check passed
    (nothing of the sandboxes is left), only its server logs and configs are kept,
    beside it in `<root>-logs`. WARREN_E2E_KEEP=1 always keeps it whole."""
    root = W.work_root()
    yield root
    if os.environ.get("WARREN_E2E_KEEP") == "1":
        return
    failed = request.session.testsfailed > 0
    if W.leaked_mounts([root]):
        print(f"\nwarren e2e: mounts remain below {root}; not deleting it", file=sys.stderr)
        return
    if any(s.alive() for s in W.REGISTRY.servers):
        print(f"\nwarren e2e: a server still runs; keeping {root} for inspection", file=sys.stderr)
        return
    if failed and W.REGISTRY.leak_check_passed:
        # A test failed, but nothing below the root matters any more except what the servers
        # said: keep their logs and configs (small), so that a rare failure can be read after.
        logs = root.with_name(root.name + "-logs")
        logs.mkdir(exist_ok=True)
        for f in list(root.glob("*.log")) + list(root.glob("*.toml")):
            shutil.copy2(f, logs / f.name)
        shutil.rmtree(root, ignore_errors=True)
        print(f"\nwarren e2e: a test failed; server logs kept in {logs}", file=sys.stderr)
        return
    if failed:
        # Logs, configs and sandbox records tell what went wrong; the imported image layers
        # (hundreds of MiB per server) do not, and failed runs kept whole have filled disks.
        for images in root.glob("data-*/images"):
            shutil.rmtree(images, ignore_errors=True)
        print(f"\nwarren e2e: keeping {root} (without image layers) for inspection", file=sys.stderr)
        return
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session", params=W.oci_runtimes(), ids=lambda r: f"oci={r}")
def runtime(request):
    return request.param


def _start_server(runtime: str, root: Path, name: str) -> W.WarrenServer:
    srv = W.WarrenServer(runtime, root, name)
    missing = None
    try:
        srv.check_binary()
    except W.BinaryMissing as exc:
        missing = str(exc)
    if missing:
        pytest.fail(missing, pytrace=False)
    srv.start()
    return srv


@pytest.fixture(scope="session")
def server(runtime, work_root):
    """The shared `warren serve` for one OCI runtime. What it can do (`srv.caps`, from its
    /v1/health) is what tests choose by; `run_once` compares runtimes by it too."""
    srv = _start_server(runtime, work_root, f"{runtime}-main")
    W.DEFAULT_CAPS.setdefault(runtime, srv.caps)
    yield srv
    srv.stop()


@pytest.fixture
def fresh_server(runtime, work_root):
    """A private server for tests that kill/restart it."""
    srv = _start_server(runtime, work_root, f"{runtime}-{uuid.uuid4().hex[:6]}")
    yield srv
    if not srv.alive():
        # a test left it dead: bring it back so it can clean its sandboxes
        try:
            srv.start()
        except Exception:  # noqa: BLE001
            return
    srv.stop()


# --------------------------------------------------------------------------
# images
# --------------------------------------------------------------------------

def require_test_rootfs() -> Path:
    rootfs = W.test_rootfs()
    if not (rootfs / "usr/bin/python3").exists():
        msg = (f"test image rootfs not found at {rootfs} (no usr/bin/python3). Build it with "
               f"`scripts/build-test-image {rootfs}` or set WARREN_TEST_ROOTFS.")
        if W.allow_skip():
            pytest.skip(msg + " [skipped: WARREN_E2E_ALLOW_SKIP=1]")
        pytest.fail(msg + " (set WARREN_E2E_ALLOW_SKIP=1 to skip instead)", pytrace=False)
    return rootfs


@pytest.fixture
def test_image(server):
    """Name of the debootstrap image, imported into `server`'s data dir on first use."""
    rootfs = require_test_rootfs()
    server.import_image(W.TEST_IMAGE_NAME, rootfs)
    return W.TEST_IMAGE_NAME


def require_jupyter_rootfs() -> Path:
    rootfs = W.jupyter_rootfs()
    if not (rootfs / "usr/share/jupyter/kernels/python3/kernel.json").exists():
        msg = (f"code-interpreter test image not found at {rootfs}. Build it with "
               f"`scripts/build-test-image {rootfs} jupyter` or set WARREN_TEST_JUPYTER_ROOTFS.")
        if W.allow_skip():
            pytest.skip(msg + " [skipped: WARREN_E2E_ALLOW_SKIP=1]")
        pytest.fail(msg + " (set WARREN_E2E_ALLOW_SKIP=1 to skip instead)", pytrace=False)
    return rootfs


@pytest.fixture
def jupyter_image(server):
    """Name of the debootstrap image with python3-ipykernel and matplotlib, imported on first use."""
    server.import_image(W.JUPYTER_IMAGE_NAME, require_jupyter_rootfs())
    return W.JUPYTER_IMAGE_NAME


@pytest.fixture(params=["host", "test-image"])
def any_image(request, server):
    """Parametrize a test over the built-in `host` image and the debootstrap image."""
    if request.param == "host":
        return "host"
    rootfs = require_test_rootfs()
    server.import_image(W.TEST_IMAGE_NAME, rootfs)
    return W.TEST_IMAGE_NAME


# --------------------------------------------------------------------------
# SDK helpers
# --------------------------------------------------------------------------

class SandboxFactory:
    """Creates sandboxes through the official sync SDK and kills them at teardown."""

    def __init__(self, server: W.WarrenServer):
        self.server = server
        self.created = []

    def __call__(self, image: str = "host", **kw):
        from opensandbox import SandboxSync
        kw.setdefault("connection_config", self.server.sdk_config())
        kw.setdefault("timeout", timedelta(minutes=10))
        kw.setdefault("ready_timeout", timedelta(seconds=60))
        sbx = SandboxSync.create(self.server.sandbox_image(image), **kw)
        W.track_sandbox(sbx.id)
        self.created.append(sbx)
        return sbx

    def cleanup(self):
        for sbx in self.created:
            try:
                sbx.kill()
            except Exception:  # noqa: BLE001 - already gone is fine
                pass
            try:
                sbx.close()
            except Exception:  # noqa: BLE001
                pass


@pytest.fixture
def make_sandbox(server):
    f = SandboxFactory(server)
    yield f
    f.cleanup()


@pytest.fixture(scope="module")
def host_sandbox(server):
    """One long-lived sandbox on the `host` image shared by a module's tests."""
    f = SandboxFactory(server)
    sbx = f("host", env={"E2E_SANDBOX_ENV": "from-create"})
    yield sbx
    f.cleanup()


@pytest.fixture
def manager(server):
    from opensandbox import SandboxManagerSync
    m = SandboxManagerSync.create(connection_config=server.sdk_config())
    yield m
    m.close()


@pytest.fixture
def api(server):
    """Raw httpx client on the lifecycle API, with the API key."""
    with server.client() as c:
        yield c


@pytest.fixture
def raw_sandbox(server, api):
    """Create sandboxes through the raw API; deleted at teardown."""
    ids = []

    def create(image="host", **overrides):
        r = api.post("/v1/sandboxes", json=W.create_body(server.sandbox_image(image), **overrides))
        assert r.status_code == 202, f"create failed: {r.status_code} {r.text[:500]}"
        body = r.json()
        W.track_sandbox(body["id"])
        ids.append(body["id"])
        return body

    yield create
    for sid in ids:
        api.delete(f"/v1/sandboxes/{sid}")


sh = W.sh


@pytest.fixture
def run_sh():
    return sh
