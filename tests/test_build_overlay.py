"""build.overlay: a variant's code objects laid over a full build (A/B timing on one GPU)."""

import hashlib
import json

import pytest

from mamba2_rocm.build.overlay import main, overlay
from mamba2_rocm.runtime.discovery import manifest_problems


def _build(root, target, objects, flags=(), **extra):
    """A build --out folder: objects {source: bytes} for one target."""
    tdir = root / target
    tdir.mkdir(parents=True)
    cos = []
    for source, data in objects.items():
        (tdir / f"{source}.cubin").write_bytes(data)
        cos.append({"source": source, "file": f"{source}.cubin",
                    "sha256": hashlib.sha256(data).hexdigest(),
                    "kernels": [{"name": f"m2r_{source}", "arg_size": 8}]})  # fmt: skip
    manifest = {"format": 1, "target": target, "vendor": "nvidia", "wavefront_size": 32,
                "compile_flags": list(flags), "code_objects": cos, **extra}  # fmt: skip
    (tdir / "manifest.json").write_text(json.dumps(manifest))
    return root


def test_variant_sources_replace_the_base_ones(tmp_path):
    base = _build(tmp_path / "base", "sm_90", {"ssd_bmm": b"bmm", "ssd_chunk_scan": b"old scan"})
    var = _build(tmp_path / "var", "sm_90", {"ssd_chunk_scan": b"new scan"}, ["-DKNOB=1"])
    lines = overlay(base, var, tmp_path / "out")
    assert lines == [f"sm_90: ssd_chunk_scan from {var} (-DKNOB=1)"]
    m = json.loads((tmp_path / "out/sm_90/manifest.json").read_text())
    assert manifest_problems(m) == []
    by_source = {co["source"]: co for co in m["code_objects"]}
    assert set(by_source) == {"ssd_bmm", "ssd_chunk_scan"}
    for co in by_source.values():  # every file matches the hash the loader checks
        data = (tmp_path / "out/sm_90" / co["file"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == co["sha256"]
    assert (tmp_path / "out/sm_90/ssd_chunk_scan.cubin").read_bytes() == b"new scan"
    assert m["overlays"] == [{"source": "ssd_chunk_scan", "compile_flags": ["-DKNOB=1"]}]
    # the base is untouched
    assert (base / "sm_90/ssd_chunk_scan.cubin").read_bytes() == b"old scan"


def test_refusals(tmp_path):
    base = _build(tmp_path / "base", "sm_90", {"a": b"1"})
    other = _build(tmp_path / "other", "sm_80", {"a": b"2"})
    with pytest.raises(ValueError, match="built none of"):
        overlay(base, other, tmp_path / "o1")
    emu = _build(tmp_path / "emu", "sm_90", {"a": b"3"}, emulates="gfx11")
    with pytest.raises(ValueError, match="emulates 'gfx11'"):
        overlay(base, emu, tmp_path / "o2")
    assert not (tmp_path / "o2").exists()
    (tmp_path / "o3").mkdir()
    with pytest.raises(ValueError, match="exists"):
        overlay(base, base, tmp_path / "o3")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="not a build --out folder"):
        overlay(tmp_path / "empty", base, tmp_path / "o4")


def test_command_line(tmp_path, capsys):
    base = _build(tmp_path / "base", "sm_90", {"a": b"1"})
    var = _build(tmp_path / "var", "sm_90", {"a": b"2"})
    assert main([str(base), str(var), str(tmp_path / "out")]) == 0
    assert "sm_90: a from" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main([str(base), str(var), str(tmp_path / "out")])
    assert "exists" in capsys.readouterr().err
