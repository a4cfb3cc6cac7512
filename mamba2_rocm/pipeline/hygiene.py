"""Tree hygiene checks that ``nox -s lint`` runs (and so CI):

- no tracked file speaks of numbered work sessions: a measurement names its device, date and
  commit, and a reader of the project has no use for a session number;
- every commit after :data:`SUBJECT_RULE_SINCE` has a subject of at most
  :data:`MAX_SUBJECT` characters (what changed; the why, the numbers and the commands go in the
  body). Earlier commits are history and are left alone.

``python -m mamba2_rocm.pipeline.hygiene [--root DIR]`` prints each problem and exits 1 when
there is any. Uses git itself (``git grep``, ``git log``): the check sees exactly the tracked
files and the commits a clone has.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

__all__ = ["MAX_SUBJECT", "SUBJECT_RULE_SINCE", "long_subjects", "main", "session_references"]

MAX_SUBJECT = 72
#: the last commit before the subject rule (commits after it are checked)
SUBJECT_RULE_SINCE = "b6d70fe976fba4a87f946b4bc147688109c58211"
#: ``session`` then a number (written so that this file does not match itself)
_SESSION = "session" + r"[[:space:]]+[0-9]"


def _git(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True)


def session_references(root: Path) -> list[str]:
    """``path:line: text`` of every tracked line naming a numbered session."""
    proc = _git(root, "grep", "-n", "-I", "-i", "-E", _SESSION)
    if proc.returncode not in (0, 1):  # 1: no match
        raise RuntimeError(f"git grep failed: {proc.stderr.strip()}")
    return [f"{ln[:160]}: names a work session (say the date, commit or device instead)"
            for ln in proc.stdout.splitlines()]  # fmt: skip


def long_subjects(
    root: Path, since: str = SUBJECT_RULE_SINCE, limit: int = MAX_SUBJECT
) -> list[str]:
    """``sha: subject`` of every commit after ``since`` (up to HEAD) whose subject is longer than
    ``limit`` characters. A history without ``since`` (a shallow clone) checks HEAD alone."""
    has_base = _git(root, "cat-file", "-e", f"{since}^{{commit}}").returncode == 0
    rev = f"{since}..HEAD" if has_base else "-1"
    proc = _git(root, "log", "--format=%h%x00%s", rev)
    if proc.returncode != 0:
        raise RuntimeError(f"git log failed: {proc.stderr.strip()}")
    out = []
    for line in proc.stdout.splitlines():
        sha, subject = line.split("\0", 1)
        if len(subject) > limit:
            out.append(f"{sha}: subject of {len(subject)} characters (at most {limit}): "
                       f"{subject[:80]}...")  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mamba2_rocm.pipeline.hygiene",
                                     description=__doc__.split("\n\n")[0])  # fmt: skip
    parser.add_argument("--root", type=Path, default=Path.cwd(), help="the git work tree")
    args = parser.parse_args(argv)
    problems = session_references(args.root) + long_subjects(args.root)
    for p in problems:
        print(p)
    if problems:
        print(f"hygiene: {len(problems)} problem(s)", file=sys.stderr)
        return 1
    print("hygiene: no session references; commit subjects within the limit")
    return 0


if __name__ == "__main__":
    sys.exit(main())
