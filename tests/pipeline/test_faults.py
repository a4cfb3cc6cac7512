"""The pipeline under faults (mamba2_rocm.pipeline.guard): a build cancelled at any stage, two
builds of one target, a full disk at the write stage, a reader during the swap, what killed
runs leave (temporary folders, staged outputs, containers), a toolchain image deleted mid-way
and a half-written JIT cache entry. The stages here are stand-ins (no Docker), so every fault
is injected at every stage in a second; the Docker-marked tests at the end do it for real."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import types
from pathlib import Path

import pytest

from mamba2_rocm.pipeline import __main__ as cli
from mamba2_rocm.pipeline import guard, images, package, stages
from mamba2_rocm.pipeline.recipes import get_recipe

REPO = Path(__file__).resolve().parents[2]
STAGES = ["toolchain image", "export source", "audit", "compile", "verify", "package",
          "smoke test", "write"]  # fmt: skip
OLD = {"mamba2_rocm-0.9-py3-none-any.whl": b"old host", "build-manifest.json": b'{"old": 1}'}


def _temps() -> set[str]:
    return {p.name for p in Path(tempfile.gettempdir()).glob(f"m2r-build-{os.getpid()}-*")}


@pytest.fixture
def fake_build(monkeypatch, tmp_path):
    """Every stage of build_targets with stand-ins that write small files; returns the output
    root, holding the old set of wheels/gfx1030/."""
    monkeypatch.setattr(images, "docker_check", lambda: "fake")
    monkeypatch.setattr(images, "ensure_toolchain", lambda r, mirror=None, log=print: "img:1")
    monkeypatch.setattr(images, "image_id", lambda image: "sha256:1")
    monkeypatch.setattr(images, "dpkg_versions", lambda image, pkgs: {})
    monkeypatch.setattr(package, "work_tree_dirty", lambda: False)
    monkeypatch.setattr(package, "export_commit", lambda export: export.mkdir() or "c0ffee")
    monkeypatch.setattr(package, "source_date_epoch", lambda export: "0")
    monkeypatch.setattr(stages, "_audit", lambda img, export, scratch: {"tools": [], "env": []})

    def compile_(recipes, image, export, out, jobs):
        for arch in recipes[0].archs:
            (out / arch).mkdir(parents=True)
            (out / arch / "manifest.json").write_text(json.dumps({"code_objects": []}))

    monkeypatch.setattr(stages, "_compile", compile_)
    monkeypatch.setattr(stages, "verify_kernel_dir", lambda recipe, kernels: {})

    def wheel(name):
        def build(*args):
            dist = next(a for a in args if isinstance(a, Path))
            dist.mkdir(parents=True, exist_ok=True)
            path = dist / name
            path.write_bytes(name.encode())
            return path

        return build

    monkeypatch.setattr(package, "build_host_wheel", wheel("mamba2_rocm-1.0-py3-none-any.whl"))
    monkeypatch.setattr(
        package, "build_dropin_wheel", wheel("mamba2_rocm_dropin-1.0-py3-none-any.whl")
    )
    monkeypatch.setattr(
        package, "build_target_wheel", wheel("mamba2_rocm_gfx1030-1.0-py3-none-any.whl")
    )
    monkeypatch.setattr(stages, "_smoke_test", lambda *a: {})
    root = tmp_path / "wheels"
    (root / "gfx1030").mkdir(parents=True)
    for name, data in OLD.items():
        (root / "gfx1030" / name).write_bytes(data)
    return root


def _old_set_intact(root: Path) -> bool:
    d = root / "gfx1030"
    return {p.name: p.read_bytes() for p in d.iterdir()} == OLD


def test_a_build_writes_the_new_set(fake_build, capsys):
    assert cli.main(["build", "gfx1030", "--out", str(fake_build)]) == 0
    names = sorted(p.name for p in (fake_build / "gfx1030").iterdir())
    assert names == ["build-manifest.json", "mamba2_rocm-1.0-py3-none-any.whl",
                     "mamba2_rocm_dropin-1.0-py3-none-any.whl",
                     "mamba2_rocm_gfx1030-1.0-py3-none-any.whl"]  # fmt: skip
    # the old set stays beside it until the next build (for a reader that listed it)
    assert sorted(p.name for p in fake_build.iterdir()) == [".gfx1030.lock", ".gfx1030.previous",
                                                            "gfx1030"]  # fmt: skip
    assert {p.name: p.read_bytes() for p in (fake_build / ".gfx1030.previous").iterdir()} == OLD
    assert not _temps()


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM", "SIGHUP"])
@pytest.mark.parametrize("stage", STAGES)
def test_a_signal_at_any_stage_leaves_nothing_and_names_the_stage(fake_build, monkeypatch, capsys,
                                                                   stage, sig):  # fmt: skip
    monkeypatch.setenv(guard.FAULT_ENV, f"{stage}:{sig}")
    handlers = {s: signal.getsignal(s) for s in guard.SIGNALS}
    rc = cli.main(["build", "gfx1030", "--out", str(fake_build)])
    err = capsys.readouterr().err
    assert rc == 128 + signal.Signals[sig]
    assert (
        f"cancelled by {sig} during stage {stage!r} of `python -m mamba2_rocm.pipeline build" in err
    )
    assert _old_set_intact(fake_build), "the previous outputs must stay as they were"
    assert sorted(p.name for p in fake_build.iterdir()) == [".gfx1030.lock", "gfx1030"]
    assert not _temps(), "temporary folders must be removed"
    assert {s: signal.getsignal(s) for s in guard.SIGNALS} == handlers


@pytest.mark.parametrize(("listed_for", "polls"), [(0, 1), (3, 4), (None, None)])
def test_stop_container_returns_once_the_container_is_gone(monkeypatch, listed_for, polls):
    """stop_container kills, removes, then waits while `docker container inspect` still finds
    the container (a --rm container's removal by the daemon outlives `rm -f`, which fails at
    once): it returns at the first miss, or at its timeout if the container stays listed."""
    calls = []

    def run(cmd, capture_output=True, timeout=None):
        calls.append(cmd[1])
        listed = cmd[1] == "container" and (
            listed_for is None or calls.count("container") <= listed_for
        )
        return subprocess.CompletedProcess(cmd, 0 if listed or cmd[1] == "kill" else 1)

    clock = iter(range(1000))  # 0.01 s a reading, no real sleep (guard's own time only)
    monkeypatch.setattr(guard, "subprocess", types.SimpleNamespace(
        run=run, TimeoutExpired=subprocess.TimeoutExpired))  # fmt: skip
    monkeypatch.setattr(guard, "time", types.SimpleNamespace(monotonic=lambda: next(clock) * 0.01,
                                                              sleep=lambda s: None))  # fmt: skip
    guard.stop_container("m2r-run-1-0", timeout=0.5)
    assert calls[:2] == ["kill", "rm"]
    if polls is None:  # still listed: given up at the timeout (0.5 s of 0.01 s ticks)
        assert 40 <= calls.count("container") <= 50
    else:
        assert calls.count("container") == polls


def test_an_interrupted_container_is_stopped(monkeypatch):
    """A signal (or timeout) while `docker run` waits kills the named container, not just the
    client: the client dying alone leaves the container running."""
    calls = []

    def docker(*args, check=True, capture=True, timeout=None):
        calls.append(args)
        raise guard.Cancelled(signal.SIGTERM)

    monkeypatch.setattr(images, "_docker", docker)
    stopped = []
    monkeypatch.setattr(guard, "stop_container", stopped.append)
    with pytest.raises(guard.Cancelled):
        images.run_in_image("img", ["true"], REPO, REPO / "build")
    args = calls[0]
    name = args[args.index("--name") + 1]
    assert stopped == [name] and "--init" in args
    assert f"{guard.LABEL_PID}={os.getpid()}" in args


def _hold_lock(root: Path) -> subprocess.Popen:
    code = ("import sys, time; from pathlib import Path; from mamba2_rocm.pipeline import guard\n"
            "with guard.output_lock(Path(sys.argv[1]), ['gfx1030']):\n"
            "    print('held', flush=True); time.sleep(60)")  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-c", code, str(root)], stdout=subprocess.PIPE,
                            text=True, cwd=REPO)  # fmt: skip
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_build_of_the_same_target_is_refused_naming_the_holder(fake_build, capsys):
    holder = _hold_lock(fake_build)
    try:
        assert cli.main(["build", "gfx1030", "--out", str(fake_build)]) == 1
        err = capsys.readouterr().err
        assert f"{fake_build / 'gfx1030'} is being written by pid {holder.pid}" in err
        assert "one build per output folder" in err
        assert _old_set_intact(fake_build)
        # build-all beside it: refused before any work, for the held target
        assert cli.main(["build", "gfx1030", "gfx1101", "--out", str(fake_build)]) == 1
        assert not (fake_build / "gfx1101").exists()
    finally:
        holder.kill()
        holder.wait()
    # the kernel drops a dead holder's lock: the next build goes through
    assert cli.main(["build", "gfx1030", "--out", str(fake_build)]) == 0


def test_a_build_can_wait_for_the_holder(fake_build, capsys):
    holder = _hold_lock(fake_build)
    threading.Timer(1.0, holder.kill).start()
    start = time.monotonic()
    assert cli.main(["build", "gfx1030", "--out", str(fake_build), "--wait", "30"]) == 0
    assert time.monotonic() - start >= 0.9
    assert (
        f"waiting for {fake_build / 'gfx1030'}: held by pid {holder.pid}" in capsys.readouterr().out
    )
    holder.wait()


def test_a_full_disk_at_the_write_stage_leaves_the_old_set(fake_build, monkeypatch, capsys):
    real = stages.shutil.copy2
    copies = []

    def copy2(src, dst):
        copies.append(dst)
        if len(copies) == 2:
            raise OSError(28, "No space left on device")
        return real(src, dst)

    monkeypatch.setattr(stages.shutil, "copy2", copy2)
    assert cli.main(["build", "gfx1030", "--out", str(fake_build)]) == 1
    err = capsys.readouterr().err
    assert "stage 'write' failed: [Errno 28] No space left on device" in err
    assert _old_set_intact(fake_build)
    assert sorted(p.name for p in fake_build.iterdir()) == [".gfx1030.lock", "gfx1030"]


@pytest.mark.parametrize("exchange", [True, False])
def test_a_reader_sees_the_old_set_or_the_new_one(tmp_path, monkeypatch, exchange):
    """Swaps of two complete sets while a reader lists the folder: every listing is one whole
    set (renameat2's exchange), or, where the system lacks it, a whole set or none. (The old set
    is removed by the swap after next: a listing during which a swap ended may already be of a
    set on its way out, which the contract does not cover, so such listings are not judged.)"""
    if not exchange:
        monkeypatch.setattr(guard, "_exchange", lambda a, b: False)
    dest = tmp_path / "gfx1030"
    sets = [{f"{tag}-{i}.whl" for i in range(6)} for tag in ("a", "b")]
    swaps = [0]

    def write(names):
        new = tmp_path / f".gfx1030.new-{os.getpid()}"
        new.mkdir()
        for n in names:
            (new / n).write_text(n)
        guard.replace_dir(new, dest)
        swaps[0] += 1

    write(sets[0])
    seen, stop = [], threading.Event()

    def read():
        while not stop.is_set():
            before = swaps[0]
            try:
                listing = frozenset(os.listdir(dest))
            except FileNotFoundError:
                listing = None
            if swaps[0] == before:  # (no swap ended meanwhile)
                seen.append(listing)

    reader = threading.Thread(target=read)
    reader.start()
    for i in range(200):
        write(sets[(i + 1) % 2])
    stop.set()
    reader.join()
    whole = {frozenset(s) for s in sets}
    assert len(seen) > 10
    assert all(s in whole or (s is None and not exchange) for s in seen)
    if exchange:
        assert None not in seen


def test_what_a_killed_run_left_is_removed(tmp_path, monkeypatch):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(guard.tempfile, "tempdir", str(tmp_path))
    stale = tmp_path / f"m2r-build-{dead.pid}-abc"
    live = tmp_path / f"m2r-build-{os.getpid()}-xyz"
    other = tmp_path / "m2r-something-else"
    for p in (stale, live, other):
        (p / "src").mkdir(parents=True)
    out = tmp_path / "wheels"
    (out / f".gfx1030.new-{dead.pid}").mkdir(parents=True)
    (out / f".gfx1030.new-{os.getpid()}").mkdir()
    log = []
    removed = guard.clean_stale(out, log.append, docker=False)
    assert sorted(removed) == sorted([str(stale), str(out / f".gfx1030.new-{dead.pid}")])
    assert live.exists() and other.exists() and (out / f".gfx1030.new-{os.getpid()}").exists()
    assert all(line.startswith("removed what a killed run left: ") for line in log)


def test_a_toolchain_image_deleted_mid_way_is_built_again(monkeypatch):
    ids = iter([None])
    monkeypatch.setattr(images, "image_id", lambda image: next(ids, "sha256:1"))
    built, log = [], []
    recipe = get_recipe("gfx1030")
    tag = images.toolchain_image(recipe)
    monkeypatch.setattr(images, "ensure_toolchain",
                        lambda r, mirror=None, refresh=False, log=print: built.append(r) or tag)  # fmt: skip
    images.require_image(tag, recipe, log.append)
    assert built == [recipe] and "is gone (deleted since this build began?)" in log[0]
    monkeypatch.setattr(images, "ensure_toolchain", lambda *a, **k: "other:tag")
    ids = iter([None])
    with pytest.raises(images.DockerError, match="the recipe changed during the build"):
        images.require_image(tag, recipe, log.append)


# ---- for real, in Docker ------------------------------------------------------------------------


def _labelled(pid: int) -> list[str]:
    out = subprocess.run(["docker", "ps", "-a", "--filter", f"label={guard.LABEL_PID}={pid}",
                          "--format", "{{.Names}}"], capture_output=True, text=True)  # fmt: skip
    return out.stdout.split()


@pytest.mark.docker
@pytest.mark.parametrize(("stage", "sig"), [("compile", "SIGTERM"), ("audit", "SIGINT")])
def test_a_real_build_cancelled_stops_its_container_at_once(toolchain_image, tmp_path, stage, sig):
    """SIGTERM / SIGINT to the build's whole process group (what CI's cancel or a closed terminal
    sends) while the stage's container runs: the command exits 128 + signal within seconds,
    naming the stage, its container is gone, its temporary folder removed, the old set intact.
    (Before: the compile container ran on for about a minute and the folder stayed.)"""
    out = tmp_path / "wheels"
    (out / "gfx1030").mkdir(parents=True)
    for name, data in OLD.items():
        (out / "gfx1030" / name).write_bytes(data)
    proc = subprocess.Popen([sys.executable, "-m", "mamba2_rocm.pipeline", "build", "gfx1030",
                             "--out", str(out)], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))  # fmt: skip
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if f"] {stage} ..." in line:
            break
    deadline = time.monotonic() + 30
    while not _labelled(proc.pid) and time.monotonic() < deadline:  # its container is up
        time.sleep(0.2)
    assert _labelled(proc.pid), "".join(lines)
    start = time.monotonic()
    os.killpg(proc.pid, signal.Signals[sig])
    rest, _ = proc.communicate(timeout=60)
    took = time.monotonic() - start
    assert proc.returncode == 128 + signal.Signals[sig], rest
    assert took < 15, f"exited {took:.1f} s after the signal"
    assert f"cancelled by {sig} during stage {stage!r}" in rest
    assert _labelled(proc.pid) == [], "the stage's container must be stopped"
    assert not list(Path(tempfile.gettempdir()).glob(f"m2r-build-{proc.pid}-*"))
    assert _old_set_intact(out)


@pytest.mark.docker
def test_a_stale_container_of_a_killed_run_is_removed(toolchain_image):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    name = f"m2r-run-{dead.pid}-test"
    subprocess.run(["docker", "rm", "-f", name], capture_output=True)
    started = subprocess.run(["docker", "run", "-d", "--rm", "--name", name, "--network", "none",
                              "--label", f"{guard.LABEL_PID}={dead.pid}",
                              "--label", f"{guard.LABEL_HOST}={__import__('socket').gethostname()}",
                              toolchain_image, "sleep", "300"], capture_output=True, text=True)  # fmt: skip
    assert started.returncode == 0, started.stderr
    try:
        removed = guard.clean_stale(None, log=lambda *_: None)
        assert f"container {name}" in removed
        assert _labelled(dead.pid) == []
    finally:
        subprocess.run(["docker", "rm", "-f", name], capture_output=True)
