"""A second Docker daemon on "another host": Debian's dockerd started in a network namespace of its
own (reached over a veth link at 10.248.N.2, this host's side 10.248.N.1), listening on TCP with TLS
and client certificates (`--tlsverify`), with a bridge network and iptables inside its namespace.
Nothing of this host's filesystem is mounted into its containers by Warren, and the only way to them
is the network, as with a daemon on another machine. The namespace has no route beyond its link.

The certificates (a test CA, the daemon's, Warren's client certificate and one from another CA) are
made with openssl in the test's work folder.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path


def _run(*argv: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), check=True, capture_output=True, text=True, timeout=60, **kw)


def _openssl_pair(folder: Path, name: str, subject: str, ca: tuple[Path, Path] | None, ext: str) -> None:
    """`name.pem` and `name-key.pem` in `folder`: an EC key and a certificate signed by `ca` (or
    self-signed when `ca` is None, for a CA)."""
    key, cert = folder / f"{name}-key.pem", folder / f"{name}.pem"
    if ca is None:
        _run("openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-days", "2", "-subj", subject, "-keyout", str(key), "-out", str(cert))
        return
    csr, extfile = folder / f"{name}.csr", folder / f"{name}.ext"
    extfile.write_text(ext)
    _run("openssl", "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
         "-subj", subject, "-keyout", str(key), "-out", str(csr))
    _run("openssl", "x509", "-req", "-in", str(csr), "-CA", str(ca[0]), "-CAkey", str(ca[1]),
         "-CAcreateserial", "-days", "2", "-extfile", str(extfile), "-out", str(cert))


def _mounts_under(root: Path) -> list[str]:
    prefix = str(root) + "/"
    out = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        target = line.split()[4].replace("\\040", " ")
        if target.startswith(prefix):
            out.append(target)
    return out


class RemoteDocker:
    """dockerd in its own network namespace, on TCP with TLS. `client_certs` is a folder in Docker's
    `DOCKER_CERT_PATH` layout (ca.pem, cert.pem, key.pem) for Warren; `stranger_certs` the same with
    a client certificate from another CA."""

    def __init__(self, root: Path, index: int = 1) -> None:
        self.root = root / f"remote-docker-{os.getpid()}-{index}"
        self.root.mkdir(parents=True, exist_ok=True)
        self.netns = f"wrd-{os.getpid()}-{index}"
        self.host_if, self.ns_if = f"wrdh{index}x{os.getpid() % 1000}", f"wrdn{index}x{os.getpid() % 1000}"
        self.ip = f"10.248.{index}.2"
        self.host_ip = f"10.248.{index}.1"
        self.port = 2376
        self.proc: subprocess.Popen | None = None
        self.log_path = self.root / "dockerd.log"
        try:
            self._certs()
            self._network()
            self._start()
        except BaseException:
            self.close()
            raise

    @property
    def host(self) -> str:
        return f"tcp://{self.ip}:{self.port}"

    def _certs(self) -> None:
        pki = self.root / "pki"
        pki.mkdir(exist_ok=True)
        _openssl_pair(pki, "ca", "/CN=warren-e2e-docker-ca", None, "")
        ca = (pki / "ca.pem", pki / "ca-key.pem")
        _openssl_pair(pki, "server", "/CN=docker-remote", ca,
                      f"subjectAltName=IP:{self.ip}\nextendedKeyUsage=serverAuth\n")
        _openssl_pair(pki, "client", "/CN=warren", ca, "extendedKeyUsage=clientAuth\n")
        _openssl_pair(pki, "other-ca", "/CN=someone-else", None, "")
        _openssl_pair(pki, "stranger", "/CN=stranger", (pki / "other-ca.pem", pki / "other-ca-key.pem"),
                      "extendedKeyUsage=clientAuth\n")
        self.client_certs = self.root / "client"
        self.stranger_certs = self.root / "stranger"
        for folder, name in ((self.client_certs, "client"), (self.stranger_certs, "stranger")):
            folder.mkdir(exist_ok=True)
            (folder / "ca.pem").write_bytes((pki / "ca.pem").read_bytes())
            (folder / "cert.pem").write_bytes((pki / f"{name}.pem").read_bytes())
            (folder / "key.pem").write_bytes((pki / f"{name}-key.pem").read_bytes())
        self.pki = pki

    def _network(self) -> None:
        _run("ip", "netns", "add", self.netns)
        _run("ip", "link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if)
        _run("ip", "link", "set", self.ns_if, "netns", self.netns)
        _run("ip", "addr", "add", f"{self.host_ip}/30", "dev", self.host_if)
        _run("ip", "link", "set", self.host_if, "up")
        _run("ip", "-n", self.netns, "addr", "add", f"{self.ip}/30", "dev", self.ns_if)
        _run("ip", "-n", self.netns, "link", "set", self.ns_if, "up")
        _run("ip", "-n", self.netns, "link", "set", "lo", "up")

    def _start(self) -> None:
        (self.root / "daemon.json").write_text('{"live-restore": false}\n')
        # nsenter, not `ip netns exec`: the latter remounts /sys, hiding the cgroup mounts dockerd needs.
        argv = ["nsenter", f"--net=/run/netns/{self.netns}", "dockerd",
                "--config-file", str(self.root / "daemon.json"),
                "-H", self.host, "--tlsverify",
                "--tlscacert", str(self.pki / "ca.pem"),
                "--tlscert", str(self.pki / "server.pem"), "--tlskey", str(self.pki / "server-key.pem"),
                "--pidfile", str(self.root / "dockerd.pid"),
                "--exec-root", str(self.root / "exec"), "--data-root", str(self.root / "data")]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                         start_new_session=True)
        deadline = time.time() + 60
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"dockerd exited: {self.log_tail()}")
            if self.docker("version", check=False).returncode == 0:
                return
            time.sleep(0.3)
        raise RuntimeError(f"dockerd did not answer within 60 s: {self.log_tail()}")

    def env(self, certs: Path | None = None) -> dict[str, str]:
        env = dict(os.environ)
        env.update(DOCKER_HOST=self.host, DOCKER_TLS_VERIFY="1", DOCKER_CERT_PATH=str(certs or self.client_certs))
        return env

    def docker(self, *args: str, check: bool = True, stdin=None) -> subprocess.CompletedProcess:
        return subprocess.run(["docker", *args], env=self.env(), capture_output=True, text=True, timeout=120,
                              check=check, stdin=stdin)

    def import_rootfs(self, name: str, rootfs: Path) -> None:
        if self.docker("image", "inspect", name, check=False).returncode == 0:
            return
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        res = self.docker("import", "-", name, check=False, stdin=tar.stdout)
        tar.stdout.close()
        tar.wait()
        if res.returncode != 0:
            raise AssertionError(f"docker import {name} failed: {res.stderr}")

    def containers(self) -> list[str]:
        out = self.docker("ps", "-aq", "--no-trunc").stdout
        return [line for line in out.split() if line]

    def inspect(self, container: str) -> dict:
        import json
        return json.loads(self.docker("inspect", container).stdout)[0]

    def log_tail(self, n: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def close(self) -> None:
        """Stops the daemon (its containers with it: no live-restore) and removes the namespace."""
        if self.proc is not None and self.proc.poll() is None:
            for c in self.containers() if self.proc.poll() is None else []:
                self.docker("rm", "-f", c, check=False)
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        # What dockerd leaves mounted in its folders (its network namespace's handle, say).
        for target in reversed(_mounts_under(self.root)):
            subprocess.run(["umount", "-l", target], capture_output=True, timeout=10)
        subprocess.run(["ip", "link", "del", self.host_if], capture_output=True, timeout=10)
        subprocess.run(["ip", "netns", "del", self.netns], capture_output=True, timeout=10)
        subprocess.run(["rm", "-rf", "--one-file-system", str(self.root / "data")], capture_output=True,
                       timeout=120)
