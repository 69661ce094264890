"""Harness for Warren's end-to-end suite: starting/stopping `warren serve`,
importing images, raw HTTP helpers, and the bookkeeping the final leak check
relies on (every PID, data dir and sandbox id the suite touched).

Contract assumed (see README.md):
  warren serve --listen 127.0.0.1:PORT --data-dir DIR [--config FILE]
      API key from env WARREN_API_KEY; logs on stderr; ready when
      GET /health answers 200 {"status":"healthy"}; what its runtime can do is
      GET /v1/health's `runtime` ({kind, name, capabilities}), which the
      tests choose by (`WarrenServer.caps`, `require`, `run_once`).
  warren image import NAME PATH --data-dir DIR
  warren image ls --data-dir DIR          (NAME appears in stdout)
  warren image rm NAME --data-dir DIR
  config TOML:  [runtime]\nkind = "native"\noci_runtime = "<embedded|runc|runsc>"
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Callable, Iterable

import httpx
import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
TEST_IMAGE_NAME = "warren-test:bookworm"
JUPYTER_IMAGE_NAME = "warren-test:jupyter"
DESKTOP_IMAGE_NAME = "warren-test:desktop"
CODE_IMAGE_NAME = "warren-test:code-interpreter"
RUN_ID = uuid.uuid4().hex[:12]
MARKER_ENV = "WARREN_E2E_RUN"


# --------------------------------------------------------------------------
# configuration from the environment
# --------------------------------------------------------------------------

def warren_bin() -> Path:
    env = os.environ.get("WARREN_BIN")
    if env:
        return Path(env)
    profile = "release" if os.environ.get("WARREN_PROFILE") == "release" else "debug"
    return REPO_ROOT / "target" / "x86_64-unknown-linux-gnu" / profile / "warren"


def oci_runtimes() -> list[str]:
    raw = os.environ.get("WARREN_E2E_OCI_RUNTIMES", "embedded")
    runtimes = [r.strip() for r in raw.split(",") if r.strip()]
    return runtimes or ["embedded"]


def host_account() -> tuple[int, int]:
    """A host account other than root, with its primary group (neither 0 nor nogroup): whose folder
    a test shares with a sandbox as a person would share theirs."""
    import pwd
    for p in sorted(pwd.getpwall(), key=lambda p: (p.pw_uid < 1000, p.pw_uid)):
        if 0 < p.pw_uid < 65534 and p.pw_gid not in (0, 65534):
            return p.pw_uid, p.pw_gid
    raise AssertionError("no host account other than root in /etc/passwd")


def test_rootfs() -> Path:
    return Path(os.environ.get("WARREN_TEST_ROOTFS", "/var/cache/warren/test-rootfs"))


def jupyter_rootfs() -> Path:
    return Path(os.environ.get("WARREN_TEST_JUPYTER_ROOTFS", "/var/cache/warren/test-rootfs-jupyter"))


def code_rootfs() -> Path:
    """The jupyter image plus the Java, JavaScript and TypeScript kernels (build-test-image's
    code-interpreter variant)."""
    return Path(os.environ.get("WARREN_TEST_CODE_ROOTFS", "/var/cache/warren/test-rootfs-code-interpreter"))


def desktop_rootfs() -> Path:
    """The desktop image (build-test-image's desktop variant): X, a window manager, VNC, noVNC,
    xterm, Tk and Chromium."""
    return Path(os.environ.get("WARREN_TEST_DESKTOP_ROOTFS", "/var/cache/warren/test-rootfs-desktop"))


def allow_skip() -> bool:
    return os.environ.get("WARREN_E2E_ALLOW_SKIP", "") == "1"


def work_root() -> Path:
    """Parent folder for all data dirs of this run."""
    base = os.environ.get("WARREN_E2E_TMPDIR")
    if base:
        Path(base).mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f"warren-e2e-{RUN_ID}-", dir=base))


# --------------------------------------------------------------------------
# bookkeeping for the leak check
# --------------------------------------------------------------------------

@dataclass
class Registry:
    server_pids: set[int] = field(default_factory=set)
    # Each server's start time (clock ticks after boot), so that a PID the kernel has since given to
    # some other process is not taken for a server that outlived the suite.
    server_starts: dict[int, int] = field(default_factory=dict)
    # Servers that got SIGKILL: they cannot clean up after themselves (the next start does).
    killed_pids: set[int] = field(default_factory=set)
    data_dirs: set[Path] = field(default_factory=set)
    sandbox_ids: set[str] = field(default_factory=set)
    servers: list["WarrenServer"] = field(default_factory=list)
    roots: set[Path] = field(default_factory=set)
    leak_check_passed: bool = False


REGISTRY = Registry()


def track_sandbox(sandbox_id: str | None) -> None:
    if sandbox_id:
        REGISTRY.sandbox_ids.add(str(sandbox_id))


# --------------------------------------------------------------------------
# small utilities
# --------------------------------------------------------------------------

def upper_dir(data_dir: Path, sandbox_id: str) -> Path:
    """A native sandbox's overlay upper folder: on its own disk (`disk/upper`, by default) or, for a
    sandbox without one, in its folder."""
    folder = data_dir / "sandboxes" / sandbox_id
    return folder / "disk" / "upper" if (folder / "disk").is_dir() else folder / "upper"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(pred: Callable[[], Any], timeout: float, interval: float = 0.1,
               message: str = "condition") -> Any:
    """Poll `pred` until it returns a truthy value; return that value."""
    deadline = time.monotonic() + timeout
    last_exc: BaseException | None = None
    while True:
        try:
            value = pred()
            if value:
                return value
        except Exception as exc:  # noqa: BLE001 - we re-raise with context below
            last_exc = exc
        if time.monotonic() >= deadline:
            extra = f" (last error: {last_exc!r})" if last_exc else ""
            raise AssertionError(f"timed out after {timeout}s waiting for {message}{extra}")
        time.sleep(interval)


def rfc3339(dt: datetime) -> str:
    return dt.astimezone(timezone.utc).isoformat()


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


def parse_time(value: str) -> datetime:
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


def assert_error_body(resp: httpx.Response, *, codes: Iterable[int] | None = None,
                      code: str | None = None) -> dict:
    """Assert a Warren/OpenSandbox error response: status in `codes` and a
    JSON body {"code": str, "message": str}. Returns the body."""
    if codes is not None:
        codes = tuple(codes)
        assert resp.status_code in codes, (
            f"{resp.request.method} {resp.request.url}: expected status in {codes}, "
            f"got {resp.status_code}: {resp.text[:500]}")
    try:
        body = resp.json()
    except ValueError as exc:
        raise AssertionError(
            f"{resp.request.method} {resp.request.url}: error body is not JSON "
            f"({resp.status_code}): {resp.text[:500]!r}") from exc
    assert isinstance(body, dict), f"error body is not an object: {body!r}"
    assert isinstance(body.get("code"), str) and body["code"], f"error body lacks 'code': {body!r}"
    assert isinstance(body.get("message"), str), f"error body lacks 'message': {body!r}"
    if code is not None:
        assert body["code"] == code, f"expected code {code!r}, got {body!r}"
    return body


def create_body(image: str = "host", **overrides: Any) -> dict:
    """A valid CreateSandboxRequest like the SDK sends it."""
    body: dict[str, Any] = {
        "image": {"uri": image},
        "timeout": 600,
        "resourceLimits": {"cpu": "1", "memory": "2Gi"},
        "entrypoint": ["tail", "-f", "/dev/null"],
        "secureAccess": False,
    }
    body.update(overrides)
    return body


# --------------------------------------------------------------------------
# what a server's runtime can do, as its /v1/health says
# --------------------------------------------------------------------------

def _snake(name: str) -> str:
    return "".join("_" + c.lower() if c.isupper() else c for c in name)


@dataclass(frozen=True)
class Capabilities:
    """`runtime` of a server's `GET /v1/health`: `kind` ("native", "docker", "kubernetes"), `name`
    ("native/embedded", "native/runsc", "docker/runsc", …) and its `capabilities`
    (crates/api/src/lifecycle.rs, RuntimeCapabilities). Tests choose by these, not by the name of
    the runtime they were started for: `caps.get("egressPolicy")` or `caps.egress_policy`."""

    kind: str
    name: str
    execd_transport: str            # "unix" | "tcp"
    pause: bool
    snapshots: bool                 # a writable layer on this host (overlayfs) that snapshots copy
    egress_policy: bool             # a network link per sandbox, where the server enforces egress
    egress_addresses: bool          # the backend enforces rules naming addresses (Kubernetes)
    egress_names: bool              # … and names
    disk_bound: bool                # ephemeral-storage bounds the root file system's writes
    user_namespaces: bool
    isolated_sessions: bool
    host_volumes: str               # "server" | "node" | "none"
    image_source: str               # "store" (Warren's, with the built-in `host`) | "engine"
    create_parallelism: int | None  # only where creating is bound by the server's CPUs
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_health(cls, runtime: dict) -> "Capabilities":
        c = runtime["capabilities"]
        return cls(kind=runtime["kind"], name=runtime["name"],
                   execd_transport=c["execdTransport"], pause=c["pause"], snapshots=c["snapshots"],
                   egress_policy=c["egressPolicy"], egress_addresses=c.get("egressAddresses", False),
                   egress_names=c.get("egressNames", False), disk_bound=c["diskBound"],
                   user_namespaces=c["userNamespaces"], isolated_sessions=c["isolatedSessions"],
                   host_volumes=c["hostVolumes"], image_source=c.get("imageSource", "store"),
                   create_parallelism=c.get("createParallelism"), raw=dict(runtime))

    @property
    def gvisor(self) -> bool:
        """gVisor runs the sandboxes (`native/runsc`, `docker/runsc`, `kubernetes/gvisor`): its
        Sentry is the sandbox's kernel (its own /proc, /sys, mount table, network stack and signal
        rules; no host process per sandbox process). No capability says that; only the name does."""
        return self.name.rsplit("/", 1)[-1] in ("runsc", "gvisor")

    def get(self, cap: str) -> Any:
        """A capability by its /health name (`egressPolicy`) or this object's (`egress_policy`);
        also `kind`, `name` and `gvisor`."""
        attr = _snake(cap)
        if not hasattr(self, attr) or attr == "raw":
            raise KeyError(f"no such capability: {cap!r}")
        return getattr(self, attr)

    def has(self, **needs: Any) -> bool:
        """Every capability named has the value given (True: present)."""
        return all(self.get(k) == v for k, v in needs.items())


def describe_needs(needs: dict) -> str:
    return ", ".join(k if v is True else f"not {k}" if v is False else f"{k}={v}" for k, v in needs.items())


# Each runtime's capabilities with the harness's default configuration (the shared `server`
# fixture's), read from a server of that runtime: what `run_once` picks a runtime by.
DEFAULT_CAPS: dict[str, Capabilities] = {}


def runtime_caps(runtime: str, root: Path) -> Capabilities:
    """What a server of `runtime` with the default configuration says it can do: the shared
    server's answer when it was started already, else that of a server started (and stopped)
    for the question."""
    if runtime not in DEFAULT_CAPS:
        probe = WarrenServer(runtime, root, f"{runtime}-caps-{uuid.uuid4().hex[:6]}")
        probe.start()
        try:
            DEFAULT_CAPS[runtime] = probe.caps
        finally:
            probe.stop()
    return DEFAULT_CAPS[runtime]


def first_runtime_with(root: Path, **needs: Any) -> str | None:
    """The first runtime of WARREN_E2E_OCI_RUNTIMES whose servers have `needs` (none: the first)."""
    for r in oci_runtimes():
        if not needs or runtime_caps(r, root).has(**needs):
            return r
    return None


def skip_unless_first(runtime: str, root: Path, why: str, **needs: Any) -> None:
    """Skips unless `runtime` is the one `first_runtime_with(**needs)` names: for what is the same
    on every runtime (that has `needs`), so that the suite runs it exactly once whatever
    WARREN_E2E_OCI_RUNTIMES lists, not once per runtime."""
    first = first_runtime_with(root, **needs)
    if first is None:
        pytest.skip(f"no runtime of WARREN_E2E_OCI_RUNTIMES has {describe_needs(needs)}: {why}")
    if first != runtime:
        which = f"the first runtime with {describe_needs(needs)}" if needs else "the first runtime"
        pytest.skip(f"runtime-independent: runs on {which} only ({first}): {why}")


# --------------------------------------------------------------------------
# the server under test
# --------------------------------------------------------------------------

class BinaryMissing(RuntimeError):
    pass


class WarrenServer:
    """One `warren serve` process with its own data dir (and API key)."""

    def __init__(self, runtime: str, root: Path, name: str, *,
                 data_dir: Path | None = None, api_key: str | None = None) -> None:
        self.runtime = runtime
        self.root = root
        self.name = name
        self.data_dir = data_dir or (root / f"data-{name}")
        self.api_key = api_key or ("wk-" + secrets.token_hex(24))
        self.port: int | None = None
        self.proc: subprocess.Popen | None = None
        self.config_path = root / f"config-{name}.toml"
        self.log_path = root / f"server-{name}.log"
        self.imported: set[str] = set()
        self.docker_pull = False
        # Docker runtimes: the daemon (default $DOCKER_HOST) and more lines for `[docker]`
        self.docker_host: str | None = None
        self.docker_config = ""
        # appended to the generated config (e.g. a [network] section)
        self.extra_config = ""
        # sections of its own a test adds at the end ([http], [limits]…)
        self.more_config = ""
        # set in the server's environment (and the CLI's), over the test's own
        self.extra_env: dict[str, str] = {}
        # Extra lines for the `[runtime]` section (which the harness writes itself).
        self.runtime_config = ""
        # native runtime: pull missing images ([images] pull = "missing"); only for tests that bring
        # their own registry on loopback and configure it in `extra_config`
        self.native_pull = False
        # The file-creation mask `warren serve` and the harness's `warren` CLI calls start with
        # (None: the test process's own).
        self.umask: int | None = None
        self.bin = warren_bin()
        # "https" for a server with `[tls]`; `ca_file` is then what clients trust.
        self.scheme = "http"
        self.ca_file: Path | None = None
        # What GET /v1/health said of its runtime at its last start (see `caps`).
        self._caps: Capabilities | None = None
        REGISTRY.data_dirs.add(self.data_dir)
        REGISTRY.roots.add(root)
        REGISTRY.servers.append(self)

    # -- environment / paths -------------------------------------------------
    @property
    def base_url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}"

    @property
    def verify(self) -> Any:
        """httpx's `verify` for this server: its CA when it serves HTTPS."""
        import ssl
        return ssl.create_default_context(cafile=str(self.ca_file)) if self.ca_file else True

    @property
    def domain(self) -> str:
        return f"127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["WARREN_API_KEY"] = self.api_key
        env[MARKER_ENV] = RUN_ID
        env.setdefault("RUST_BACKTRACE", "1")
        env.setdefault("RUST_LOG", "info")
        # never let a developer's SDK/env settings leak into the server
        for k in ("OPEN_SANDBOX_API_KEY", "OPENSANDBOX_SERVER_API_KEY"):
            env.pop(k, None)
        env.update(self.extra_env)
        return env

    def check_binary(self) -> None:
        if not self.bin.is_file() or not os.access(self.bin, os.X_OK):
            raise BinaryMissing(
                f"warren binary not found or not executable at {self.bin}. Build it first "
                f"(cargo build --target x86_64-unknown-linux-gnu, add --release and "
                f"WARREN_PROFILE=release for release) or point WARREN_BIN at it.")

    # -- runtimes: "embedded", "runc", "runsc" (native) and "docker", "docker-runsc" ----------
    @property
    def docker_configured(self) -> bool:
        """Configured as a Docker runtime: how the harness writes its config and imports images.
        Tests choose by what the server says it can do (`caps`), not by this."""
        return self.runtime.startswith("docker")

    # -- what it can do, as GET /v1/health says (tests choose by these) --------------------------
    @property
    def caps(self) -> Capabilities:
        """The capabilities /v1/health reported at the last start (fetched once per start)."""
        assert self._caps is not None, (
            f"no capabilities for server {self.name}: it was never started, or its /v1/health "
            f"named no runtime")
        return self._caps

    def _fetch_caps(self) -> Capabilities | None:
        """/v1/health's `runtime`, read once per start (None when it names none: `caps` says so
        where a test asks)."""
        try:
            r = httpx.get(f"{self.base_url}/v1/health", timeout=10, verify=self.verify)
            runtime = r.json().get("runtime") if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None
        return Capabilities.from_health(runtime) if runtime else None

    @property
    def kind(self) -> str:
        """/v1/health's runtime.kind: "native", "docker" or "kubernetes"."""
        return self.caps.kind

    @property
    def gvisor(self) -> bool:
        """gVisor runs its sandboxes (runtime.name `native/runsc`, `docker/runsc`): for what its
        Sentry does its own way, which no capability expresses."""
        return self.caps.gvisor

    @property
    def embedded(self) -> bool:
        """The embedded runtime runs its sandboxes (runtime.name `native/embedded`): for its own
        machinery (the zygote and setup helpers, its seccomp filter, execd forked from the
        server's binary), which no capability expresses."""
        return self.caps.name == "native/embedded"

    @property
    def execd_socket_handed_over(self) -> bool:
        """execd gets a listening socket the server bound on the host's side and mounts no socket
        folder in the sandbox: the native runtime except under gVisor, whose sandbox serves its own
        sockets only (crates/runtime-native/src/oci.rs, `takes_listener`). Elsewhere (gVisor,
        Docker) execd binds its socket in `/.warren/run`, a folder of the sandbox's. No capability
        says which: derived from runtime.kind and runtime.name."""
        return self.kind == "native" and not self.gvisor

    @property
    def is_primary(self) -> bool:
        """Its runtime is the first of WARREN_E2E_OCI_RUNTIMES (see `run_once`)."""
        return self.runtime == oci_runtimes()[0]

    def require(self, cap: str, why: str, value: Any = True) -> None:
        """Skips unless /v1/health says the runtime has capability `cap` (or that `cap` is `value`):
        `server.require("snapshots", "captures the writable layer")`,
        `server.require("hostVolumes", "mounts a host folder", "server")`."""
        got = self.caps.get(cap)
        if got != value:
            want = cap if value is True else f"{cap}={value}"
            pytest.skip(f"needs {want} (this runtime, {self.caps.name}: {cap}={json.dumps(got)}): {why}")

    def require_image_store(self, why: str) -> None:
        """Skips unless images come from Warren's own image store (imageSource "store"), where the
        built-in `host` image is and `warren image …` manages images."""
        self.require("imageSource", why, "store")

    def run_once(self, why: str, **needs: Any) -> None:
        """Skips unless this is the one runtime of the session the calling test runs on: the first
        of WARREN_E2E_OCI_RUNTIMES whose server has `needs` (capabilities by their /health names,
        `run_once(why, snapshots=True)`; none: the first runtime). For what is the same on every
        runtime (that has them): it runs exactly once whatever the list is."""
        skip_unless_first(self.runtime, self.root, why, **needs)
        if needs and not self.caps.has(**needs):
            pytest.skip(f"needs {describe_needs(needs)} (this server of {self.runtime} has not): {why}")

    @property
    def host_volumes(self) -> Path:
        """The one host folder this server lets `host` volumes mount from ([storage])."""
        return self.root / f"hostvols-{self.name}"

    def write_config(self) -> None:
        self.host_volumes.mkdir(parents=True, exist_ok=True)
        storage = f'[storage]\nallowed_host_paths = ["{self.host_volumes}"]\n'
        # Tests never reach a real resolver: a sandbox's DNS goes nowhere (the discard port on
        # loopback) unless the test gives the server its own upstream (`extra_config`).
        network = self.extra_config or '[network]\ndns_upstream = "127.0.0.1:9"\n'
        if self.runtime == "kubernetes":
            # The cluster is the test's (tests/e2e/fakekube.py), named in `more_config`.
            self.config_path.write_text('[runtime]\nkind = "kubernetes"\n' + self.runtime_config + storage
                                        + network + self.more_config)
            return
        if self.docker_configured:
            text = '[runtime]\nkind = "docker"\n' + self.runtime_config + '[docker]\n'
            if self.docker_host or os.environ.get("DOCKER_HOST"):
                text += f'host = "{self.docker_host or os.environ["DOCKER_HOST"]}"\n'
            text += self.docker_config
            if self.runtime == "docker-runsc":
                text += 'runtime = "runsc"\n'
            # the tests must never reach a registry on the internet (an unknown image would be pulled);
            # servers that test pulls set `docker_pull` and use a registry on loopback
            if not self.docker_pull:
                text += 'pull = "never"\n'
            self.config_path.write_text(text + storage + network + self.more_config)
            return
        # Likewise no registry: an image missing from the store is a 404, never a pull from Docker Hub,
        # unless the test serves its own registry on loopback and sets `native_pull`.
        images = "" if self.native_pull else '[images]\npull = "never"\n'
        self.config_path.write_text(
            "[runtime]\n"
            'kind = "native"\n'
            f'oci_runtime = "{self.runtime}"\n' + self.runtime_config + storage + network + images
            + self.more_config)

    def sandbox_image(self, image: str) -> str:
        """The built-in `host` image exists in Warren's image store only (imageSource "store"); where
        an engine brings the images, the tests that do not care which image they get use the
        debootstrap test image instead."""
        if image == "host" and self.caps.image_source != "store":
            self.import_image(TEST_IMAGE_NAME, test_rootfs())
            return TEST_IMAGE_NAME
        return image

    # -- CLI -------------------------------------------------------------------
    def cli(self, *args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
        self.check_binary()
        cmd = [str(self.bin), *args, "--data-dir", str(self.data_dir)]
        res = subprocess.run(cmd, env=self.env(), capture_output=True, text=True, timeout=timeout,
                             umask=-1 if self.umask is None else self.umask)
        if check and res.returncode != 0:
            raise AssertionError(
                f"`{' '.join(cmd)}` failed with exit code {res.returncode}\n"
                f"stdout:\n{res.stdout[-4000:]}\nstderr:\n{res.stderr[-4000:]}")
        return res

    def import_image(self, name: str, path: Path) -> None:
        if name in self.imported:
            return
        if self.docker_configured:
            docker_import(name, path)
        else:
            self.cli("image", "import", name, str(path))
        self.imported.add(name)

    # -- process control ---------------------------------------------------------
    def start(self, *, port: int | None = None, ready_timeout: float = 30) -> "WarrenServer":
        # A port free_port() found free can be taken before the server binds it (an ephemeral port
        # of some other loopback connection: seen once in CI after a kill -9 and restart). Only
        # that case, and only for a port we picked, is tried again on another port.
        for attempt in range(3):
            try:
                return self._start_once(port=port, ready_timeout=ready_timeout)
            except AssertionError as exc:
                if port is not None or attempt == 2 or "Address already in use" not in str(exc):
                    raise

    def _start_once(self, *, port: int | None, ready_timeout: float) -> "WarrenServer":
        self.check_binary()
        self.root.mkdir(parents=True, exist_ok=True)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.write_config()
        self.port = port or free_port()
        cmd = [str(self.bin), "serve", "--listen", self.domain,
               "--data-dir", str(self.data_dir), "--config", str(self.config_path)]
        log = open(self.log_path, "ab")
        log.write(f"\n===== {time.strftime('%H:%M:%S')} {' '.join(cmd)}\n".encode())
        log.flush()
        self.proc = subprocess.Popen(cmd, env=self.env(), stdin=subprocess.DEVNULL,
                                     stdout=log, stderr=log, start_new_session=True,
                                     umask=-1 if self.umask is None else self.umask)
        log.close()
        REGISTRY.server_pids.add(self.proc.pid)
        REGISTRY.server_starts[self.proc.pid] = _start_ticks(self.proc.pid)
        self.wait_ready(ready_timeout)
        self._caps = self._fetch_caps()
        return self

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        last = "no answer"
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise AssertionError(
                    f"warren serve exited with code {self.proc.returncode} before becoming "
                    f"healthy.\n--- log tail ({self.log_path}) ---\n{self.log_tail()}")
            try:
                r = httpx.get(f"{self.base_url}/health", timeout=2, verify=self.verify)
                if r.status_code == 200 and r.json().get("status") == "healthy":
                    return
                last = f"{r.status_code} {r.text[:200]}"
            except Exception as exc:  # noqa: BLE001
                last = repr(exc)
            time.sleep(0.05)
        raise AssertionError(
            f"warren serve on {self.domain} not healthy after {timeout}s (last: {last})\n"
            f"--- log tail ({self.log_path}) ---\n{self.log_tail()}")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill9(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            REGISTRY.killed_pids.add(self.proc.pid)
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def terminate(self, timeout: float = 20) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.kill(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            REGISTRY.killed_pids.add(self.proc.pid)
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
            raise AssertionError(
                f"warren serve (pid {self.proc.pid}) ignored SIGTERM for {timeout}s; killed")

    def delete_all_sandboxes(self, timeout: float = 30) -> list[str]:
        """Delete every sandbox the server knows and wait until each one is
        Terminated/Failed or gone. Returns the ids seen."""
        if not self.alive():
            return []
        ids: list[str] = []
        with self.client() as c:
            page = 1
            while True:
                r = c.get("/v1/sandboxes", params={"page": page, "pageSize": 100})
                if r.status_code != 200:
                    break
                body = r.json()
                for item in body.get("items", []):
                    ids.append(item["id"])
                if not body.get("pagination", {}).get("hasNextPage"):
                    break
                page += 1
            for sid in ids:
                track_sandbox(sid)
                c.delete(f"/v1/sandboxes/{sid}")
            deadline = time.monotonic() + timeout
            pending = set(ids)
            while pending and time.monotonic() < deadline:
                for sid in list(pending):
                    r = c.get(f"/v1/sandboxes/{sid}")
                    if r.status_code == 404:
                        pending.discard(sid)
                    elif r.status_code == 200 and r.json()["status"]["state"] in ("Terminated", "Failed"):
                        pending.discard(sid)
                if pending:
                    time.sleep(0.1)
        return ids

    def stop(self) -> None:
        """Clean shutdown: remove all sandboxes, then SIGTERM the server."""
        try:
            self.delete_all_sandboxes()
        finally:
            self.terminate()

    def log_tail(self, n: int = 60) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return "(no log)"
        return "\n".join(lines[-n:])

    # -- HTTP clients ---------------------------------------------------------------
    def client(self, *, api_key: str | None | bool = True, timeout: float = 60) -> httpx.Client:
        headers = {}
        if api_key is True:
            headers["OPEN-SANDBOX-API-KEY"] = self.api_key
        elif isinstance(api_key, str):
            headers["OPEN-SANDBOX-API-KEY"] = api_key
        return httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout, verify=self.verify)

    def sdk_config(self, **kw: Any):
        from opensandbox.config import ConnectionConfigSync
        kw.setdefault("request_timeout", timedelta(seconds=120))
        return ConnectionConfigSync(domain=self.domain, api_key=self.api_key, **kw)

    def sdk_async_config(self, **kw: Any):
        from opensandbox.config import ConnectionConfig
        kw.setdefault("request_timeout", timedelta(seconds=120))
        return ConnectionConfig(domain=self.domain, api_key=self.api_key, **kw)


# --------------------------------------------------------------------------
# host-side inspection used by restart and leak tests
# --------------------------------------------------------------------------

def _read(path: str, binary: bool = False):
    try:
        with open(path, "rb") as f:
            data = f.read()
        return data if binary else data.decode(errors="replace")
    except OSError:
        return None


def all_pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _stat_fields(pid: int) -> list[str]:
    """/proc/PID/stat from field 3 (state) on; empty when the process is gone."""
    stat = _read(f"/proc/{pid}/stat")
    # pid (comm) state ppid …; comm may hold spaces and parentheses: split after the last ')'
    return stat.rsplit(")", 1)[-1].split() if stat else []


def state_and_ppid(pid: int) -> tuple[str, int] | None:
    """A process's state letter (`Z` for a zombie) and parent pid; `None` when it is gone."""
    fields = _stat_fields(pid)
    return (fields[0], int(fields[1])) if len(fields) >= 2 else None


def zombie_children(parent: int) -> list[int]:
    """Exited children of `parent` that nobody reaped (state Z)."""
    return [pid for pid in all_pids() if state_and_ppid(pid) == ("Z", parent)]


def proc_argv(pid: int) -> list[str]:
    """A process's arguments; empty when it is gone (or in the middle of an execve)."""
    raw = _read(f"/proc/{pid}/cmdline", binary=True)
    return raw.decode(errors="replace").rstrip("\0").split("\0") if raw else []


def proc_cmdline(pid: int) -> str:
    return " ".join(proc_argv(pid)).strip()


def proc_state(pid: int) -> str | None:
    status = _read(f"/proc/{pid}/status")
    if not status:
        return None
    for line in status.splitlines():
        if line.startswith("State:"):
            return line.split()[1]
    return None


def own_ancestry() -> set[int]:
    pids = set()
    pid = os.getpid()
    while pid > 1:
        pids.add(pid)
        status = _read(f"/proc/{pid}/status") or ""
        ppid = 0
        for line in status.splitlines():
            if line.startswith("PPid:"):
                ppid = int(line.split()[1])
        pid = ppid
    return pids


def pid_ns(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None


def pids_with_cmdline(substr: str) -> list[int]:
    me = own_ancestry()
    return [p for p in all_pids() if p not in me and substr in proc_cmdline(p)]


def sandbox_host_pids(marker: str, sandbox_id: str) -> set[int]:
    """Host PIDs belonging to a sandbox: everything sharing the PID namespace
    of a process whose command line carries `marker`, plus processes whose
    command line mentions the sandbox id (gVisor's runsc-sandbox/gofer)."""
    me = own_ancestry()
    my_ns = pid_ns(os.getpid())
    found: set[int] = set()
    namespaces = set()
    for p in pids_with_cmdline(marker):
        ns = pid_ns(p)
        if ns and ns != my_ns:
            namespaces.add(ns)
        found.add(p)
    if namespaces:
        for p in all_pids():
            if p not in me and pid_ns(p) in namespaces:
                found.add(p)
    server_pids = REGISTRY.server_pids
    for p in pids_with_cmdline(sandbox_id):
        if p not in server_pids:
            found.add(p)
    return found - me


def leaked_processes(data_dirs: Iterable[Path]) -> list[str]:
    me = own_ancestry()
    dirs = [str(d) for d in data_dirs]
    out = []
    for pid in all_pids():
        if pid in me:
            continue
        state = proc_state(pid)
        if state is None:
            continue
        reasons = []
        if pid in REGISTRY.server_pids and _start_ticks(pid) == REGISTRY.server_starts.get(pid):
            reasons.append("warren serve started by the suite")
        env = _read(f"/proc/{pid}/environ", binary=True) or b""
        if f"{MARKER_ENV}={RUN_ID}".encode() in env:
            reasons.append(f"inherits {MARKER_ENV}={RUN_ID}")
        cmd = proc_cmdline(pid)
        if any(d in cmd for d in dirs):
            reasons.append("command line mentions a test data dir")
        for link in ("root", "cwd"):
            try:
                target = os.readlink(f"/proc/{pid}/{link}")
            except OSError:
                continue
            if any(target == d or target.startswith(d + "/") for d in dirs):
                reasons.append(f"{link} is inside a test data dir ({target})")
        if any(sid in cmd for sid in REGISTRY.sandbox_ids):
            reasons.append("command line mentions a sandbox id")
        if reasons:
            out.append(f"pid {pid} [{state}] {cmd[:200]!r}: {', '.join(reasons)}")
    return out


def _unescape_mount(s: str) -> str:
    return s.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")


def leaked_mounts(data_dirs: Iterable[Path]) -> list[str]:
    dirs = [str(d) for d in data_dirs]
    out = []
    for path in ("/proc/self/mountinfo",):
        text = _read(path) or ""
        for line in text.splitlines():
            parts = line.split()
            if len(parts) < 5:
                continue
            root, mnt = _unescape_mount(parts[3]), _unescape_mount(parts[4])
            rest = line.split(" - ", 1)[1] if " - " in line else ""
            if any(mnt == d or mnt.startswith(d + "/") for d in dirs) or any(d in rest for d in dirs):
                out.append(line)
    # loop devices still backed by a file of a data dir (a sandbox's disk; "(deleted)" once removed)
    for backing in Path("/sys/block").glob("loop*/loop/backing_file"):
        name = (_read(str(backing)) or "").strip()
        if any(name.startswith(d + "/") for d in dirs):
            out.append(f"{backing.parent.parent.name} backed by {name}")
    return out


def leaked_cgroups(sandbox_ids: Iterable[str], server_pids: Iterable[int] = ()) -> list[str]:
    """Cgroups named for one of the sandboxes, and the standby setup helpers' cgroups
    (`.standby-N-PID`) of the given servers, which a server that stopped cleanly removes."""
    ids = [s for s in sandbox_ids if s]
    standby = tuple(f"-{pid}" for pid in server_pids)
    out = []
    roots: list[Path] = []
    cg = Path("/sys/fs/cgroup")
    if cg.is_dir():
        roots += [p for p in cg.glob("warren*") if p.is_dir()]
        roots += [p for p in cg.glob("*/warren*") if p.is_dir()]
        # systemd-style nesting, e.g. /sys/fs/cgroup/<ctrl>/<slice>/warren*
        roots += [p for p in cg.glob("*/*/warren*") if p.is_dir()]
    seen = set()
    for r in roots:
        for dirpath, dirnames, _ in os.walk(r):
            for d in dirnames:
                full = os.path.join(dirpath, d)
                if full in seen:
                    continue
                seen.add(full)
                if any(sid in d for sid in ids) or (d.startswith(".standby-") and d.endswith(standby)):
                    out.append(full)
        if any(sid in r.name for sid in ids):
            out.append(str(r))
    return sorted(set(out))


def leaked_sandbox_dirs(data_dirs: Iterable[Path], sandbox_ids: Iterable[str]) -> list[str]:
    ids = [s for s in sandbox_ids if s]
    out = []
    for d in data_dirs:
        if not d.exists():
            continue
        for dirpath, dirnames, _ in os.walk(d):
            for name in dirnames:
                if any(sid in name for sid in ids):
                    out.append(os.path.join(dirpath, name))
            # do not descend into image stores: they can be big and hold no sandbox dirs
            dirnames[:] = [n for n in dirnames if n not in ("images", "blobs", "layers")]
    return sorted(out)


def join_chunks(messages) -> str:
    """The output as the command wrote it, from SDK OutputMessages framed as the reference frames
    them: one event per line without its terminator, an empty line as "\\n". Every line reads back
    ending in "\\n" (a last line the command left unterminated gains one; test_output_framing checks
    the events themselves)."""
    return "".join(m.text if m.text == "\n" else m.text + "\n" for m in messages)


def timeline(srv, sandbox_id: str, *, api_key: str | bool = True, **params) -> list[dict]:
    """A sandbox's flight recorder, as its JSON lines parsed (`GET /v1/sandboxes/{id}/timeline`)."""
    with srv.client(api_key=api_key) as c:
        r = c.get(f"/v1/sandboxes/{sandbox_id}/timeline", params=params)
        assert r.status_code == 200, r.text
        assert r.headers["content-type"] == "application/x-ndjson", r.headers
        return [json.loads(line) for line in r.text.splitlines() if line.strip()]


def sh(sbx, command: str, **opts):
    """Run a shell command through the SDK; return (exit_code, stdout, stderr)."""
    from opensandbox.models.execd import RunCommandOpts
    ex = sbx.commands.run(command, opts=RunCommandOpts(**opts) if opts else None)
    return ex.exit_code, join_chunks(ex.logs.stdout), join_chunks(ex.logs.stderr)


def leaked_docker(data_dirs: Iterable[Path]) -> list[str]:
    """Containers and volumes a server of this run labelled as its own (io.warren.owner = its data
    dir) that are still on the Docker daemon. Nothing when no daemon answers."""
    if not any(s.docker_configured for s in REGISTRY.servers):
        return []
    out = []
    for d in data_dirs:
        label = f"label=io.warren.owner={d}"
        for kind, cmd in (("container", ["docker", "ps", "-aq", "--filter", label]),
                          ("volume", ["docker", "volume", "ls", "-q", "--filter", label])):
            r = subprocess.run(cmd, capture_output=True, text=True)
            out += [f"docker {kind} {x} of {d}" for x in r.stdout.split()]
    return out + orphan_shims()


def _start_ticks(pid: int) -> int:
    fields = _stat_fields(pid)
    return int(fields[19]) if len(fields) > 19 else 0  # field 22, starttime


def orphan_shims() -> list[str]:
    """containerd shims started since this test process did whose container the daemon no longer
    has: the daemon removed a container but containerd kept its task (as a forced removal of a
    paused gVisor container did). Shims older than the run are another run's business."""
    known = subprocess.run(["docker", "ps", "-aq", "--no-trunc"], capture_output=True, text=True)
    if known.returncode != 0:
        return []
    known_ids = set(known.stdout.split())
    since = _start_ticks(os.getpid())
    out = []
    for pid in all_pids():
        args = proc_argv(pid)
        if not args or not args[0].endswith(("containerd-shim-runc-v2", "containerd-shim")) or "-id" not in args:
            continue
        cid = (args[args.index("-id") + 1:] or [""])[0]
        if cid not in known_ids and _start_ticks(pid) >= since:
            out.append(f"containerd shim pid {pid} of container {cid[:12]}, which the daemon no longer has")
    return out


def egress_tag(data_dir: Path) -> int:
    """The tag a server on `data_dir` names its firewall table and sandbox links with
    (FNV-1a of the data dir path, as crates/server/src/network.rs computes it)."""
    h = 2166136261
    for b in str(data_dir).encode():
        h = ((h ^ b) * 16777619) & 0xFFFFFFFF
    return h


def leaked_network(data_dirs: Iterable[Path]) -> list[str]:
    """Sandbox links (host ends are named w<4 hex of the tag>-<n>) and firewall tables
    (warren_<tag>) that this run's servers left on the host. Servers remove their table when they
    stop with no linked sandbox, and a link goes with its sandbox. Scoped by the data dirs' tags, so
    that what a killed earlier run or another Warren on this host holds is not counted."""
    import re
    tags = {egress_tag(p) for d in data_dirs for p in (Path(d), Path(d).resolve())}
    prefixes = {f"w{t & 0xFFFF:04x}-" for t in tags}
    tables = {f"warren_{t:08x}" for t in tags}
    out = [f"link {name}" for name in os.listdir("/sys/class/net")
           if re.fullmatch(r"w[0-9a-f]{4}-\d+", name) and name[:6] in prefixes]
    r = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True)
    out += [f"nft {line.strip()}" for line in r.stdout.splitlines() if (line.split() or [""])[-1] in tables]
    return out


def leaked_volume_leases(data_dirs: Iterable[Path]) -> list[str]:
    """Named-volume leases of the native runtime still held (a sandbox that went without releasing)."""
    out = []
    for d in data_dirs:
        leases = Path(d) / "volumes" / ".leases"
        if leases.is_dir():
            out += [str(p) for p in leases.glob("*/*")]
    return out


def docker_import(name: str, rootfs: Path) -> None:
    """Makes `name` an image on the Docker daemon (DOCKER_HOST) from a rootfs folder, once."""
    if subprocess.run(["docker", "image", "inspect", name], capture_output=True).returncode == 0:
        return
    tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
    res = subprocess.run(["docker", "import", "-", name], stdin=tar.stdout, capture_output=True, text=True)
    tar.stdout.close()
    tar.wait()
    if res.returncode != 0:
        raise AssertionError(f"docker import {name} failed: {res.stderr}")


def json_or_text(resp: httpx.Response) -> Any:
    try:
        return resp.json()
    except (ValueError, json.JSONDecodeError):
        return resp.text


# A browser a test starts stays on loopback: no other name resolves (`*.localhost` is loopback to
# Chromium itself), anything else goes to a dead proxy, and its background services are off.
CHROMIUM_LOOPBACK_FLAGS = [
    "--disable-dev-shm-usage", "--no-first-run", "--no-default-browser-check",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--disable-default-apps", "--disable-extensions", "--disable-domain-reliability",
    "--disable-client-side-phishing-detection", "--metrics-recording-only",
    "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE localhost, EXCLUDE *.localhost, EXCLUDE 127.0.0.1",
    "--proxy-server=http://127.0.0.1:9", "--proxy-bypass-list=localhost;*.localhost;127.0.0.1",
]


def chromium_binary() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if not found:
        pytest.fail("chromium is not installed (scripts/install-deps installs it)", pytrace=False)
    return found


def sdk_sandbox(srv: "WarrenServer", image: str, **kw):
    """A sandbox made with the official SDK (ten minutes to live, a minute to be ready), tracked for
    the final leak check."""
    from datetime import timedelta
    from opensandbox import SandboxSync
    sbx = SandboxSync.create(image, connection_config=srv.sdk_config(), timeout=timedelta(minutes=10),
                             ready_timeout=timedelta(seconds=60), **kw)
    track_sandbox(sbx.id)
    return sbx


def sandbox_record(srv: "WarrenServer", sandbox_id: str) -> dict:
    """The sandbox's record as the server keeps it (the journal's last line for the id wins; a line
    being written is skipped)."""
    found = None
    for line in (srv.data_dir / "state" / "sandboxes.jsonl").read_text().splitlines():
        try:
            rec = (json.loads(line) or {}).get("put") or {}
        except ValueError:
            continue
        if rec.get("id") == sandbox_id:
            found = rec
    assert found is not None, f"no record for {sandbox_id}"
    return found


def execd_credential(srv: "WarrenServer", sandbox_id: str) -> str:
    """The credential the server sends execd over TCP: an HMAC of the sandbox's secret (from the
    server's record), which only the server can compute."""
    import hashlib
    import hmac
    token = sandbox_record(srv, sandbox_id)["token"]
    return hmac.new(token.encode(), b"warren-execd-v1", hashlib.sha256).hexdigest()


def files_logs_and_proxy_work(sbx, where: str, app_port: int) -> None:
    """Through the official SDK: a file written and read back, a background command's logs, and a
    program in the sandbox reached through the endpoint proxy (all over execd)."""
    from opensandbox.models.execd import RunCommandOpts
    path, content = f"/tmp/e2e-{app_port}.txt", f"via {where}"
    sbx.files.write_file(path, content)
    assert sbx.files.read_file(path) == content
    bg = sbx.commands.run("for i in 1 2 3; do echo n$i; done; sleep 60", opts=RunCommandOpts(background=True))
    wait_until(lambda: "n3" in sbx.commands.get_background_command_logs(bg.id).content, 15,
               message=f"background logs from {where}")
    sbx.commands.interrupt(bg.id)
    sbx.commands.run(f"python3 -m http.server {app_port} --bind 127.0.0.1 --directory /tmp",
                     opts=RunCommandOpts(background=True))
    ep = sbx.get_endpoint(app_port)
    r = wait_until(lambda: (x := httpx.get(f"http://{ep.endpoint}/e2e-{app_port}.txt", headers=ep.headers,
                                           timeout=10)).status_code == 200 and x, 15, interval=0.2,
                   message=f"the app in {where} to answer through the proxy")
    assert r.text == content
