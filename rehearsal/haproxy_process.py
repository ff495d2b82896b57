"""One HAProxy in master-worker mode running what haproxy_config.py renders (docs/rehearsal.md, "The
gateway"): started, changed without dropping a connection, stopped.

    ProxyConfig  --HAProxy.start / HAProxy.apply-->  a running haproxy -W

Applying a change (`HAProxy.apply`), without dropping a connection:

- **Only weights changed** (a red-black step: same backends, same pods): the runtime API, `set server <backend>/
  <server> weight <w>` over the admin socket, raises before it lowers, so no backend is ever without weight. The
  process, its connections and its listening sockets stay; the next request (or gRPC stream, even on an open HTTP/2
  connection) is balanced by the new weights. A reload would instead leave every open connection on the old worker,
  with the old weights, until it is closed.
- **Anything else** (a pod Ready or gone, a backendRef or a route added or removed): a seamless reload of HAProxy's
  master-worker mode (`haproxy -W`, SIGUSR2 to the master). The new configuration is checked first (`haproxy -c`);
  the new worker receives the listening sockets from the old one (the same socket, so no connection is refused
  and none waiting in its accept queue is lost); the old worker finishes what it serves and leaves (HTTP/2 clients
  get a GOAWAY and move to the new worker), bounded by `hard-stop-after`. An idle HTTP/1.1 keep-alive connection
  would be closed by the old worker at the moment a client may be sending on it (HAProxy 2.6 has no
  `idle-close-on-response`), so HTTP/1.1 client connections carry one request each (`Connection: close`): the
  reload is the rehearsal's artifact (Envoy takes route and endpoint changes over xDS without draining), and this
  keeps it from failing requests that production would not fail. gRPC (HTTP/2) connections are kept alive.

The runtime API alone cannot add a backend or a `use_backend` rule, and its `add server`/`del server` refuse a server
that still holds idle connections (HTTP/2 backends always do), hence the reload for structural changes.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from rehearsal.haproxy_config import ProxyConfig


class ProxyError(RuntimeError):
    """HAProxy refused a configuration, did not start, or did not reload."""


def _unix_command(path: Path, command: str, timeout: float = 5.0) -> str:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(str(path))
        s.sendall(command.encode() + b"\n")
        s.shutdown(socket.SHUT_WR)
        chunks = []
        while data := s.recv(65536):
            chunks.append(data)
    return b"".join(chunks).decode(errors="replace")


@dataclass
class HAProxy:
    """One HAProxy in master-worker mode (`haproxy -W -db -S <master socket> -f <config>`), its files in `workdir`."""

    workdir: Path
    binary: str = "haproxy"
    process: subprocess.Popen | None = None
    config: ProxyConfig | None = None
    reloads: int = 0
    weight_updates: int = 0

    @property
    def config_path(self) -> Path:
        return self.workdir / "haproxy.cfg"

    @property
    def master_socket(self) -> Path:
        return self.workdir / "master.sock"

    @property
    def log_path(self) -> Path:
        return self.workdir / "haproxy.log"

    def check(self, text: str) -> None:
        candidate = self.workdir / "haproxy.cfg.new"
        candidate.write_text(text)
        proc = subprocess.run([self.binary, "-c", "-q", "-f", str(candidate)], capture_output=True, text=True)
        if proc.returncode != 0:
            raise ProxyError(f"haproxy -c refused the configuration ({candidate}):\n{(proc.stderr or proc.stdout)}")

    def _install(self, config: ProxyConfig) -> None:
        self.check(config.text)
        (self.workdir / "haproxy.cfg.new").replace(self.config_path)

    def start(self, config: ProxyConfig, timeout: float = 15) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._install(config)
        for path in (self.master_socket, config.admin_socket):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        with open(self.log_path, "a") as log:
            self.process = subprocess.Popen(
                [self.binary, "-W", "-db", "-S", f"{self.master_socket},mode,600", "-f", str(self.config_path)],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        self.config = config
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                raise ProxyError(f"haproxy exited with {self.process.returncode}: {self.log_tail()}")
            with contextlib.suppress(OSError):
                workers = self.workers()[0]
                if workers and self._admin_pid() in workers:
                    return
            if time.monotonic() > deadline:
                raise ProxyError(f"haproxy not up within {timeout}s: {self.log_tail()}")
            time.sleep(0.05)

    def log_tail(self, lines: int = 20) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def runtime(self, command: str) -> str:
        """A runtime API command on the current worker (the admin socket)."""
        if self.config is None:
            raise ProxyError("haproxy is not started")
        return _unix_command(self.config.admin_socket, command)

    def master(self, command: str) -> str:
        return _unix_command(self.master_socket, command)

    def _admin_pid(self) -> int | None:
        for line in self.runtime("show info").splitlines():
            if line.startswith("Pid:"):
                return int(line.split(":", 1)[1])
        return None

    def workers(self) -> tuple[list[int], list[int], int, int]:
        """(current worker pids, old worker pids still draining, reloads, failed reloads) from the master."""
        current: list[int] = []
        old: list[int] = []
        reloads = failed = 0
        section = None
        for line in self.master("show proc").splitlines():
            if line.startswith("# workers"):
                section = current
            elif line.startswith("# old workers"):
                section = old
            elif line.startswith("#"):
                section = None
            elif line.split()[1:2] == ["master"]:
                found = re.search(r"\s(\d+) \[failed: (\d+)\]", line)
                if found:
                    reloads, failed = int(found.group(1)), int(found.group(2))
            elif section is not None and line.strip():
                section.append(int(line.split()[0]))
        return current, old, reloads, failed

    def apply(self, config: ProxyConfig, timeout: float = 15) -> str:
        """Make `config` the running one: "unchanged", "weights" (the runtime API) or "reload" (see the module)."""
        if self.config is None or self.process is None:
            raise ProxyError("haproxy is not started")
        if config.text == self.config.text:
            return "unchanged"
        if config.skeleton == self.config.skeleton and config.admin_socket == self.config.admin_socket:
            self._set_weights(config)
            return "weights"
        self.reload(config, timeout)
        return "reload"

    def _set_weights(self, config: ProxyConfig) -> None:
        assert self.config is not None
        changed = [(key, w) for key, w in config.weights.items() if self.config.weights.get(key) != w]
        old = self.config.weights
        # raise first, lower last: a backend never has all its servers at weight 0 in between
        changed.sort(key=lambda kw: kw[1] <= old.get(kw[0], 0))
        self._install(config)  # a later reload (or a restart) keeps these weights
        for (backend, server), weight in changed:
            answer = self.runtime(f"set server {backend}/{server} weight {weight}").strip()
            if answer:
                raise ProxyError(f"set server {backend}/{server} weight {weight}: {answer}")
        self.config = config
        self.weight_updates += 1

    def reload(self, config: ProxyConfig, timeout: float = 15) -> None:
        assert self.process is not None
        self._install(config)
        before, _, reloads, failed = self.workers()
        os.kill(self.process.pid, signal.SIGUSR2)
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(OSError, ValueError, IndexError):
                current, _, now_reloads, now_failed = self.workers()
                if now_failed > failed:
                    raise ProxyError(f"haproxy's reload failed: {self.log_tail()}")
                if now_reloads > reloads and current and not set(current) & set(before):
                    self.config = config
                    if self._admin_pid() in current:  # the admin socket is the new worker's
                        self.reloads += 1
                        return
            if self.process.poll() is not None:
                raise ProxyError(f"haproxy exited with {self.process.returncode}: {self.log_tail()}")
            if time.monotonic() > deadline:
                raise ProxyError(f"haproxy did not reload within {timeout}s: {self.log_tail()}")
            time.sleep(0.05)

    def wait_drained(self, timeout: float = 30) -> None:
        """Until no old worker is left: every connection the previous configuration accepted has ended (an HTTP/2
        client's after its GOAWAY), so every request from now on is routed by the current configuration."""
        deadline = time.monotonic() + timeout
        while self.workers()[1]:
            if time.monotonic() > deadline:
                raise ProxyError(f"old workers {self.workers()[1]} still serve after {timeout}s")
            time.sleep(0.05)

    def stop(self, timeout: float = 10) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()  # the master stops its workers
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
