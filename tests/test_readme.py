"""The README's set-up commands: nothing in them can replace a ROCm torch, and CI runs the
README's test command."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
#: PyTorch's own indexes for builds that are not CUDA's
TORCH_INDEXES = re.compile(r"--index-url https://download\.pytorch\.org/whl/(cpu|rocm\d+\.\d+)\b")


def _shell_blocks(text: str) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", text, re.DOTALL)


def _pip_installs(text: str) -> list[str]:
    """Every `pip install ...` command of the README's shell blocks and inline code."""
    commands = []
    for block in _shell_blocks(text):
        for line in block.splitlines():
            line = line.split("#", 1)[0]
            commands += [c.strip() for c in line.split("&&") if "pip install" in c]
    prose = re.sub(r"```.*?```", "", text, flags=re.DOTALL)
    commands += [c for c in re.findall(r"`([^`\n]+)`", prose) if "pip install " in c]
    return commands


def _installs_torch(command: str) -> bool:
    args = command.split("pip install", 1)[1].split()
    return any(re.fullmatch(r"torch([=<>~!].*)?", a) for a in args)


def test_every_torch_install_names_a_cpu_or_rocm_index():
    torch_lines = [c for c in _pip_installs(README) if _installs_torch(c)]
    assert torch_lines, "the README says how to install torch"
    for command in torch_lines:
        assert TORCH_INDEXES.search(command), f"{command!r} would pull the CUDA build on Linux"
    kinds = {TORCH_INDEXES.search(c).group(1)[:4] for c in torch_lines}
    assert kinds == {"cpu", "rocm"}, kinds  # a line for test-only machines and one for AMD GPUs


def test_the_checker_catches_the_old_line():
    old = '```bash\npip install torch && pip install -e ".[test]" && nox -s build-gfx1030\n```'
    [command] = [c for c in _pip_installs(old) if _installs_torch(c)]
    assert not TORCH_INDEXES.search(command)


def test_the_wheel_build_line_installs_no_torch():
    block = _shell_blocks(README[README.index("## Newcomer") :])[0]
    [line] = [ln for ln in block.splitlines() if "nox -s build-gfx1030" in ln]
    assert not _installs_torch(line.split("#")[0]) and "-e" not in line


def test_ci_runs_the_readme_test_command():
    block = _shell_blocks(README[README.index("## Newcomer") :])[0]
    [test_cmd] = [ln.strip() for ln in block.splitlines() if ln.startswith("python -m pytest")]
    ci = (REPO / ".ci" / "run").read_text()
    assert test_cmd in ci
    # CI's torch is the local CPU build (the equivalent of the test-only line), pinned
    assert re.search(r'pip install -q "torch==[\d.]+"', ci)


def test_the_readme_is_short_and_points_to_the_docs():
    """A README people read (at most 300 lines); the commands and the design history live in
    docs/, and the README links both."""
    assert len(README.splitlines()) <= 300
    for doc in ("docs/commands.md", "docs/design.md"):
        assert (REPO / doc).is_file() and f"]({doc})" in README
