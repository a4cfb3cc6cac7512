"""The tree hygiene lint (``mamba2_rocm.pipeline.hygiene``): numbered work sessions named in
tracked files, and commit subjects over the limit after the rule's first commit."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from mamba2_rocm.pipeline import hygiene

REPO = Path(__file__).resolve().parents[2]
WORD = "Sess" + "ion"  # (so that this file does not trip the check itself)


def _git(root: Path, *args: str) -> str:
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.invalid", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@example.invalid", "HOME": str(root), "PATH": "/usr/bin:/bin"}  # fmt: skip
    return subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True,
                          text=True, env=env).stdout.strip()  # fmt: skip


def _commit(root: Path, name: str, text: str, subject: str) -> str:
    (root / name).write_text(text)
    _git(root, "add", name)
    _git(root, "commit", "-q", "-m", subject)
    return _git(root, "rev-parse", "HEAD")


@pytest.fixture
def repo(tmp_path):
    _git(tmp_path, "init", "-q")
    return tmp_path


def test_session_numbers_are_found_case_insensitively(repo):
    _commit(repo, "a.md", f"measured in {WORD.lower()} 37 on an H200\n", "a")
    _commit(repo, "b.py", f"# {WORD}\t38's sweep\nnox session build-gfx1030\n", "b")
    found = hygiene.session_references(repo)
    assert [f.split(":")[0] for f in found] == ["a.md", "b.py"]
    assert all("names a work session" in f for f in found)


def test_a_clean_tree_passes(repo):
    _commit(repo, "a.md", "nox -s build-gfx1030 runs one session per recipe\n", "a")
    assert hygiene.session_references(repo) == []


def test_long_subjects_after_the_rule_only(repo):
    base = _commit(repo, "a", "1", "x" * 200)  # history before the rule: left alone
    _commit(repo, "b", "2", "y" * 72)
    _commit(repo, "c", "3", "z" * 73)
    found = hygiene.long_subjects(repo, since=base)
    assert len(found) == 1 and "subject of 73 characters (at most 72)" in found[0]


def test_a_clone_without_the_base_checks_head(repo):
    _commit(repo, "a", "1", "w" * 90)
    [found] = hygiene.long_subjects(repo, since="0" * 40)
    assert "90 characters" in found


def test_main_reports_and_fails(repo, capsys):
    _commit(repo, "a.md", f"{WORD} 12 said so\n", "a")
    assert hygiene.main(["--root", str(repo)]) == 1
    assert "a.md:1:" in capsys.readouterr().out


def test_this_tree_is_clean():
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    assert hygiene.session_references(REPO) == []
    assert hygiene.long_subjects(REPO) == []
