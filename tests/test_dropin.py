"""The drop-in import names: layout (the public names real callers import), metadata, the
installed .pth wheel in a fresh venv, precedence of a real install, clean uninstall, doctor."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from mamba2_rocm import dropin
from mamba2_rocm.pipeline.package import build_dropin_wheel
from tests.fakewheels import build_wheel
from tests.loopback_index import pip_env

REPO = Path(__file__).resolve().parents[1]

#: module -> names that transformers (5.x), the upstream test suites and mamba_ssm's own modules
#: import from it. Every one must resolve to mamba2-rocm's object.
PUBLIC = {
    "mamba_ssm": ["mamba_chunk_scan_combined", "mamba_split_conv1d_scan_combined", "selective_state_update",
                  "selective_scan_fn", "mamba_inner_fn"],
    "mamba_ssm.ops.selective_scan_interface": ["selective_scan_fn", "mamba_inner_fn", "selective_scan_ref",
                                               "mamba_inner_ref"],
    "mamba_ssm.ops.triton.ssd_combined": ["mamba_chunk_scan_combined", "mamba_split_conv1d_scan_combined"],
    "mamba_ssm.ops.triton.selective_state_update": ["selective_state_update", "selective_state_update_ref"],
    "mamba_ssm.ops.triton.layernorm_gated": ["RMSNorm", "LayerNorm", "rmsnorm_fn", "layernorm_fn", "rms_norm_ref"],
    "causal_conv1d": ["causal_conv1d_fn", "causal_conv1d_update"],
    "causal_conv1d.causal_conv1d_interface": [
        "causal_conv1d_fn", "causal_conv1d_update", "causal_conv1d_ref", "causal_conv1d_update_ref",
    ],
    "causal_conv1d.causal_conv1d_varlen": ["causal_conv1d_varlen_states", "causal_conv1d_varlen_states_ref"],
    # the model layer (research code, Zonos, upstream's tests/test_generation.py)
    "mamba_ssm.modules.mamba_simple": ["Mamba"],
    "mamba_ssm.modules.mamba2": ["Mamba2"],
    "mamba_ssm.modules.mamba2_simple": ["Mamba2Simple"],
    "mamba_ssm.modules.mha": ["MHA"],
    "mamba_ssm.modules.mlp": ["GatedMLP"],
    "mamba_ssm.modules.block": ["Block"],
    "mamba_ssm.models.config_mamba": ["MambaConfig"],
    "mamba_ssm.models.mixer_seq_simple": ["MambaLMHeadModel", "MixerModel", "create_block", "_init_weights"],
    "mamba_ssm.utils.generation": ["InferenceParams", "GenerationMixin", "decode", "sample",
                                   "update_graph_cache", "capture_graph", "DecodingCGCache"],
    "mamba_ssm.utils.hf": ["load_config_hf", "load_state_dict_hf"],
    "mamba_ssm.utils.torch": ["custom_fwd", "custom_bwd"],
    "mamba_ssm.utils.determinism": ["use_deterministic_mode", "set_deterministic_mode"],
    "mamba_ssm.ops.triton.layer_norm": ["RMSNorm", "layer_norm_fn", "rms_norm_fn", "layer_norm_ref",
                                        "rms_norm_ref", "layer_norm_linear_fn"],
    "mamba_ssm.distributed.tensor_parallel": ["ColumnParallelLinear", "RowParallelLinear",
                                              "ParallelEmbeddings", "VocabParallelEmbedding"],
    "mamba_ssm.distributed.distributed_utils": ["all_reduce", "reduce_scatter", "all_gather",
                                                "get_dim_for_local_rank"],
    # what the real pure-Python mamba-ssm imports and cannot build (the "beside" setup)
    "causal_conv1d.cpp_functions": ["causal_conv1d_fwd_function", "causal_conv1d_bwd_function",
                                    "causal_conv1d_update_function"],
    "selective_scan_cuda": ["fwd", "bwd"],
}  # fmt: skip
PUBLIC["mamba_ssm"] += ["Mamba", "Mamba2", "MambaLMHeadModel"]
OURS = {
    "mamba_chunk_scan_combined": "mamba2_rocm.ops.ssd",
    "mamba_split_conv1d_scan_combined": "mamba2_rocm.ops.mamba2",
    "selective_state_update": "mamba2_rocm.ops.state_update",
    "selective_state_update_ref": "mamba2_rocm.reference.ssd",
    "RMSNorm": "mamba2_rocm.ops.rmsnorm",
    "LayerNorm": "mamba2_rocm.ops.rmsnorm",
    "rmsnorm_fn": "mamba2_rocm.ops.rmsnorm",
    "layernorm_fn": "mamba2_rocm.ops.rmsnorm",
    "rms_norm_ref": "mamba2_rocm.reference.ssd",
    "causal_conv1d_fn": "mamba2_rocm.ops.conv1d",
    "causal_conv1d_update": "mamba2_rocm.ops.conv1d",
    "causal_conv1d_varlen_states": "mamba2_rocm.ops.conv1d",
    "causal_conv1d_ref": "mamba2_rocm.reference.conv1d",
    "causal_conv1d_update_ref": "mamba2_rocm.reference.conv1d",
    "causal_conv1d_varlen_states_ref": "mamba2_rocm.reference.conv1d",
    "selective_scan_fn": "mamba2_rocm.ops.selective_scan",
    "selective_scan_ref": "mamba2_rocm.reference.selective_scan",
    "mamba_inner_fn": "mamba2_rocm.ops.mamba1",
    "mamba_inner_ref": "mamba2_rocm.ops.mamba1",
    "Mamba": "mamba2_rocm.models.mamba1",
    "Mamba2": "mamba2_rocm.models.mamba2",
    "Mamba2Simple": "mamba2_rocm.models.mamba2_simple",
    "MHA": "mamba2_rocm.models.mha",
    "GatedMLP": "mamba2_rocm.models.mlp",
    "Block": "mamba2_rocm.models.block",
    "MambaConfig": "mamba2_rocm.models.config",
    **dict.fromkeys(["MambaLMHeadModel", "MixerModel", "create_block", "_init_weights"],
                    "mamba2_rocm.models.lm"),
    **dict.fromkeys(["InferenceParams", "GenerationMixin", "decode", "sample", "update_graph_cache",
                     "capture_graph", "DecodingCGCache"], "mamba2_rocm.models.generation"),
    **dict.fromkeys(["load_config_hf", "load_state_dict_hf"], "mamba2_rocm.models.hf"),
    **dict.fromkeys(["custom_fwd", "custom_bwd", "use_deterministic_mode", "set_deterministic_mode"],
                    "mamba2_rocm.models.compat"),
    **dict.fromkeys(["layer_norm_fn", "rms_norm_fn", "layer_norm_linear_fn"], "mamba2_rocm.ops.add_norm"),
    **dict.fromkeys(["layer_norm_ref"], "mamba2_rocm.reference.add_norm"),
    **dict.fromkeys(["ColumnParallelLinear", "RowParallelLinear", "ParallelEmbeddings",
                     "VocabParallelEmbedding", "all_reduce", "reduce_scatter", "all_gather",
                     "get_dim_for_local_rank"], "mamba2_rocm.models.parallel"),
    **dict.fromkeys(["causal_conv1d_fwd_function", "causal_conv1d_bwd_function",
                     "causal_conv1d_update_function", "fwd", "bwd"], "mamba2_rocm.ops.extension_abi"),
}  # fmt: skip
#: names two modules export under one name: (module, name) -> ours
OURS_AT = {
    ("mamba_ssm.ops.triton.layer_norm", "RMSNorm"): "mamba2_rocm.ops.add_norm",
    ("mamba_ssm.ops.triton.layer_norm", "rms_norm_ref"): "mamba2_rocm.reference.add_norm",
}


def _run(python: str, code: str, **env: str) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if k != dropin.ENV_SWITCH}
    e.update(env)
    return subprocess.run([python, "-c", code], capture_output=True, text=True, env=e, timeout=120)


def _walk_code() -> str:
    return (
        "import importlib, json\n"
        f"public = {PUBLIC!r}\n"
        "out = {}\n"
        "for mod, names in public.items():\n"
        "    m = importlib.import_module(mod)\n"
        "    for n in names:\n"
        "        out[mod + '.' + n] = getattr(m, n).__module__\n"
        "print(json.dumps(out))\n"
    )


def test_public_names_are_ours():
    """Every name callers import, at every path they import it from, is mamba2-rocm's."""
    code = "import mamba2_rocm.dropin as d; d.activate()\n" + _walk_code()
    proc = _run(sys.executable, code)
    assert proc.returncode == 0, proc.stderr
    found = json.loads(proc.stdout)
    assert found == {f"{m}.{n}": OURS_AT.get((m, n), OURS[n]) for m, names in PUBLIC.items()
                     for n in names}  # fmt: skip


def test_transformers_lookup_paths():
    """transformers 5.x: import_module(package), then the attribute or the nested path."""
    code = (
        "import importlib, mamba2_rocm.dropin as d; d.activate()\n"
        "from mamba2_rocm.ops import ssd, state_update, mamba2\n"
        "m = importlib.import_module('mamba_ssm')\n"
        "assert m.ops.triton.ssd_combined.mamba_chunk_scan_combined is ssd.mamba_chunk_scan_combined\n"
        "assert m.selective_state_update is state_update.selective_state_update\n"
        "import mamba_ssm.ops.triton.selective_state_update as s\n"
        "assert s.selective_state_update is state_update.selective_state_update\n"
        "assert m.mamba_split_conv1d_scan_combined is mamba2.mamba_split_conv1d_scan_combined\n"
    )
    proc = _run(sys.executable, code)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("stmt", ["from mamba_ssm import Mamba3",
                                  "import mamba_ssm.modules.mamba3"])  # fmt: skip
def test_what_is_not_provided_says_so(stmt):
    """Mamba3 is not ours: importing it names it and says why (an ImportError, so code that
    guards the import takes its own fallback)."""
    proc = _run(sys.executable, f"import mamba2_rocm.dropin as d; d.activate()\n{stmt}\n")
    assert proc.returncode == 1
    assert "ImportError: mamba_ssm" in proc.stderr and "mamba3" in proc.stderr.lower()
    assert (
        "is not provided by mamba2-rocm's drop-in: mamba2-rocm has no Mamba3 kernels" in proc.stderr
    )


def test_metadata_versions_pass_transformers_checks():
    from packaging.version import Version

    code = (
        "import importlib.metadata as md, mamba2_rocm.dropin as d; d.activate()\n"
        "print(md.version('mamba_ssm'), md.version('mamba-ssm'), md.version('causal_conv1d'))\n"
    )
    proc = _run(sys.executable, code)
    assert proc.returncode == 0, proc.stderr
    mamba, mamba_dash, conv = proc.stdout.split()
    assert mamba == mamba_dash == dropin.facade_version("mamba_ssm")
    assert Version(mamba) >= Version("2.0.4")  # transformers' is_mamba_2_ssm_available()
    assert "+mamba2rocm." in mamba and "+mamba2rocm." in conv
    assert Version(conv).release == Version(dropin.FACADES["causal_conv1d"]).release


def test_inactive_by_default():
    proc = _run(sys.executable, "import importlib.util as u; print(u.find_spec('mamba_ssm'))")
    assert proc.stdout.strip() == "None"


@pytest.fixture(scope="module")
def dropin_venv(tmp_path_factory):
    """A fresh venv with mamba2_rocm importable from this checkout (a path entry, no torch)
    and the drop-in wheel installed by pip."""
    root = tmp_path_factory.mktemp("dropin")
    venv.EnvBuilder(with_pip=True).create(root / "venv")
    python = str(root / "venv" / "bin" / "python")
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    (Path(purelib) / "checkout.pth").write_text(str(REPO) + "\n")
    wheel = build_dropin_wheel("0.0.0", root / "dist", "1700000000")
    pip = [python, "-m", "pip", "install", "-q", "--no-index", "--no-deps"]
    subprocess.run([*pip, str(wheel)], check=True, env=pip_env())
    return python, Path(purelib), root


def test_installed_dropin_serves_the_names(dropin_venv):
    python, _, _ = dropin_venv
    code = (
        "import importlib.util as u, importlib.metadata as md, json, mamba2_rocm.dropin as d\n"
        "print(json.dumps([u.find_spec('mamba_ssm').origin, md.version('mamba_ssm'),"
        " d.report()]))\n"
    )
    proc = _run(python, code)
    assert proc.returncode == 0, proc.stderr
    origin, version, report = json.loads(proc.stdout)
    assert origin == str(dropin.FACADE_DIR / "mamba_ssm" / "__init__.py")
    assert "+mamba2rocm." in version
    assert [(r["name"], r["owner"], r["dropin_installed"]) for r in report] == [
        ("mamba_ssm", "mamba2-rocm", True), ("causal_conv1d", "mamba2-rocm", True),
        ("selective_scan_cuda", "mamba2-rocm", True),
    ]  # fmt: skip
    off = _run(python, "import importlib.util as u; print(u.find_spec('mamba_ssm'))",
               MAMBA2_ROCM_DROPIN="0")  # fmt: skip
    assert off.stdout.strip() == "None", off.stderr


def test_real_package_wins_then_uninstall_leaves_it_intact(dropin_venv):
    """Installing the real mamba_ssm later takes the name (ours gives way, doctor reports it);
    uninstalling the drop-in removes exactly its own files and leaves the real package working."""
    python, purelib, root = dropin_venv
    real = build_wheel(
        root / "real", "mamba-ssm", "2.3.2",
        {"mamba_ssm/__init__.py": "__version__ = '2.3.2'\nREAL = True\n"},
    )  # fmt: skip
    pip = [python, "-m", "pip"]
    subprocess.run([*pip, "install", "-q", "--no-index", "--no-deps", str(real)], check=True,
                   env=pip_env())  # fmt: skip
    code = (
        "import importlib.metadata as md, json, mamba_ssm, mamba2_rocm.dropin as d\n"
        "print(json.dumps([mamba_ssm.REAL, md.version('mamba_ssm'), d.report()[0]]))\n"
    )
    proc = _run(python, code)
    assert proc.returncode == 0, proc.stderr
    is_real, version, row = json.loads(proc.stdout)
    assert is_real and version == "2.3.2"
    assert row["owner"] == "other" and row["shadowed"] and row["version"] == "2.3.2"

    before = {p.name for p in purelib.iterdir()}
    subprocess.run([*pip, "uninstall", "-q", "-y", "mamba2-rocm-dropin"], check=True, env=pip_env())
    gone = before - {p.name for p in purelib.iterdir()}
    assert gone == {"mamba2_rocm_dropin.pth", "mamba2_rocm_dropin-0.0.0.dist-info"}
    proc = _run(python, "import mamba_ssm; print(mamba_ssm.REAL)")
    assert proc.stdout.strip() == "True", proc.stderr
    listed = subprocess.run([*pip, "list", "--format=json"], capture_output=True, text=True,
                            env=pip_env()).stdout  # fmt: skip
    assert {d["name"] for d in json.loads(listed)} >= {"mamba-ssm"}


def test_pip_sees_no_phantom_distribution(dropin_venv):
    """pip reads dist-info folders: the facade's metadata never shows up as an installed
    mamba-ssm / causal-conv1d (so pip would install the real one normally)."""
    python, _, _ = dropin_venv
    listed = subprocess.run([python, "-m", "pip", "list", "--format=json"], capture_output=True,
                            text=True, env=pip_env(), check=True).stdout  # fmt: skip
    assert "causal-conv1d" not in {d["name"].lower() for d in json.loads(listed)}


def test_pth_is_harmless_without_the_host_package(tmp_path):
    """A drop-in left behind by a host uninstall prints no error at every interpreter start."""
    venv.EnvBuilder(with_pip=False).create(tmp_path / "venv")
    python = str(tmp_path / "venv" / "bin" / "python")
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    from mamba2_rocm.pipeline.package import DROPIN_PTH

    Path(purelib, "mamba2_rocm_dropin.pth").write_text(DROPIN_PTH)
    proc = _run(python, "print('ok')")
    assert proc.stdout.strip() == "ok" and proc.stderr == ""


def test_host_extra_pins_the_dropin():
    """``pip install "mamba2-rocm[dropin]"`` pulls the drop-in of the same version."""
    sys.path.insert(0, str(REPO))
    try:
        from hatch_build import RecipeExtrasHook
    finally:
        sys.path.remove(str(REPO))
    meta = {"version": "1.2.3"}
    RecipeExtrasHook(str(REPO), {}).update(meta)
    assert meta["optional-dependencies"]["dropin"] == ["mamba2-rocm-dropin==1.2.3"]


def _row(name, owner, shadowed=False):
    return {"name": name, "owner": owner, "version": "1" if owner != "absent" else None,
            "path": f"/x/{name}" if owner != "absent" else None, "dropin_installed": True,
            "shadowed": shadowed}  # fmt: skip


def test_doctor_names_the_beside_setup():
    """A real mamba_ssm beside the drop-in is a setup, not a collision: doctor names it and who
    runs each op family (its Triton SSD, our conv and scan), and warns of nothing."""
    from mamba2_rocm.env import audit

    rows = [_row("mamba_ssm", "other", shadowed=True), _row("causal_conv1d", "mamba2-rocm"),
            _row("selective_scan_cuda", "mamba2-rocm")]  # fmt: skip
    facts = audit.Facts(environ={}, torch=audit.TorchInfo(True, "2.5.1+cpu"), import_names=rows)
    assert not [f for f in audit.check(facts) if f.id.startswith("import-name-shadowed")]
    text = audit.render_text(audit.report(facts))
    assert "setup: beside: a real mamba_ssm runs its own modules and Triton kernels" in text
    ops = dict(dropin.setup(rows)["ops"])
    assert ops == {"modules, models, generation": "mamba_ssm's Triton kernels",
                   "SSD scan, decode step, fused norms": "mamba_ssm's Triton kernels",
                   "causal conv1d": "mamba2-rocm kernels",
                   "selective scan (Mamba1)": "mamba2-rocm kernels"}  # fmt: skip


def test_doctor_setups():
    alone = [_row("mamba_ssm", "mamba2-rocm"), _row("causal_conv1d", "mamba2-rocm"),
             _row("selective_scan_cuda", "mamba2-rocm")]  # fmt: skip
    assert dropin.setup(alone)["setup"] == "alone"
    assert {r for _, r in dropin.setup(alone)["ops"]} == {"mamba2-rocm kernels"}
    real = [_row("mamba_ssm", "other", True), _row("causal_conv1d", "other", True),
            _row("selective_scan_cuda", "other", True)]  # fmt: skip
    assert dropin.setup(real)["setup"] == "upstream"
    off = [_row("mamba_ssm", "absent"), _row("causal_conv1d", "absent"),
           _row("selective_scan_cuda", "absent")]  # fmt: skip
    assert dropin.setup(off)["setup"] == "off"


def test_doctor_reports_owner_and_collision():
    """doctor names who owns each import name and warns when real installs take every name
    (then no op reaches our kernels through them)."""
    from mamba2_rocm.env import audit

    rows = [_row("mamba_ssm", "other", True), _row("causal_conv1d", "other", True),
            _row("selective_scan_cuda", "absent")]  # fmt: skip
    facts = audit.Facts(environ={}, torch=audit.TorchInfo(True, "2.5.1+cpu"), import_names=rows)
    found = {f.id: f for f in audit.check(facts)}
    shadow = found["import-name-shadowed-mamba_ssm"]
    assert shadow.severity == "warning" and "is a real install: it takes the name" in shadow.message
    assert "import-name-shadowed-causal_conv1d" in found
    text = audit.render_text(audit.report(facts))
    assert "import names (mamba2-rocm-dropin)" in text
    assert "shadowed: the real package wins" in text and "setup: upstream" in text


#: what transformers' Mamba2-family models must reach through the names (GPU tests run them)
_FAMILY = {"mamba2_rocm.ops.conv1d", "mamba2_rocm.ops.mamba2", "mamba2_rocm.ops.state_update",
           "mamba2_rocm.ops.ssd"}  # fmt: skip
_MODELS = {name: _FAMILY for name in ("mamba2", "bamba", "falcon_h1", "zamba2", "nemotron_h",
                                      "granitemoehybrid")}  # fmt: skip
_MODELS["lfm2"] = {"mamba2_rocm.ops.conv1d"}
#: Mamba1 models: the conv ops, the scan, the block (training) and the decode step
_MODELS.update({name: {"mamba2_rocm.ops.conv1d", "mamba2_rocm.ops.selective_scan", "mamba2_rocm.ops.mamba1",
                       "mamba2_rocm.ops.state_update"} for name in ("mamba", "falcon_mamba")})  # fmt: skip
_PROBE = """
import importlib, json, sys
import mamba2_rocm.dropin as d
d.activate() if sys.argv[1] == "on" else d.deactivate()
out = {}
for name in json.loads(sys.argv[2]):
    mod = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
    found = {}
    for attr, obj in vars(mod).items():  # use_kernel_func_from_hub_with_fallback's wrappers
        wrapped = getattr(obj, "__wrapped__", None)
        for cell in (getattr(obj, "__closure__", None) or ()) if wrapped else ():
            impl = cell.cell_contents
            if callable(impl) and impl is not wrapped and getattr(impl, "__module__", "").startswith(
                    ("mamba2_rocm", "mamba_ssm", "causal_conv1d")):
                found[attr] = impl.__module__
    out[name] = found
print(json.dumps(out))
"""


@pytest.mark.parametrize("state", ["on", "off"])
def test_transformers_models_resolve_to_ours(state):
    """transformers' own lookups (use_kernel_func_from_hub_with_fallback, at model-module
    import) find our functions through the drop-in names, and nothing when it is off."""
    pytest.importorskip("transformers")
    proc = subprocess.run([sys.executable, "-c", _PROBE, state, json.dumps(sorted(_MODELS))],
                          capture_output=True, text=True, cwd=REPO, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout)
    for name, modules in _MODELS.items():
        if state == "on":
            assert set(found[name].values()) == modules, (name, found[name])
            assert len(found[name]) == (2 if name == "lfm2" else 5), (name, found[name])
        else:
            assert found[name] == {}, (name, found[name])
