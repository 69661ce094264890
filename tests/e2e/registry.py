"""Helpers for the registry-pull tests (test_registry.py): a real registry process, an OCI/Docker image
builder in pure Python, a distribution-API push, and an in-process HTTP front that can count, stall and
add Docker's bearer-token flow in front of a registry.

Everything listens on 127.0.0.1 only, and every process is started by us and stopped by its PID.

* `Registry`      Debian's `docker-registry serve config.yml` (distribution 2.8) on a free port with
                  its storage in a folder of ours; optional htpasswd basic auth and TLS (a throwaway CA
                  and a server certificate for 127.0.0.1, made with the openssl CLI); `stop(kill=True)`
                  simulates a crash, `start()` brings it back on the same port and storage;
                  `blob_path(digest)` is the blob's data file in the storage (to corrupt it).
* `ImageBuilder`  layers from a spec dict, from a folder (GNU tar; cached per builder), from raw tar
                  members (malicious layers) or random bytes; gzip / zstd (the `zstd` CLI) / none;
                  image configs; OCI or Docker schema2 manifests; OCI indexes / Docker manifest lists.
* `push()`        POST+PUT monolithic blob uploads (HEAD first: existing blobs are skipped), then the
                  manifest with its media type (an index after its children).
* `RegistryFront` a threaded HTTP server proxying to a registry: counts requests per path, can stall a
                  GET after N bytes until released, and with `token_auth=(user, password)` implements
                  the bearer-token flow (`/token` wants basic auth).
"""

from __future__ import annotations

import atexit
import base64
import gzip
import hashlib
import http.client
import io
import json
import os
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import tarfile
import threading
import time
import urllib.parse
from collections import Counter
from dataclasses import dataclass, field, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import httpx

# --------------------------------------------------------------------------
# media types
# --------------------------------------------------------------------------

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
OCI_LAYER = {
    "none": "application/vnd.oci.image.layer.v1.tar",
    "gzip": "application/vnd.oci.image.layer.v1.tar+gzip",
    "zstd": "application/vnd.oci.image.layer.v1.tar+zstd",
}
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
DOCKER_CONFIG = "application/vnd.docker.container.image.v1+json"
DOCKER_LAYER = {
    "none": "application/vnd.docker.image.rootfs.diff.tar",
    "gzip": "application/vnd.docker.image.rootfs.diff.tar.gzip",
}
MANIFEST_ACCEPT = ", ".join([OCI_MANIFEST, OCI_INDEX, DOCKER_MANIFEST, DOCKER_LIST])

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

# every live Registry, killed at interpreter exit should a fixture not get to stop it
_LIVE: set["Registry"] = set()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(pred, timeout: float, what: str, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            v = pred()
            if v:
                return v
        except Exception as exc:  # noqa: BLE001
            last = exc
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}" + (f" (last error: {last!r})" if last else ""))


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


def sha256_bytes(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def hex_of(digest: str) -> str:
    return digest.split(":", 1)[1]


# --------------------------------------------------------------------------
# TLS material (openssl CLI)
# --------------------------------------------------------------------------

def make_tls(folder: Path, hosts: Sequence[str] = ("127.0.0.1",)) -> tuple[Path, Path, Path]:
    """A throwaway CA (ca.pem) and a server certificate (server.pem, server.key) signed by it for
    `hosts` (IP addresses or DNS names). Returns (ca.pem, server.pem, server.key)."""
    folder.mkdir(parents=True, exist_ok=True)
    ca_key, ca, key, csr, cert = (folder / n for n in ("ca.key", "ca.pem", "server.key", "server.csr", "server.pem"))
    ext = folder / "server.ext"
    san = ",".join(("IP:" if h.replace(".", "").isdigit() or ":" in h else "DNS:") + h for h in hosts)
    ext.write_text(f"subjectAltName={san}\nbasicConstraints=critical,CA:FALSE\n"
                   "keyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n")

    def run(*args: str) -> None:
        r = subprocess.run(["openssl", *args], capture_output=True, text=True)
        if r.returncode != 0:
            raise AssertionError(f"openssl {' '.join(args)} failed: {r.stderr}")

    run("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", str(ca_key), "-out", str(ca), "-days", "2", "-subj", "/CN=warren-e2e-ca",
        "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    run("req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", str(key), "-out", str(csr), "-subj", f"/CN={hosts[0]}")
    run("x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key), "-CAcreateserial",
        "-out", str(cert), "-days", "2", "-extfile", str(ext))
    return ca, cert, key


# --------------------------------------------------------------------------
# the registry process
# --------------------------------------------------------------------------

class Registry:
    """Debian's docker-registry on 127.0.0.1:<free port>, storage in `root/data`.

    auth=(user, password): htpasswd basic auth (bcrypt, `htpasswd -Bbn`).
    tls=True: HTTPS with a certificate for 127.0.0.1 signed by `ca_path` (root/tls/ca.pem)."""

    def __init__(self, root: Path, *, auth: tuple[str, str] | None = None, tls: bool = False) -> None:
        if not shutil.which("docker-registry"):
            raise RuntimeError("docker-registry is not installed (scripts/install-deps installs it)")
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.storage = self.root / "data"
        self.auth = auth
        self.tls = tls
        self.port = _free_port()
        self.proc: subprocess.Popen | None = None
        self.log_path = self.root / "registry.log"
        self.config_path = self.root / "config.yml"
        self.ca_path: Path | None = None
        text = ("version: 0.1\nlog:\n  level: info\n  accesslog:\n    disabled: false\n"
                f"storage:\n  filesystem:\n    rootdirectory: {self.storage}\n  delete:\n    enabled: true\n"
                f"http:\n  addr: 127.0.0.1:{self.port}\n  secret: {secrets.token_hex(16)}\n")
        if tls:
            self.ca_path, cert, key = make_tls(self.root / "tls")
            text += f"  tls:\n    certificate: {cert}\n    key: {key}\n"
        if auth:
            if not shutil.which("htpasswd"):
                raise RuntimeError("htpasswd is not installed (apache2-utils)")
            r = subprocess.run(["htpasswd", "-Bbn", auth[0], auth[1]], capture_output=True, text=True, check=True)
            (self.root / "htpasswd").write_text(r.stdout)
            text += f"auth:\n  htpasswd:\n    realm: e2e\n    path: {self.root / 'htpasswd'}\n"
        self.config_path.write_text(text)

    # -- addresses ---------------------------------------------------------------
    @property
    def host(self) -> str:
        """`127.0.0.1:PORT`, the registry part of image names."""
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.host}"

    @property
    def verify(self) -> ssl.SSLContext | bool:
        """What httpx needs to trust this registry."""
        if self.ca_path:
            return ssl.create_default_context(cafile=str(self.ca_path))
        return True

    def client(self, **kw: Any) -> httpx.Client:
        if self.auth:
            kw.setdefault("auth", self.auth)
        return httpx.Client(base_url=self.url, verify=self.verify, timeout=60, **kw)

    # -- process control -----------------------------------------------------------
    def start(self, timeout: float = 30) -> "Registry":
        if self.alive():
            return self
        env = {k: v for k, v in os.environ.items() if not k.startswith("REGISTRY_")}
        log = open(self.log_path, "ab")
        log.write(f"\n===== {time.strftime('%H:%M:%S')} start on {self.host}\n".encode())
        log.flush()
        self.proc = subprocess.Popen(["docker-registry", "serve", str(self.config_path)], stdin=subprocess.DEVNULL,
                                     stdout=log, stderr=log, env=env, start_new_session=True)
        log.close()
        _LIVE.add(self)

        def ready():
            if self.proc.poll() is not None:
                raise AssertionError(f"docker-registry exited with {self.proc.returncode}:\n{self.log_tail()}")
            with httpx.Client(verify=self.verify, timeout=2) as c:
                return c.get(f"{self.url}/v2/").status_code in (200, 401)

        try:
            _wait(ready, timeout, f"docker-registry on {self.host}")
        except BaseException:
            self.stop(kill=True)
            raise
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, kill: bool = False, timeout: float = 10) -> None:
        """SIGTERM (or SIGKILL with kill=True, a crash) by PID, and wait for it."""
        proc = self.proc
        if proc is None:
            return
        if proc.poll() is None:
            try:
                os.kill(proc.pid, signal.SIGKILL if kill else signal.SIGTERM)
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(10)
            except ProcessLookupError:
                pass
        _LIVE.discard(self)

    def __enter__(self) -> "Registry":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except FileNotFoundError:
            return "(no log)"

    # -- storage ---------------------------------------------------------------------
    def blob_path(self, digest: str) -> Path:
        """The data file of a blob in the registry's filesystem storage."""
        h = hex_of(digest)
        return self.storage / "docker/registry/v2/blobs/sha256" / h[:2] / h / "data"

    def corrupt_blob(self, digest: str, offset: int | None = None, length: int = 64) -> None:
        """Overwrite `length` bytes of the blob in place (same size, so the registry still serves it with
        the original length; only the digest is wrong). Default offset: the middle."""
        path = self.blob_path(digest)
        size = path.stat().st_size
        if offset is None:
            offset = max(0, size // 2 - length // 2)
        with open(path, "r+b") as f:
            f.seek(offset)
            old = f.read(length)
            f.seek(offset)
            f.write(bytes((b ^ 0xFF) for b in old))


@atexit.register
def _kill_leftover_registries() -> None:
    for reg in list(_LIVE):
        try:
            reg.stop(kill=True)
        except Exception:  # noqa: BLE001
            pass


# --------------------------------------------------------------------------
# image builder
# --------------------------------------------------------------------------

@dataclass(frozen=True)
class Layer:
    """One layer blob (compressed as `compression`) stored at `path`."""
    path: Path
    digest: str          # of the blob as pushed
    size: int
    diff_id: str         # of the uncompressed tar
    compression: str     # "gzip" | "zstd" | "none"
    media_type: str | None = None  # overrides the one derived from format+compression

    def with_media_type(self, media_type: str) -> "Layer":
        return replace(self, media_type=media_type)

    def descriptor(self, fmt: str) -> dict:
        if self.media_type:
            mt = self.media_type
        elif fmt == "docker":
            if self.compression not in DOCKER_LAYER:
                raise ValueError(f"Docker schema2 has no media type for {self.compression} layers")
            mt = DOCKER_LAYER[self.compression]
        else:
            mt = OCI_LAYER[self.compression]
        return {"mediaType": mt, "digest": self.digest, "size": self.size}


@dataclass(frozen=True)
class Image:
    """A single-platform image: config + layers + manifest (all bytes exact as pushed)."""
    fmt: str                   # "oci" | "docker"
    layers: tuple[Layer, ...]
    config_bytes: bytes
    manifest_bytes: bytes
    platform: dict

    @property
    def config(self) -> dict:
        return json.loads(self.config_bytes)

    @property
    def config_digest(self) -> str:
        return sha256_bytes(self.config_bytes)

    @property
    def manifest_digest(self) -> str:
        return sha256_bytes(self.manifest_bytes)

    @property
    def media_type(self) -> str:
        return OCI_MANIFEST if self.fmt == "oci" else DOCKER_MANIFEST

    @property
    def diff_ids(self) -> list[str]:
        return [l.diff_id for l in self.layers]

    @property
    def blob_digests(self) -> list[str]:
        """Every blob a pull fetches: config first, then layers."""
        return [self.config_digest] + [l.digest for l in self.layers]

    def descriptor(self) -> dict:
        return {"mediaType": self.media_type, "digest": self.manifest_digest,
                "size": len(self.manifest_bytes), "platform": dict(self.platform)}


@dataclass(frozen=True)
class Index:
    """An OCI image index or Docker manifest list over `images`."""
    fmt: str
    images: tuple[Image, ...]
    manifest_bytes: bytes

    @property
    def manifest_digest(self) -> str:
        return sha256_bytes(self.manifest_bytes)

    @property
    def media_type(self) -> str:
        return OCI_INDEX if self.fmt == "oci" else DOCKER_LIST

    def for_platform(self, os_: str, arch: str) -> Image:
        for img in self.images:
            if img.platform.get("os") == os_ and img.platform.get("architecture") == arch:
                return img
        raise KeyError(f"{os_}/{arch}")


# raw tar members for hand-made (malicious) layers
@dataclass(frozen=True)
class Member:
    """One tar entry written verbatim (no path cleaning): kind is file | dir | symlink | hardlink |
    chardev | blockdev | fifo."""
    kind: str
    name: str
    data: bytes = b""
    target: str = ""
    mode: int | None = None
    major: int = 0
    minor: int = 0


class _RandomReader:
    def read(self, n: int = -1) -> bytes:
        return os.urandom(n if n and n > 0 else 1 << 16)


class ImageBuilder:
    """Builds layers and images as files under `workdir` (blobs named by their hex digest)."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = Path(workdir)
        self.blobs = self.workdir / "blobs"
        self.blobs.mkdir(parents=True, exist_ok=True)
        self._dir_cache: dict[tuple[str, str, tuple[str, ...]], Layer] = {}
        self._lock = threading.Lock()

    # -- layers --------------------------------------------------------------------------
    def _tmp(self, suffix: str) -> Path:
        return self.workdir / f"tmp-{secrets.token_hex(6)}{suffix}"

    def _finish(self, tar_path: Path, compression: str) -> Layer:
        """Hash the tar (diff_id), compress it into a blob file (digest)."""
        diff_id = sha256_file(tar_path)
        out = self._tmp(".blob")
        if compression == "none":
            os.replace(tar_path, out)
        elif compression == "gzip":
            # mtime=0 and no file name: the same content gives the same blob
            with open(tar_path, "rb") as src, open(out, "wb") as raw, \
                    gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0, compresslevel=1) as gz:
                shutil.copyfileobj(src, gz, 1 << 20)
            tar_path.unlink()
        elif compression == "zstd":
            if not shutil.which("zstd"):
                raise RuntimeError("the zstd CLI is not installed (apt-get install zstd)")
            subprocess.run(["zstd", "-q", "-3", "-T0", "--no-progress", "-f", "-o", str(out), str(tar_path)],
                           check=True, capture_output=True)
            tar_path.unlink()
        else:
            raise ValueError(f"unknown compression {compression!r}")
        digest = sha256_file(out)
        final = self.blobs / hex_of(digest)
        os.replace(out, final)
        return Layer(path=final, digest=digest, size=final.stat().st_size, diff_id=diff_id,
                     compression=compression)

    def layer(self, spec: Mapping[str, Any], compression: str = "gzip") -> Layer:
        """A layer from {path: value}, in the dict's order; parents are added as dirs when missing.

        value: bytes|str (file 0644) | ("file", data, mode) | ("dir",) | ("dir", mode) |
               ("symlink", target) | ("hardlink", target_path) | ("whiteout",) (deletes `path` of a lower
               layer: writes `.wh.<name>`) | ("opaque",) (`path` is a dir hiding all lower content:
               writes `path/` and `path/.wh..wh..opq`)."""
        tar_path = self._tmp(".tar")
        seen: set[str] = set()
        with tarfile.open(tar_path, "w", format=tarfile.PAX_FORMAT) as t:
            def add_dir(p: str, mode: int = 0o755) -> None:
                if p in seen or p in ("", "."):
                    return
                parent = p.rsplit("/", 1)[0] if "/" in p else ""
                add_dir(parent)
                ti = tarfile.TarInfo(p + "/")
                ti.type, ti.mode, ti.mtime = tarfile.DIRTYPE, mode, 1700000000
                t.addfile(ti)
                seen.add(p)

            def parent_of(p: str) -> str:
                return p.rsplit("/", 1)[0] if "/" in p else ""

            for raw_path, value in spec.items():
                path = raw_path.strip("/")
                if isinstance(value, (bytes, str)):
                    value = ("file", value, 0o644)
                kind = value[0]
                if kind == "dir":
                    add_dir(parent_of(path))
                    seen.discard(path)
                    add_dir(path, value[1] if len(value) > 1 else 0o755)
                    continue
                if kind == "opaque":
                    add_dir(path)
                    ti = tarfile.TarInfo(f"{path}/.wh..wh..opq")
                    ti.mtime = 1700000000
                    t.addfile(ti, io.BytesIO(b""))
                    continue
                add_dir(parent_of(path))
                if kind == "whiteout":
                    parent, name = parent_of(path), path.rsplit("/", 1)[-1]
                    ti = tarfile.TarInfo(f"{parent}/.wh.{name}" if parent else f".wh.{name}")
                    ti.mtime = 1700000000
                    t.addfile(ti, io.BytesIO(b""))
                    continue
                ti = tarfile.TarInfo(path)
                ti.mtime = 1700000000
                if kind == "file":
                    data = value[1].encode() if isinstance(value[1], str) else value[1]
                    ti.size, ti.mode = len(data), (value[2] if len(value) > 2 else 0o644)
                    t.addfile(ti, io.BytesIO(data))
                elif kind == "symlink":
                    ti.type, ti.linkname, ti.mode = tarfile.SYMTYPE, value[1], 0o777
                    t.addfile(ti)
                elif kind == "hardlink":
                    ti.type, ti.linkname = tarfile.LNKTYPE, value[1].strip("/")
                    t.addfile(ti)
                else:
                    raise ValueError(f"unknown spec kind {kind!r} for {raw_path}")
        return self._finish(tar_path, compression)

    def layer_from_members(self, members: Iterable[Member], compression: str = "gzip") -> Layer:
        """A layer of tar entries written exactly as given (`../x`, `/abs/../../x`, links anywhere,
        device nodes): for layers an unpacker must refuse."""
        tar_path = self._tmp(".tar")
        kinds = {"file": tarfile.REGTYPE, "dir": tarfile.DIRTYPE, "symlink": tarfile.SYMTYPE,
                 "hardlink": tarfile.LNKTYPE, "chardev": tarfile.CHRTYPE, "blockdev": tarfile.BLKTYPE,
                 "fifo": tarfile.FIFOTYPE}
        with tarfile.open(tar_path, "w", format=tarfile.PAX_FORMAT) as t:
            for m in members:
                ti = tarfile.TarInfo(m.name)
                ti.type = kinds[m.kind]
                ti.mtime = 1700000000
                ti.mode = m.mode if m.mode is not None else (0o755 if m.kind == "dir" else 0o644)
                if m.kind in ("symlink", "hardlink"):
                    ti.linkname = m.target
                if m.kind in ("chardev", "blockdev"):
                    ti.devmajor, ti.devminor = m.major, m.minor
                if m.kind == "file":
                    ti.size = len(m.data)
                    t.addfile(ti, io.BytesIO(m.data))
                else:
                    t.addfile(ti)
        return self._finish(tar_path, compression)

    def layer_from_tar_bytes(self, data: bytes, compression: str = "none") -> Layer:
        """A layer whose uncompressed content is `data` exactly (which need not even be a tar)."""
        tar_path = self._tmp(".tar")
        tar_path.write_bytes(data)
        return self._finish(tar_path, compression)

    def random_layer(self, size: int, path: str = "random.bin", compression: str = "none") -> Layer:
        """One file of `size` random bytes (incompressible: `none` is the sensible compression)."""
        tar_path = self._tmp(".tar")
        with tarfile.open(tar_path, "w", format=tarfile.PAX_FORMAT) as t:
            ti = tarfile.TarInfo(path.strip("/"))
            ti.size, ti.mtime = size, 1700000000
            t.addfile(ti, _RandomReader())
        return self._finish(tar_path, compression)

    def layer_from_dir(self, folder: Path, compression: str = "gzip",
                       exclude: Sequence[str] = ("./dev/*",)) -> Layer:
        """A layer of a whole folder (GNU tar, numeric owners, xattrs), cached per (folder, compression,
        exclude). The default leaves /dev empty, as in real images (the runtime provides /dev)."""
        key = (str(Path(folder).resolve()), compression, tuple(exclude))
        with self._lock:
            if key in self._dir_cache:
                return self._dir_cache[key]
            tar_path = self._tmp(".tar")
            cmd = ["tar", "--numeric-owner", "--xattrs", "--xattrs-include=*", "--sort=name",
                   "--format=pax", "--pax-option=exthdr.name=%d/PaxHeaders/%f,delete=atime,delete=ctime"]
            cmd += [f"--exclude={e}" for e in exclude]
            cmd += ["-C", str(folder), "-cf", str(tar_path), "."]
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode not in (0, 1):  # 1: "file changed as we read it" and the like
                raise AssertionError(f"tar of {folder} failed: {r.stderr[-2000:]}")
            layer = self._finish(tar_path, compression)
            self._dir_cache[key] = layer
            return layer

    # -- images --------------------------------------------------------------------------
    def image(self, layers: Sequence[Layer], *, fmt: str = "oci", env: Sequence[str] | None = None,
              cmd: Sequence[str] | None = None, entrypoint: Sequence[str] | None = None,
              working_dir: str | None = None, user: str | None = None, arch: str = "amd64",
              os_: str = "linux", variant: str | None = None, config_extra: Mapping[str, Any] | None = None,
              diff_ids: Sequence[str] | None = None) -> Image:
        """An image of `layers` (lowest first). env defaults to a PATH only. `diff_ids` overrides the
        config's rootfs.diff_ids (to make an inconsistent image); `config_extra` is merged into the
        top level of the config JSON."""
        if fmt not in ("oci", "docker"):
            raise ValueError(fmt)
        proc_cfg: dict[str, Any] = {"Env": list(env) if env is not None else [f"PATH={DEFAULT_PATH}"]}
        if cmd is not None:
            proc_cfg["Cmd"] = list(cmd)
        if entrypoint is not None:
            proc_cfg["Entrypoint"] = list(entrypoint)
        if working_dir is not None:
            proc_cfg["WorkingDir"] = working_dir
        if user is not None:
            proc_cfg["User"] = user
        config: dict[str, Any] = {
            "created": "2024-01-01T00:00:00Z",
            "architecture": arch,
            "os": os_,
            "config": proc_cfg,
            "rootfs": {"type": "layers", "diff_ids": list(diff_ids) if diff_ids is not None
                       else [l.diff_id for l in layers]},
            "history": [{"created": "2024-01-01T00:00:00Z", "created_by": f"warren e2e layer {i}"}
                        for i in range(len(layers))],
        }
        if variant:
            config["variant"] = variant
        if config_extra:
            config.update(config_extra)
        config_bytes = json.dumps(config, sort_keys=True, separators=(",", ":")).encode()
        manifest = {
            "schemaVersion": 2,
            "mediaType": OCI_MANIFEST if fmt == "oci" else DOCKER_MANIFEST,
            "config": {"mediaType": OCI_CONFIG if fmt == "oci" else DOCKER_CONFIG,
                       "digest": sha256_bytes(config_bytes), "size": len(config_bytes)},
            "layers": [l.descriptor(fmt) for l in layers],
        }
        platform = {"architecture": arch, "os": os_}
        if variant:
            platform["variant"] = variant
        return Image(fmt=fmt, layers=tuple(layers), config_bytes=config_bytes,
                     manifest_bytes=json.dumps(manifest, separators=(",", ":")).encode(), platform=platform)

    @staticmethod
    def index(images: Sequence[Image], fmt: str = "oci") -> Index:
        """An OCI index (fmt="oci") or a Docker manifest list (fmt="docker") over `images`, in order."""
        doc = {"schemaVersion": 2, "mediaType": OCI_INDEX if fmt == "oci" else DOCKER_LIST,
               "manifests": [i.descriptor() for i in images]}
        return Index(fmt=fmt, images=tuple(images), manifest_bytes=json.dumps(doc, separators=(",", ":")).encode())


# --------------------------------------------------------------------------
# push (distribution API)
# --------------------------------------------------------------------------

def _blob_source(data_or_path: bytes | Path):
    if isinstance(data_or_path, bytes):
        return data_or_path, len(data_or_path)
    return open(data_or_path, "rb"), Path(data_or_path).stat().st_size


def push_blob(c: httpx.Client, repo: str, digest: str, data_or_path: bytes | Path) -> bool:
    """Uploads one blob unless the registry has it. Returns True if it was uploaded."""
    if c.head(f"/v2/{repo}/blobs/{digest}").status_code == 200:
        return False
    r = c.post(f"/v2/{repo}/blobs/uploads/")
    if r.status_code != 202:
        raise AssertionError(f"POST /v2/{repo}/blobs/uploads/: {r.status_code} {r.text[:300]}")
    location = r.headers["Location"]
    sep = "&" if "?" in location else "?"
    url = f"{location}{sep}digest={urllib.parse.quote(digest)}"
    body, size = _blob_source(data_or_path)
    try:
        r = c.put(url, content=body, headers={"Content-Type": "application/octet-stream",
                                               "Content-Length": str(size)})
    finally:
        if not isinstance(body, bytes):
            body.close()
    if r.status_code != 201:
        raise AssertionError(f"PUT blob {digest} to {repo}: {r.status_code} {r.text[:300]}")
    return True


def push_manifest(c: httpx.Client, repo: str, reference: str, media_type: str, data: bytes) -> str:
    r = c.put(f"/v2/{repo}/manifests/{reference}", content=data, headers={"Content-Type": media_type})
    if r.status_code != 201:
        raise AssertionError(f"PUT manifest {repo}:{reference}: {r.status_code} {r.text[:500]}")
    return r.headers.get("Docker-Content-Digest", sha256_bytes(data))


def push(registry_url: str, repo: str, tag: str | None, image: Image | Index, auth: tuple[str, str] | None = None,
         verify: ssl.SSLContext | bool | str = True) -> str:
    """Pushes `image` (an Image, or an Index with all its images) to `repo` and tags it `tag` (None: by
    digest only). Returns the manifest digest of what the tag points at."""
    if isinstance(verify, (str, Path)):
        verify = ssl.create_default_context(cafile=str(verify))
    with httpx.Client(base_url=registry_url, auth=auth, verify=verify, timeout=300) as c:
        images = image.images if isinstance(image, Index) else (image,)
        for img in images:
            push_blob(c, repo, img.config_digest, img.config_bytes)
            for layer in img.layers:
                push_blob(c, repo, layer.digest, layer.path)
            if isinstance(image, Index) or tag is None:
                push_manifest(c, repo, img.manifest_digest, img.media_type, img.manifest_bytes)
        if isinstance(image, Index):
            if tag is None:
                return push_manifest(c, repo, image.manifest_digest, image.media_type, image.manifest_bytes)
            return push_manifest(c, repo, tag, image.media_type, image.manifest_bytes)
        if tag is not None:
            return push_manifest(c, repo, tag, image.media_type, image.manifest_bytes)
        return image.manifest_digest


def registry_push(reg: Registry, repo: str, tag: str | None, image: Image | Index) -> str:
    """`push` to a `Registry` with its own credentials and CA."""
    return push(reg.url, repo, tag, image, auth=reg.auth, verify=reg.verify)


def fetch_manifest(c: httpx.Client, repo: str, reference: str) -> httpx.Response:
    return c.get(f"/v2/{repo}/manifests/{reference}", headers={"Accept": MANIFEST_ACCEPT})


# --------------------------------------------------------------------------
# the front: counting / stalling proxy, optional bearer-token auth
# --------------------------------------------------------------------------

HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailers",
              "transfer-encoding", "upgrade"}


@dataclass
class _Stall:
    match: str
    after: int
    stalled: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)
    sent: int = 0


@dataclass
class RequestLog:
    method: str
    path: str           # without the query
    query: str
    status: int | None = None
    auth: str = ""      # "", "basic", "bearer"


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "warren-e2e-front"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass

    def _dispatch(self) -> None:
        self.server.front._handle(self)  # type: ignore[attr-defined]

    do_GET = do_HEAD = do_PUT = do_POST = do_PATCH = do_DELETE = _dispatch


class RegistryFront:
    """An HTTP front on 127.0.0.1:<free port> for the registry at `upstream` (an http:// URL).

    * every request is logged (`requests`, `count()`, `blob_gets()`, `manifest_requests()`), `reset()`
      clears the log;
    * `stall(match, after_bytes)` makes the next GET whose path contains `match` stop after sending
      `after_bytes` of the body: `wait_stalled()` returns once it is there, `release()` lets it go on
      (with whatever the upstream still gives: if the registry was killed meanwhile, the client sees a
      short body and the connection closed);
    * token_auth=(user, password): Docker's bearer-token flow. /v2/ requests without a valid
      `Authorization: Bearer` get 401 + `WWW-Authenticate: Bearer realm="http://HOST/token",service="e2e",
      scope="repository:<repo>:pull"`; `/token?service=&scope=` wants basic auth with the pair and answers
      {"token", "access_token"}. The bearer is not passed upstream (the upstream must not need auth);
      without token_auth an Authorization header goes through unchanged.
    * when the upstream cannot be reached: `down_mode="502"` answers 502, `down_mode="close"` closes the
      connection without an answer (like a refused connection would look to a client that was already
      connected)."""

    def __init__(self, upstream: str, *, token_auth: tuple[str, str] | None = None, service: str = "e2e",
                 down_mode: str = "502", upstream_verify: ssl.SSLContext | bool = True) -> None:
        u = urllib.parse.urlsplit(upstream)
        self.upstream_scheme = u.scheme
        self.upstream_host = u.hostname or "127.0.0.1"
        self.upstream_port = u.port or (443 if u.scheme == "https" else 80)
        self.upstream_verify = upstream_verify
        self.token_auth = token_auth
        self.service = service
        self.down_mode = down_mode
        self.requests: list[RequestLog] = []
        self.token_requests: list[dict] = []
        self.tokens: set[str] = set()
        self._stall: _Stall | None = None
        self._lock = threading.Lock()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self.httpd.daemon_threads = True
        self.httpd.front = self  # type: ignore[attr-defined]
        self.port = self.httpd.server_address[1]
        self._thread: threading.Thread | None = None

    # -- lifecycle -----------------------------------------------------------------------
    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.host}"

    def start(self) -> "RegistryFront":
        self._thread = threading.Thread(target=self.httpd.serve_forever, name=f"front-{self.port}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        st = self._stall
        if st:
            st.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()
        if self._thread:
            self._thread.join(10)

    def __enter__(self) -> "RegistryFront":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # -- the log ----------------------------------------------------------------------------
    def reset(self) -> None:
        with self._lock:
            self.requests.clear()
            self.token_requests.clear()

    def log(self) -> list[RequestLog]:
        with self._lock:
            return list(self.requests)

    def count(self, method: str | None = None, path_suffix: str = "", path_contains: str = "") -> int:
        return sum(1 for r in self.log()
                   if (method is None or r.method == method) and r.path.endswith(path_suffix)
                   and path_contains in r.path)

    def blob_gets(self, digest: str) -> int:
        """GETs of /v2/<any repo>/blobs/<digest> (whatever the answer, 401s of the token flow excluded)."""
        return sum(1 for r in self.log() if r.method == "GET" and r.path.endswith(f"/blobs/{digest}")
                   and r.status != 401)

    def manifest_requests(self, repo: str | None = None, method: str | None = None) -> int:
        """GET/HEAD of /v2/<repo>/manifests/<ref> (401s of the token flow excluded)."""
        def ok(r: RequestLog) -> bool:
            if "/manifests/" not in r.path or r.status == 401:
                return False
            if method and r.method != method:
                return False
            return repo is None or r.path.startswith(f"/v2/{repo}/manifests/")
        return sum(1 for r in self.log() if ok(r))

    def counter(self) -> Counter:
        return Counter(f"{r.method} {r.path}" for r in self.log())

    # -- stalling ---------------------------------------------------------------------------------
    def stall(self, match: str, after_bytes: int) -> None:
        with self._lock:
            self._stall = _Stall(match=match, after=after_bytes)

    def wait_stalled(self, timeout: float = 120) -> int:
        """Blocks until the stalled GET is held; returns the bytes sent so far."""
        st = self._stall
        assert st is not None, "no stall armed"
        if not st.stalled.wait(timeout):
            raise AssertionError(f"no GET matching {st.match!r} reached {st.after} bytes in {timeout}s; "
                                 f"requests: {[f'{r.method} {r.path}' for r in self.log()]}")
        return st.sent

    def release(self) -> None:
        st = self._stall
        if st:
            st.release.set()
        with self._lock:
            self._stall = None

    # -- token auth ----------------------------------------------------------------------------------
    def _challenge(self, path: str) -> str:
        realm = f"http://{self.host}/token"
        header = f'Bearer realm="{realm}",service="{self.service}"'
        repo = _repo_of(path)
        if repo:
            header += f',scope="repository:{repo}:pull"'
        return header

    def _send_json(self, h: BaseHTTPRequestHandler, status: int, body: Any,
                   headers: Mapping[str, str] | None = None) -> None:
        data = json.dumps(body).encode()
        h.send_response(status)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            h.send_header(k, v)
        h.end_headers()
        if h.command != "HEAD":
            h.wfile.write(data)

    def _token(self, h: BaseHTTPRequestHandler, query: str, entry: RequestLog) -> None:
        q = urllib.parse.parse_qs(query)
        user = password = None
        auth = h.headers.get("Authorization", "")
        if auth.lower().startswith("basic "):
            entry.auth = "basic"
            try:
                user, _, password = base64.b64decode(auth[6:].strip()).decode().partition(":")
            except Exception:  # noqa: BLE001
                user = password = None
        with self._lock:
            self.token_requests.append({"user": user, "service": q.get("service", [""])[0],
                                        "scope": q.get("scope", []), "ok": (user, password) == self.token_auth})
        if self.token_auth is None or (user, password) != self.token_auth:
            entry.status = 401
            self._send_json(h, 401, {"errors": [{"code": "UNAUTHORIZED", "message": "authentication required"}]},
                            {"WWW-Authenticate": 'Basic realm="e2e-token"'})
            return
        token = secrets.token_urlsafe(24)
        with self._lock:
            self.tokens.add(token)
        entry.status = 200
        self._send_json(h, 200, {"token": token, "access_token": token, "expires_in": 300,
                                 "issued_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})

    # -- proxying ------------------------------------------------------------------------------------
    def _handle(self, h: BaseHTTPRequestHandler) -> None:
        parts = urllib.parse.urlsplit(h.path)
        entry = RequestLog(method=h.command, path=parts.path, query=parts.query)
        with self._lock:
            self.requests.append(entry)
        body = b""
        length = int(h.headers.get("Content-Length") or 0)
        if length:
            body = h.rfile.read(length)
        elif h.headers.get("Transfer-Encoding", "").lower() == "chunked":
            body = _read_chunked(h.rfile)

        if self.token_auth is not None:
            if parts.path == "/token":
                self._token(h, parts.query, entry)
                return
            auth = h.headers.get("Authorization", "")
            token = auth[7:].strip() if auth.lower().startswith("bearer ") else None
            if token:
                entry.auth = "bearer"
            elif auth:
                entry.auth = auth.split(" ", 1)[0].lower()
            if token is None or token not in self.tokens:
                entry.status = 401
                self._send_json(h, 401, {"errors": [{"code": "UNAUTHORIZED", "message": "authentication required"}]},
                                {"WWW-Authenticate": self._challenge(parts.path),
                                 "Docker-Distribution-API-Version": "registry/2.0"})
                return
        self._proxy(h, body, entry)

    def _upstream(self) -> http.client.HTTPConnection:
        if self.upstream_scheme == "https":
            ctx = self.upstream_verify if isinstance(self.upstream_verify, ssl.SSLContext) else ssl.create_default_context()
            return http.client.HTTPSConnection(self.upstream_host, self.upstream_port, timeout=120, context=ctx)
        return http.client.HTTPConnection(self.upstream_host, self.upstream_port, timeout=120)

    def _proxy(self, h: BaseHTTPRequestHandler, body: bytes, entry: RequestLog) -> None:
        headers = {k: v for k, v in h.headers.items() if k.lower() not in HOP_BY_HOP}
        if self.token_auth is not None:
            headers.pop("Authorization", None)
            headers.pop("authorization", None)
        conn = self._upstream()
        try:
            conn.request(h.command, h.path, body=body or None, headers=headers)
            resp = conn.getresponse()
        except OSError as exc:
            conn.close()
            if self.down_mode == "close":
                entry.status = 0
                h.close_connection = True
                return
            entry.status = 502
            self._send_json(h, 502, {"errors": [{"code": "UNAVAILABLE", "message": f"upstream: {exc}"}]})
            return
        entry.status = resp.status
        try:
            resp_headers = [(k, v) for k, v in resp.getheaders() if k.lower() not in HOP_BY_HOP]
            declared = resp.getheader("Content-Length")
            if h.command == "HEAD" or resp.status in (204, 304):
                h.send_response(resp.status)
                for k, v in resp_headers:
                    h.send_header(k, v)
                h.end_headers()
                return
            if declared is None:  # chunked upstream: buffer it (manifests and errors, small)
                data = resp.read()
                resp_headers.append(("Content-Length", str(len(data))))
                h.send_response(resp.status)
                for k, v in resp_headers:
                    h.send_header(k, v)
                h.end_headers()
                h.wfile.write(data)
                return
            h.send_response(resp.status)
            for k, v in resp_headers:
                h.send_header(k, v)
            h.end_headers()
            self._stream(h, resp, int(declared))
        finally:
            conn.close()

    def _stream(self, h: BaseHTTPRequestHandler, resp: http.client.HTTPResponse, declared: int) -> None:
        with self._lock:
            st = self._stall if (self._stall and h.command == "GET" and self._stall.match in h.path
                                 and not self._stall.stalled.is_set()) else None
        sent = 0
        while sent < declared:
            want = 1 << 16
            if st is not None and not st.stalled.is_set():
                want = min(want, st.after - sent) or 1 << 16
            try:
                chunk = resp.read(min(want, declared - sent))
            except (OSError, http.client.HTTPException):
                chunk = b""
            if not chunk:
                # the upstream went away mid-body: cut the client off too (short body, then close)
                h.close_connection = True
                return
            try:
                h.wfile.write(chunk)
                h.wfile.flush()
            except OSError:
                h.close_connection = True
                return
            sent += len(chunk)
            if st is not None and not st.stalled.is_set() and sent >= st.after:
                st.sent = sent
                st.stalled.set()
                st.release.wait(600)


def _repo_of(path: str) -> str | None:
    if not path.startswith("/v2/"):
        return None
    rest = path[4:]
    for marker in ("/manifests/", "/blobs/", "/tags/"):
        i = rest.find(marker)
        if i > 0:
            return rest[:i]
    return None


def _read_chunked(rfile) -> bytes:
    out = bytearray()
    while True:
        line = rfile.readline()
        size = int(line.split(b";", 1)[0].strip() or b"0", 16)
        if size == 0:
            while rfile.readline() not in (b"\r\n", b"\n", b""):
                pass
            return bytes(out)
        out += rfile.read(size)
        rfile.readline()


# --------------------------------------------------------------------------
# a small busybox rootfs as a spec (a runnable base that is not 300 MB)
# --------------------------------------------------------------------------

BUSYBOX_APPLETS = ["sh", "ash", "echo", "cat", "ls", "sleep", "tail", "ps", "id", "pwd", "env", "true", "false",
                   "mkdir", "rm", "uname", "sha256sum", "stat", "hostname", "grep", "tr", "head", "seq", "test",
                   "find", "wc", "readlink", "touch", "ln", "cut", "sort", "du"]


def busybox_path() -> str | None:
    for cand in ("/bin/busybox", "/usr/bin/busybox"):
        if os.path.isfile(cand):
            return cand
    return None


def busybox_spec(marker: str = "") -> dict[str, Any]:
    """A minimal runnable root filesystem: static busybox and its applets in /bin, /etc/passwd+group,
    the usual empty dirs. `marker` goes into /etc/e2e-base (a different marker, a different layer)."""
    bb = busybox_path()
    if bb is None:
        raise RuntimeError("static busybox not found (apt-get install busybox-static)")
    spec: dict[str, Any] = {}
    for d in ("bin", "etc", "tmp", "proc", "dev", "sys", "root", "workspace", "usr", "var"):
        spec[d] = ("dir", 0o1777 if d == "tmp" else 0o755)
    spec["bin/busybox"] = ("file", Path(bb).read_bytes(), 0o755)
    for a in BUSYBOX_APPLETS:
        spec[f"bin/{a}"] = ("symlink", "busybox")
    spec["etc/passwd"] = "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534::/:/bin/false\n"
    spec["etc/group"] = "root:x:0:\nnogroup:x:65534:\n"
    spec["etc/e2e-base"] = f"busybox base {marker}\n"
    return spec


# --------------------------------------------------------------------------
# Warren config snippets
# --------------------------------------------------------------------------

def registries_toml(entries: Mapping[str, Mapping[str, Any]]) -> str:
    """`[registries."host"]` tables from {host: {key: value}} (str, bool, list of str)."""
    def value(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (list, tuple)):
            return "[" + ", ".join(value(x) for x in v) + "]"
        return json.dumps(str(v))
    out = []
    for host, keys in entries.items():
        out.append(f'[registries."{host}"]')
        out += [f"{k} = {value(v)}" for k, v in keys.items()]
        out.append("")
    return "\n".join(out)
