"""configure_torch_compile: a no-op off ROCm, exactly the listed settings on (simulated) ROCm.

The real CPU torch is used; "ROCm" is simulated by setting ``torch.version.hip`` before the
call. Each case runs in a fresh interpreter so Inductor's config starts from its defaults.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]
AUTOTUNE_ENV = {
    "TORCHINDUCTOR_MAX_AUTOTUNE": "1",
    "TORCHINDUCTOR_MAX_AUTOTUNE_GEMM": "1",
    "TORCHINDUCTOR_MAX_AUTOTUNE_POINTWISE": "1",
}


def run(body: str, env: dict[str, str] | None = None) -> dict:
    code = "import json, os, sys\nimport torch\n" + body
    full_env = {**os.environ, **(env or {})}
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=full_env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_noop_on_cpu_without_inductor_imported():
    out = run(
        "from mamba2_rocm.env import configure_torch_compile, safe_compile_mode\n"
        "env = dict(os.environ)\n"
        "rec = configure_torch_compile()\n"
        "print(json.dumps({'rocm': rec.rocm, 'changed': rec.changed,\n"
        "    'env_same': env == dict(os.environ),\n"
        "    'inductor': 'torch._inductor' in sys.modules,\n"
        "    'modes': [safe_compile_mode(m) for m in ('reduce-overhead', 'max-autotune', None)]}))\n",
        AUTOTUNE_ENV,
    )
    assert out == {
        "rocm": False,
        "changed": False,
        "env_same": True,
        "inductor": False,  # not even imported: the non-ROCm path stays exactly as it was
        "modes": ["reduce-overhead", "max-autotune", None],
    }


def test_noop_on_cpu_with_inductor_configured():
    out = run(
        "import torch._inductor.config as c\n"
        "c.triton.cudagraphs = True\n"
        "c.memory_planning = True\n"
        "before = c.get_config_copy()\n"
        "from mamba2_rocm.env import configure_torch_compile\n"
        "rec = configure_torch_compile()\n"
        "after = c.get_config_copy()\n"
        "print(json.dumps({'changed': rec.changed, 'same': before == after,\n"
        "    'max_autotune': c.max_autotune,\n"
        "    'env': {k: os.environ.get(k) for k in sorted(os.environ) if 'AUTOTUNE' in k}}))\n",
        AUTOTUNE_ENV,
    )
    assert out == {"changed": False, "same": True, "max_autotune": True, "env": AUTOTUNE_ENV}


SIMULATED_ROCM = (
    "torch.version.hip = '6.2.41133-simulated'\n"
    "import torch._inductor.config as c\n"
    "c.triton.cudagraphs = True\n"
    "c.memory_planning = True\n"
    "before = c.get_config_copy()\n"
    "from mamba2_rocm.env import configure_torch_compile, safe_compile_mode\n"
    "rec = configure_torch_compile()\n"
    "after = c.get_config_copy()\n"
    "again = configure_torch_compile()\n"
    "print(json.dumps({'rocm': rec.rocm,\n"
    "    'diff': {k: [before[k], after[k]] for k in before if before[k] != after[k]},\n"
    "    'record': {k: list(v) for k, v in rec.inductor.items()},\n"
    "    'env_unset': rec.env_unset, 'env_now': sorted(k for k in os.environ if 'AUTOTUNE' in k),\n"
    "    'again_changed': again.changed, 'text': str(rec),\n"
    "    'modes': [safe_compile_mode(m) for m in\n"
    "              ('reduce-overhead', 'max-autotune', 'max-autotune-no-cudagraphs', 'default', None)]}))\n"
)


def test_simulated_rocm_changes_exactly_the_listed_settings():
    out = run(SIMULATED_ROCM, AUTOTUNE_ENV)
    expected = {
        "max_autotune": [True, False],
        "max_autotune_gemm": [True, False],  # read from *_GEMM before the call
        "max_autotune_pointwise": [True, False],
        "triton.cudagraphs": [True, False],
        "triton.cudagraph_trees": [True, False],
        "memory_planning": [True, False],
    }
    assert out["rocm"] is True
    assert out["diff"] == expected  # nothing else in Inductor's config moved
    assert out["record"] == expected
    assert out["env_unset"] == AUTOTUNE_ENV and out["env_now"] == []
    assert out["again_changed"] is False
    assert "unset TORCHINDUCTOR_MAX_AUTOTUNE (was '1')" in out["text"]
    assert out["modes"] == ["default", "default", "default", "default", None]


def test_simulated_rocm_without_autotune_env():
    env = {k: v for k, v in os.environ.items() if "AUTOTUNE" not in k}
    proc_env = {**env}
    code = "import json, os, sys\nimport torch\n" + SIMULATED_ROCM
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=proc_env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["diff"] == {
        "triton.cudagraphs": [True, False],
        "triton.cudagraph_trees": [True, False],
        "memory_planning": [True, False],
    }
    assert out["env_unset"] == {}


def test_safe_compile_mode_and_shell_lines(monkeypatch):
    from mamba2_rocm.env.compile_safety import safe_compile_mode, shell_unset_lines

    monkeypatch.setenv("TORCHINDUCTOR_MAX_AUTOTUNE", "1")
    assert safe_compile_mode("max-autotune") == "max-autotune"
    assert shell_unset_lines() == []
    monkeypatch.setattr(torch.version, "hip", "6.2.41133")
    assert safe_compile_mode("max-autotune") == "default"
    assert safe_compile_mode("reduce-overhead") == "default"
    assert safe_compile_mode("default") == "default"
    assert shell_unset_lines() == ["unset TORCHINDUCTOR_MAX_AUTOTUNE"]


def test_compile_safety_cli_prints_nothing_off_rocm():
    env = {**os.environ, **AUTOTUNE_ENV}
    proc = subprocess.run(
        [sys.executable, "-m", "mamba2_rocm", "env", "compile-safety"],
        cwd=ROOT, env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert (proc.returncode, proc.stdout) == (0, "")
