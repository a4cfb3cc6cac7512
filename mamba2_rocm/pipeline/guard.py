"""The pipeline under faults: cancelled, concurrent and starved builds leave nothing behind.

- **Cancellation.** The long commands (``build``, ``reproducibility``, ``toolchain``,
  ``gpu-tests``) run inside :func:`cancellable`: SIGINT, SIGTERM and SIGHUP raise
  :class:`Cancelled` in the main thread, so every ``with`` block unwinds (temporary folders
  removed) and the command exits ``128 + signal`` naming the stage it stopped in. Every
  container gets a name and labels (:func:`container_args`); an interrupted ``docker run`` kills
  its container before the exception goes on (:func:`stop_container`). Killing the ``docker
  run`` client alone does not stop the container (it ran on for about a minute, still
  compiling, before this); ``--init`` also gives the container a PID 1 that passes signals on.
- **One build per output folder.** :func:`output_lock` takes ``wheels/.<target>.lock`` with
  ``fcntl.flock`` (released by the kernel when the process dies, however it dies) and writes the
  holder's pid, command and start time into it, which a second build's refusal names.
- **Atomic outputs.** :func:`replace_dir` swaps a fully written folder with the old one in a
  single ``renameat2(RENAME_EXCHANGE)`` (Linux; ctypes, since ``os`` has no binding), so a reader
  sees the old complete set or the new one (the old one stays as ``.<target>.previous`` until
  the next swap, for readers that listed it); where the call is missing it falls back to two
  renames.
- **Stale state.** :func:`clean_stale` removes what a killed run (SIGKILL, a lost machine) left:
  temporary folders and half-written output folders named after a pid that no longer runs, and
  containers labelled with such a pid on this host.
- **Fault injection for tests.** ``MAMBA2_ROCM_PIPELINE_FAULT=<stage>:<SIGNAL>[:<seconds>]``
  sends the signal to this process when that stage starts (or that many seconds into it).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import itertools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

__all__ = [
    "FAULT_ENV",
    "LABEL_HOST",
    "LABEL_PID",
    "Cancelled",
    "LockBusy",
    "cancellable",
    "clean_stale",
    "container_args",
    "container_name",
    "current_stage",
    "enter_stage",
    "output_lock",
    "pid_alive",
    "replace_dir",
    "stop_container",
    "temporary_folder",
]

FAULT_ENV = "MAMBA2_ROCM_PIPELINE_FAULT"
LABEL_PID = "org.mamba2-rocm.pid"
LABEL_HOST = "org.mamba2-rocm.host"
SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
#: temporary folders: m2r-<kind>-<pid>-<random>; staged outputs: .<target>.new-<pid>
_TEMP_RE = re.compile(r"^m2r-(?:build|repro|gpu)-(\d+)-")
_STAGED_RE = re.compile(r"^\.(.+)\.new-(\d+)$")

_stage: list[str] = []  # the stage now running (a stack: stages do not nest today, tests may)
_names = itertools.count()


class Cancelled(BaseException):
    """A signal stopped the command; ``exit_code`` is 128 + the signal's number."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        self.stage = current_stage()
        super().__init__(signal.Signals(signum).name)

    @property
    def exit_code(self) -> int:
        return 128 + self.signum

    def message(self, command: str) -> str:
        where = f" during stage {self.stage!r}" if self.stage else ""
        return f"cancelled by {self.args[0]}{where} of `{command}`"


class LockBusy(RuntimeError):
    """Another process holds an output folder."""


# ---- stages and cancellation ------------------------------------------------------------------


def current_stage() -> str | None:
    return _stage[-1] if _stage else None


@contextlib.contextmanager
def enter_stage(name: str) -> Iterator[None]:
    """Mark ``name`` as the running stage (what a cancellation's message names), and fire the
    test hook when it names this stage."""
    _stage.append(name)
    timer = None
    try:
        timer = _fault_for(name)
        yield
    finally:
        if timer is not None:
            timer.cancel()
        _stage.pop()


def _fault_for(stage: str) -> threading.Timer | None:
    spec = os.environ.get(FAULT_ENV, "")
    if not spec:
        return None
    parts = spec.split(":")
    if len(parts) not in (2, 3) or parts[0] != stage:
        return None
    signum = signal.Signals[parts[1]]
    delay = float(parts[2]) if len(parts) == 3 else 0.0
    if delay <= 0:
        os.kill(os.getpid(), signum)
        return None
    timer = threading.Timer(delay, os.kill, (os.getpid(), signum))
    timer.daemon = True
    timer.start()
    return timer


@contextlib.contextmanager
def cancellable(signals: Iterable[int] = SIGNALS) -> Iterator[None]:
    """Turn ``signals`` into :class:`Cancelled` in the main thread for the block's duration.
    The first signal wins: later ones are ignored while the command unwinds (a process group's
    SIGTERM often comes twice, from the terminal and from nox), so its cleanup finishes."""
    signals = tuple(signals)

    def handler(signum, _frame):
        for s in signals:
            signal.signal(s, signal.SIG_IGN)
        raise Cancelled(signum)

    old = {s: signal.signal(s, handler) for s in signals}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


# ---- containers ---------------------------------------------------------------------------------


def container_name(kind: str = "run") -> str:
    return f"m2r-{kind}-{os.getpid()}-{next(_names)}"


def container_args(name: str) -> list[str]:
    """``docker run`` options naming the container and labelling it with its owner (pid and
    host: :func:`clean_stale` removes those whose owner is gone), with an init process."""
    return ["--name", name, "--label", f"{LABEL_PID}={os.getpid()}",
            "--label", f"{LABEL_HOST}={socket.gethostname()}", "--init"]  # fmt: skip


def stop_container(name: str, timeout: float = 30) -> None:
    """Kill and remove a container (quietly: it may have ended on its own), and return once it
    is gone or ``timeout`` seconds have passed. A container run with ``--rm`` is removed by the
    daemon after the kill, and ``rm -f`` then fails at once ("removal already in progress")
    while it may still be listed: on a loaded machine, for long enough that a caller's next
    ``docker ps`` saw it."""
    deadline = time.monotonic() + timeout
    for cmd in (["docker", "kill", name], ["docker", "rm", "-f", name]):
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            subprocess.run(cmd, capture_output=True, timeout=timeout)
    while time.monotonic() < deadline:
        try:
            listed = subprocess.run(["docker", "container", "inspect", "--format", "{{.Id}}", name],
                                    capture_output=True, timeout=timeout)  # fmt: skip
        except (OSError, subprocess.TimeoutExpired):
            return
        if listed.returncode != 0:  # no such container
            return
        time.sleep(0.1)


def _own_containers() -> list[tuple[str, int]]:
    """(name, owner pid) of this host's labelled containers, running or not."""
    fmt = f'{{{{.Names}}}} {{{{.Label "{LABEL_PID}"}}}} {{{{.Label "{LABEL_HOST}"}}}}'
    try:
        proc = subprocess.run(["docker", "ps", "-a", "--filter", f"label={LABEL_PID}",
                               "--format", fmt], capture_output=True, text=True, timeout=60)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return []
    if proc.returncode != 0:
        return []
    out = []
    host = socket.gethostname()
    for line in proc.stdout.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[2] == host and parts[1].isdigit():
            out.append((parts[0], int(parts[1])))
    return out


# ---- stale state --------------------------------------------------------------------------------


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def temporary_folder(kind: str) -> Iterator[Path]:
    """A temporary folder named after this process (``m2r-<kind>-<pid>-...``), so that one a
    killed run leaves is recognised as stale by the next; removed on the way out."""
    with tempfile.TemporaryDirectory(prefix=f"m2r-{kind}-{os.getpid()}-") as tmp:
        yield Path(tmp)


def clean_stale(out_root: Path | None = None, log=print, docker: bool = True) -> list[str]:
    """Remove what killed runs left (their pid no longer runs): temporary folders, staged output
    folders under ``out_root`` and this host's labelled containers. Returns what was removed."""
    removed = []
    for path in Path(tempfile.gettempdir()).glob("m2r-*"):
        m = _TEMP_RE.match(path.name)
        if m and path.is_dir() and not pid_alive(int(m.group(1))):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(str(path))
    if out_root is not None and out_root.is_dir():
        for path in out_root.iterdir():
            m = _STAGED_RE.match(path.name)
            if m and path.is_dir() and not pid_alive(int(m.group(2))):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(str(path))
    if docker and shutil.which("docker"):
        for name, pid in _own_containers():
            if not pid_alive(pid):
                stop_container(name)
                removed.append(f"container {name}")
    for what in removed:
        log(f"removed what a killed run left: {what}")
    return removed


# ---- one build per output folder ----------------------------------------------------------------


def _holder(path: Path) -> str:
    try:
        info = json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        info = {}
    if not info:
        return "another process"
    return f"pid {info.get('pid')} (`{info.get('command')}`, since {info.get('since')})"


@contextlib.contextmanager
def output_lock(out_root: Path, targets: Iterable[str], wait: float = 0.0,
                log=print) -> Iterator[None]:  # fmt: skip
    """Hold ``out_root/.<target>.lock`` for every target (in sorted order: no deadlock between
    overlapping sets). A held lock is waited for up to ``wait`` seconds (``inf``: for good),
    else :class:`LockBusy` names its holder."""
    out_root.mkdir(parents=True, exist_ok=True)
    import fcntl

    held: list[int] = []
    try:
        for target in sorted(set(targets)):
            path = out_root / f".{target}.lock"
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            deadline = time.monotonic() + wait
            told = False
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    holder = _holder(path)
                    if time.monotonic() >= deadline:
                        os.close(fd)
                        raise LockBusy(
                            f"{out_root / target} is being written by {holder}; wait for it "
                            "(--wait SECONDS) or stop it — one build per output folder"
                        ) from None
                    if not told:
                        log(f"waiting for {out_root / target}: held by {holder}")
                        told = True
                    time.sleep(0.5)
            held.append(fd)
            argv = list(getattr(sys, "orig_argv", sys.argv))  # (python -m ... as typed)
            info = {"pid": os.getpid(), "command": " ".join([Path(argv[0]).name, *argv[1:]]),
                    "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")}  # fmt: skip
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(info).encode(), 0)
        yield
    finally:
        for fd in reversed(held):
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
                fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)


# ---- atomic outputs -----------------------------------------------------------------------------

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux renameat2); False where the system cannot."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                          ctypes.c_uint]  # fmt: skip
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _fsync_tree(root: Path) -> None:
    for path in [*sorted(root.rglob("*")), root]:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def replace_dir(new: Path, dest: Path) -> None:
    """Put the fully written folder ``new`` at ``dest`` (a sibling of it), replacing what was
    there at once: a reader sees the old set or the new one, never a mix. The old set is kept
    as ``.<name>.previous`` until the next swap, so a reader that listed it just before can
    still open its files."""
    _fsync_tree(new)
    previous = dest.with_name(f".{dest.name}.previous")
    shutil.rmtree(previous, ignore_errors=True)
    if not dest.exists():
        os.rename(new, dest)
    elif _exchange(new, dest):
        os.rename(new, previous)  # (new now holds the old set)
    else:  # two renames: for a moment there is no dest (never a mixed one)
        os.rename(dest, previous)
        os.rename(new, dest)
    with contextlib.suppress(OSError):
        fd = os.open(dest.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
