"""The device scripts: fresh temporary directories per run (no fixed /tmp paths that an
earlier run, or another user, could have filled and that would land on PYTHONPATH)."""

import re
import subprocess
from pathlib import Path

import pytest

SCRIPTS = sorted((Path(__file__).resolve().parents[1] / "scripts").glob("*.sh"))


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_no_fixed_temporary_paths(script):
    text = script.read_text()
    assert not re.search(r"/tmp/", text), f"{script.name} uses a fixed /tmp path"
    if "PYTHONPATH" in text:
        assert "$(mktemp -d)" in text


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_scripts_parse(script):
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
