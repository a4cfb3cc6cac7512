"""The workflows against the recipes and the noxfile: every `nox -s` they name exists, the
matrix covers every recipe, and the hardening rules hold; zizmor and the schema pass."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers import require_tool

from mamba2_rocm.pipeline.matrix import github_outputs, matrices
from mamba2_rocm.pipeline.recipes import load_recipes

REPO = Path(__file__).resolve().parents[2]
WORKFLOWS = sorted((REPO / ".github" / "workflows").glob("*.yml"))
SHA_PIN = re.compile(r"^[\w.-]+/[\w.-]+(/[\w./-]+)?@[0-9a-f]{40}$")


def _load(path: Path) -> dict:
    return yaml.load(path.read_text(), Loader=yaml.BaseLoader)  # BaseLoader: `on` stays a string


def _steps(wf: dict):
    for name, job in wf["jobs"].items():
        for step in job.get("steps", []):
            yield name, job, step


@pytest.fixture(scope="module")
def nox_sessions() -> set[str]:
    # `nox -l --json` lists only the default sessions; the text listing has all of them
    proc = subprocess.run([sys.executable, "-m", "nox", "-l"], cwd=REPO,
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return set(re.findall(r"^[*-] (\S+) -> ", proc.stdout, re.MULTILINE))


def test_the_three_workflows_exist():
    assert [p.name for p in WORKFLOWS] == ["ci.yml", "gpu.yml", "release.yml"]


def test_every_nox_session_named_in_a_workflow_exists(nox_sessions):
    recipes = list(load_recipes())
    named = []
    for path in WORKFLOWS:
        for _, job, step in _steps(_load(path)):
            for m in re.finditer(r"nox -s \"?([\w${}.-]+)\"?", step.get("run", "")):
                name = m.group(1)
                if "${TARGET}" in name:  # a matrix job: every target it can get must exist
                    assert job["strategy"]["matrix"].startswith(
                        "${{ fromJSON(needs.matrix.outputs."
                    )
                    named += [name.replace("${TARGET}", t) for t in recipes]
                else:
                    named.append(name)
    assert {"lint", "matrix", "publish", "build-gfx1030", "gpu-tests-gfx1030"} <= set(named)
    assert sorted(set(named) - nox_sessions) == []
    for target in recipes:  # and the noxfile has each per-target session
        assert {f"build-{target}", f"gpu-tests-{target}", f"pull-{target}"} <= nox_sessions


def test_matrix_covers_every_recipe(tmp_path):
    recipes = load_recipes()
    m = matrices(list(recipes.values()))
    assert [e["target"] for e in m["build"]["include"]] == list(recipes)
    assert [e["target"] for e in m["gate"]["include"]] == list(recipes)
    with_runners = [r for r in recipes.values() if r.runner_labels]
    assert m["gpu"]["include"] == [
        {"target": r.target, "runs-on": list(r.runner_labels), "gate": r.gpu_gate}
        for r in with_runners
    ]
    assert m["has_gpu"] == ("true" if with_runners else "false")
    out = tmp_path / "github_output"
    github_outputs(list(recipes.values()), out)
    lines = dict(line.split("=", 1) for line in out.read_text().splitlines())
    assert json.loads(lines["build"]) == m["build"] and lines["has_gpu"] == m["has_gpu"]
    # the CLI the workflows call prints the same
    proc = subprocess.run([sys.executable, "-m", "mamba2_rocm.pipeline", "matrix"], cwd=REPO,
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 0 and json.loads(proc.stdout) == m


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.name)
def test_hardening(path):
    text = path.read_text()
    wf = _load(path)
    assert wf["permissions"] == {"contents": "read"}
    assert "concurrency" in wf
    for name, _job, step in _steps(wf):
        uses = step.get("uses")
        if uses:
            assert SHA_PIN.match(uses), f"{path.name}:{name}: {uses} is not pinned to a commit"
            line = next(ln for ln in text.splitlines() if uses in ln)
            assert re.search(r"# v\d", line), f"{path.name}: {uses} has no version comment"
            if uses.startswith("actions/checkout@"):
                assert step["with"]["persist-credentials"] == "false"
            assert "cache" not in step.get("with", {})
        # no expression expands inside a shell script: values come through env:
        assert "${{" not in step.get("run", ""), f"{path.name}:{name}: expression in run:"
    for name, job in wf["jobs"].items():
        if "id-token" in job.get("permissions", {}):
            assert (path.name, name) == ("release.yml", "publish")
            assert job["environment"]["name"] == "pypi"
            assert not job["runs-on"].startswith("self-hosted")


def test_gpu_workflow_never_runs_fork_code_on_self_hosted_runners():
    wf = _load(REPO / ".github" / "workflows" / "gpu.yml")
    assert set(wf["on"]["pull_request"]["types"]) == {"labeled"}
    assert "pull_request_target" not in wf["on"]
    guard = wf["jobs"]["matrix"]["if"]
    assert "vars.AMD_GPU_RUNNERS_OWNER == github.repository_owner" in guard
    assert "github.event.label.name == 'gpu-tests'" in guard
    assert "github.event.pull_request.head.repo.full_name == github.repository" in guard
    # every self-hosted job depends on the guarded job
    gpu = wf["jobs"]["gpu-tests"]
    assert gpu["runs-on"] == "${{ matrix.runs-on }}" and "matrix" in gpu["needs"]
    assert wf["jobs"]["build"]["needs"] == "matrix"


def test_release_publishes_only_after_the_gate():
    wf = _load(REPO / ".github" / "workflows" / "release.yml")
    assert wf["on"]["push"]["tags"] == ["v*"]
    assert wf["jobs"]["gpu"]["uses"].endswith(".github/workflows/gpu.yml")
    publish = wf["jobs"]["publish"]
    assert publish["needs"] == "gpu"
    runs = " ".join(s.get("run", "") for s in publish["steps"])
    assert "nox -s publish -- --repository-url" in runs and "--skip-existing" not in runs
    assert any("attest-build-provenance" in s.get("uses", "") for s in publish["steps"])


def _tool(name: str) -> str:
    path = shutil.which(name) or str(Path(sys.executable).parent / name)
    if not Path(path).exists():
        require_tool(f"{name} is not installed (it is in the test extra)")
    return path


def test_zizmor_pedantic_offline_is_clean():
    proc = subprocess.run([_tool("zizmor"), "--offline", "--pedantic", "--strict-collection",
                           "--no-progress", *map(str, WORKFLOWS)],
                          capture_output=True, text=True, cwd=REPO)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_workflows_match_the_github_schema():
    proc = subprocess.run([_tool("check-jsonschema"), "--builtin-schema",
                           "vendor.github-workflows", *map(str, WORKFLOWS)],
                          capture_output=True, text=True, cwd=REPO)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr


# --- what GitHub rejects but zizmor and the schema accept (mamba2_rocm.pipeline.workflows) ----

CALLER = """\
name: caller
on: push
permissions: {}
jobs:
  gate:
    uses: ./.github/workflows/callee.yml
    with:
      target: gfx1030
    secrets:
      TOKEN: ${{ secrets.TOKEN }}
  publish:
    needs: gate
    runs-on: ubuntu-24.04
    if: needs.gate.result == 'success' && github.ref_type == 'tag'
    steps:
      - uses: actions/checkout@11bd71901bbe5b1630ceea73d27597364c9af683
      - run: echo "${{ format('{0}', needs.gate.outputs.wheel) }} ${{ vars.X }}"
"""
CALLEE = """\
name: callee
on:
  workflow_call:
    inputs:
      target: {type: string, required: true}
      extra: {type: string, required: false}
    secrets:
      TOKEN: {required: true}
jobs:
  run:
    runs-on: ubuntu-24.04
    steps:
      - run: echo ${{ inputs.target }}
"""


def _repo_with(tmp_path: Path, caller: str, callee: str | None = CALLEE) -> Path:
    wf = tmp_path / ".github" / "workflows"
    wf.mkdir(parents=True)
    (wf / "caller.yml").write_text(caller)
    if callee is not None:
        (wf / "callee.yml").write_text(callee)
    return wf


def _problems(tmp_path: Path, caller: str, callee: str | None = CALLEE) -> list[str]:
    from mamba2_rocm.pipeline.workflows import check_dir

    return [str(p) for p in check_dir(_repo_with(tmp_path, caller, callee))]


def test_our_workflows_pass_the_reusable_workflow_checks():
    from mamba2_rocm.pipeline.workflows import check_dir

    assert check_dir(REPO / ".github" / "workflows") == []


def test_a_well_formed_call_passes(tmp_path):
    assert _problems(tmp_path, CALLER) == []


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        # the form release.yml had: GitHub rejects the file, so no tag could publish
        ("uses: ./.github/workflows/callee.yml", "uses: $/.github/workflows/callee.yml",
         "is neither ./.github/workflows/NAME.yml nor owner/repo/.github/workflows/NAME.yml@ref"),
        ("uses: ./.github/workflows/callee.yml", "uses: org/repo/.github/workflows/callee.yml",
         "is neither"),  # a remote call without @ref
        ("uses: ./.github/workflows/callee.yml", "uses: ./.github/workflows/missing.yml",
         "./.github/workflows/missing.yml does not exist"),
        ("target: gfx1030", "target: gfx1030\n      tagret: x", "declares no input 'tagret'"),
        ("      target: gfx1030\n", "", "requires input 'target'"),
        ("TOKEN: ${{ secrets.TOKEN }}", "TOKN: ${{ secrets.TOKEN }}", "declares no secret 'TOKN'"),
        ("needs: gate", "needs: [gate, build]", "no job named 'build'"),
        ("github.ref_type", "gihtub.ref_type", "unknown context 'gihtub'"),
        ("vars.X", "var.X", "unknown context 'var'"),
        ("format('{0}'", "fromat('{0}'", "unknown function 'fromat'"),
        ("    needs: gate\n", "", "reads needs.gate, but the job needs []"),
        ("actions/checkout@11bd71901bbe5b1630ceea73d27597364c9af683", "actions/checkout",
         "is not owner/repo[/path]@ref"),
    ],
)  # fmt: skip
def test_each_broken_form_is_named(tmp_path, old, new, expected):
    assert old in CALLER
    problems = _problems(tmp_path, CALLER.replace(old, new, 1))
    assert any(expected in p for p in problems), problems


def test_a_callee_without_workflow_call_is_named(tmp_path):
    callee = CALLEE.replace("  workflow_call:", "  workflow_dispatch:")
    problems = _problems(tmp_path, CALLER, callee)
    assert any("does not declare on: workflow_call" in p for p in problems), problems


def test_secrets_inherit_and_strings_are_not_contexts(tmp_path):
    caller = CALLER.replace("secrets:\n      TOKEN: ${{ secrets.TOKEN }}", "secrets: inherit")
    caller = caller.replace('echo "', "echo \"${{ 'not.a.context' }} ")
    assert _problems(tmp_path, caller) == []


def test_cli_exits_1_naming_the_problem(tmp_path):
    wf = _repo_with(tmp_path, CALLER.replace("uses: ./", "uses: $/"))
    proc = subprocess.run([sys.executable, "-m", "mamba2_rocm.pipeline.workflows", str(wf)],
                          capture_output=True, text=True, cwd=REPO)  # fmt: skip
    assert proc.returncode == 1
    assert "caller.yml: jobs.gate.uses: '$/.github/workflows/callee.yml'" in proc.stdout


ACTIONLINT = REPO / "tools" / "actionlint" / "node_modules" / "@tktco" / "node-actionlint"


def _actionlint(directory: Path) -> subprocess.CompletedProcess:
    node = shutil.which("node")
    if node is None or not ACTIONLINT.is_dir():
        require_tool("actionlint: node or tools/actionlint/node_modules missing (nox -s lint)")
    return subprocess.run([node, str(ACTIONLINT / "bin" / "node-actionlint.js"),
                           ".github/workflows/*.yml"],
                          capture_output=True, text=True, cwd=directory)  # fmt: skip


def test_actionlint_passes_our_workflows():
    proc = _actionlint(REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Checking 3 workflow file(s)" in proc.stdout


def test_actionlint_rejects_the_dollar_slash_call(tmp_path):
    _repo_with(tmp_path, CALLER.replace("uses: ./", "uses: $/"))
    proc = _actionlint(tmp_path)
    assert proc.returncode != 0
    assert 'reusable workflow call "$/.github/workflows/callee.yml"' in proc.stdout


# --- tools installed by hash (the release job holds id-token: write) ----------------------------

LOCKS = REPO / "requirements"


def _locked(path: Path) -> dict[str, list[str]]:
    """``{name: [hashes]}`` of a pip-compile --generate-hashes file (continuation lines joined)."""
    text = path.read_text().replace("\\\n", " ")
    out = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.match(r"^([A-Za-z0-9_.-]+)==(\S+)\s*(.*)$", line)
        assert m, f"{path.name}: not an exact pin: {line!r}"
        out[m.group(1).lower()] = re.findall(r"--hash=sha256:([0-9a-f]{64})", m.group(3))
    return out


@pytest.mark.parametrize("name", ["nox", "publish"])
def test_locks_pin_every_package_by_hash(name):
    locked = _locked(LOCKS / f"{name}.txt")
    assert locked
    assert all(hashes for hashes in locked.values()), [n for n, h in locked.items() if not h]
    for line in (LOCKS / f"{name}.in").read_text().splitlines():
        req = line.split("#", 1)[0].strip()
        if req:
            wanted = re.split(r"[=<>~!\[ ;]", req, maxsplit=1)[0].lower()
            assert wanted in locked, f"{req} of {name}.in is not in {name}.txt"


def test_workflows_install_only_from_the_locks():
    for path in WORKFLOWS:
        for job_name, _job, step in _steps(_load(path)):
            run = step.get("run", "")
            for cmd in re.findall(r"pip install[^\n]*", run):
                assert re.search(r"--require-hashes -r requirements/\w+\.txt$", cmd.strip()), (
                    f"{path.name}:{job_name}: {cmd!r} installs outside a hash-checked lock"
                )


def test_publish_session_installs_from_the_lock():
    source = (REPO / "noxfile.py").read_text()
    body = source[source.index("def publish(") :].split("\n@nox.session", 1)[0]
    assert '"--require-hashes", "-r", "requirements/publish.txt"' in body
    assert '"--no-deps", "--no-build-isolation", "-e", "."' in body
    assert "_pipeline(" not in body  # it installs the pipeline's tools unpinned
