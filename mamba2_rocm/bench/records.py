"""Benchmark results as records, and ``docs/performance.md`` generated from them.

``python -m mamba2_rocm bench <op> ... --record`` writes one JSON file per run under
``records/bench/``: the op, the command, the date (UTC), the commit (and whether the tree had
uncommitted changes), the device and its software (GPU name and arch, driver, torch, Triton,
Python, the kernel build the timings are of) and the bench's rows as it printed them.

``python -m mamba2_rocm.bench.records [--check]`` renders ``docs/performance.md`` from the
newest record of each (device, op): one table per record, each of our implementation's rows
beside each peer's with the ratio (peer time / ours: > 1 means ours is faster) and the share of
measured copy bandwidth where the bench reports it; rows of other shapes (``bench generate``,
``bench model``) as they are. ``--check`` exits 1 when the committed file differs from what the
records give (a test runs the same check). Records are data, never edited by hand: a new
measurement is a new record.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import re
import subprocess
import sys
from pathlib import Path

__all__ = ["FORMAT", "environment", "load", "newest", "render", "write"]

FORMAT = 1
REPO = Path(__file__).resolve().parents[2]
RECORDS = REPO / "records" / "bench"
DOC = REPO / "docs" / "performance.md"
#: our implementation's names in the bench rows: "kernel", or "mamba2-rocm kernel" and its
#: variants ("mamba2-rocm kernel (channel-last)"); the other rows are peers, except a copy of the
#: same bytes, which is a floor (shown, and as "% of copy", but not a peer)
OURS = "kernel"


def is_ours(impl: str | None) -> bool:
    return impl == OURS or (impl or "").startswith("mamba2-rocm")


def _is_floor(impl: str) -> bool:
    return impl.startswith("copy")


def _git(*args: str, env: dict | None = None, repo: Path | None = None) -> str | None:
    try:
        proc = subprocess.run(["git", "-C", str(repo or REPO), *args], capture_output=True,
                              text=True, timeout=30, env=env)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


def tree(repo: Path | None = None) -> str | None:
    """The git tree id of the checkout's tracked files as they are on disk, uncommitted changes
    included: equal to the tree of any commit with the same content (``git log --format='%h
    %T'`` finds it), so a record made from a dirty checkout still names exactly what ran.
    Computed through a scratch index; the checkout's own index is untouched."""
    import os
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "GIT_INDEX_FILE": str(Path(tmp) / "index")}
        if _git("read-tree", "HEAD", env=env, repo=repo) is None:
            return None
        if _git("add", "-u", ".", env=env, repo=repo) is None:
            return None
        return _git("write-tree", env=env, repo=repo)


def commit() -> tuple[str | None, bool]:
    """``(sha, dirty)`` of the checkout the bench ran from (None outside a git checkout)."""
    sha = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--untracked-files=no")
    return sha, bool(status)


def environment() -> dict:
    """The device and software a record's numbers belong to (no host or user names)."""
    import torch

    env: dict = {"python": platform.python_version(), "torch": torch.__version__}
    try:
        import triton

        env["triton"] = triton.__version__
    except Exception:
        env["triton"] = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        env["device"] = props.name
        from mamba2_rocm.runtime.device import device_arch_full

        env["arch"] = device_arch_full(torch.cuda.current_device())  # (gfx90a:…, or sm_90)
        env["runtime"] = (
            f"HIP {torch.version.hip}" if torch.version.hip else f"CUDA {torch.version.cuda}"
        )
        env["driver"] = _driver_version()
        from mamba2_rocm.bench.timing import kernel_build_note

        env["kernels"] = re.sub(r" from \S+", "", kernel_build_note())  # (no paths)
    return env


def _driver_version() -> str | None:
    for cmd in (["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                ["rocm-smi", "--showdriverversion", "--csv"]):  # fmt: skip
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip().splitlines()[-1].strip()
    return None


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def write(op: str, command: str, rows: list[dict], out_dir: Path = RECORDS,
          env: dict | None = None, now: dt.datetime | None = None) -> Path:  # fmt: skip
    """Write the record of one bench run; returns its path."""
    now = now or dt.datetime.now(dt.timezone.utc)
    env = environment() if env is None else env
    sha, dirty = commit()
    record = {"format": FORMAT, "op": op, "command": command,
              "date": now.strftime("%Y-%m-%dT%H:%M:%SZ"), "commit": sha, "dirty": dirty,
              "tree": tree(), "environment": env, "rows": rows}  # fmt: skip
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = now.strftime("%Y%m%dT%H%M%SZ")
    path = out_dir / f"{stamp}-{_slug(env.get('device') or 'cpu')}-{_slug(op)}.json"
    path.write_text(json.dumps(record, indent=1) + "\n")  # (the rows' keys in the bench's order)
    return path


def load(records_dir: Path = RECORDS) -> list[dict]:
    """Every record under ``records_dir`` (format checked), oldest first."""
    out = []
    for path in sorted(Path(records_dir).glob("*.json")):
        rec = json.loads(path.read_text())
        if rec.get("format") != FORMAT or not {"op", "date", "rows", "environment"} <= set(rec):
            raise ValueError(f"{path}: not a bench record of format {FORMAT}")
        rec["_file"] = path.name
        out.append(rec)
    return sorted(out, key=lambda r: r["date"])


def newest(records: list[dict]) -> list[dict]:
    """The newest record of each (device, op, command), in a stable order."""
    best: dict = {}
    for rec in records:
        key = (rec["environment"].get("device") or "cpu", rec["op"], rec.get("command", ""))
        if key not in best or rec["date"] >= best[key]["date"]:
            best[key] = rec
    return [best[k] for k in sorted(best)]


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.1f}" if abs(v) >= 10 else f"{v:.2f}" if abs(v) >= 1 else f"{v:.3g}"
    return "-" if v is None else str(v)


def _bandwidth_table(rows: list[dict]) -> list[str]:
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    peers = [i for i in impls if not is_ours(i) and not _is_floor(i)]
    head = ["case", *(f"{i} µs" for i in impls), *(f"{p} / ours" for p in peers), "ours % of copy"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for case in dict.fromkeys(r["case"] for r in rows):
        by = {r["impl"]: r for r in rows if r["case"] == case}
        mine = next((by[i] for i in by if is_ours(i)), {})  # (one of ours per case)
        ours = mine.get("best_us")
        cells = [case, *(_fmt(by.get(i, {}).get("best_us")) for i in impls)]
        for p in peers:
            theirs = by.get(p, {}).get("best_us")
            cells.append(f"{theirs / ours:.2f}x" if ours and theirs else "-")
        frac = mine.get("copy_frac")
        cells.append(f"{100 * frac:.1f}%" if isinstance(frac, float) else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _plain_table(rows: list[dict]) -> list[str]:
    """A column per key with scalar values (nested lists / dicts, e.g. a side's kernel names or
    per-op host times, stay in the record's JSON only)."""
    keys = [k for k in dict.fromkeys(k for r in rows for k in r)
            if not any(isinstance(r.get(k), (dict, list, tuple)) for r in rows)]  # fmt: skip
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(_fmt(r.get(k)) for k in keys) + " |" for r in rows]
    return lines


def render(records: list[dict]) -> str:
    """``docs/performance.md`` for these records (the newest per device and op)."""
    out = ["# Performance", "",
           "Generated by `python -m mamba2_rocm.bench.records` from the newest record per device",
           "and command under `records/bench/` (written by `python -m mamba2_rocm bench <op> "
           "--record`);", "do not edit by hand. Times are the better of per-call and graph "
           "medians; `peer / ours` > 1 means ours is faster.", ""]  # fmt: skip
    chosen = newest(records)
    if not chosen:
        out += ["No records yet: nothing here has been measured into a record.", ""]
    for rec in chosen:
        env = rec["environment"]
        sha = (rec.get("commit") or "?")[:12]
        if rec.get("dirty"):
            sha += (f" with uncommitted changes (source tree {rec['tree'][:12]})"
                    if rec.get("tree") else " (uncommitted changes)")  # fmt: skip
        what = rec["op"] + (" forward + backward" if "--backward" in rec.get("command", "") else "")
        out += [f"## {what} on {env.get('device', 'CPU')}", "",
                f"`{rec.get('command', '')}` — {rec['date']}, commit {sha}; "
                f"{env.get('arch', '-')}, {env.get('runtime', '-')}, driver {env.get('driver') or '-'}, "
                f"torch {env.get('torch')}, Triton {env.get('triton') or '-'}; {env.get('kernels', '')}",
                ""]  # fmt: skip
        # a bench's closing summary (lines of text) follows its table
        summary = [line for r in rec["rows"] if set(r) == {"summary"} for line in r["summary"]]
        rows = [r for r in rec["rows"] if set(r) != {"summary"}]
        if rows and all({"case", "impl", "best_us"} <= set(r) for r in rows):
            out += _bandwidth_table(rows)
        elif rows:
            out += _plain_table(rows)
        if summary:
            out += ["", *(f"- {line}" for line in summary)]
        out.append("")
    return "\n".join(out).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mamba2_rocm.bench.records",
                                     description="render docs/performance.md from records/bench/")  # fmt: skip
    parser.add_argument("--records", type=Path, default=RECORDS)
    parser.add_argument("--out", type=Path, default=DOC)
    parser.add_argument("--check", action="store_true",
                        help="exit 1 when the file differs from what the records give")  # fmt: skip
    args = parser.parse_args(argv)
    text = render(load(args.records) if args.records.is_dir() else [])
    if args.check:
        same = args.out.is_file() and args.out.read_text() == text
        print(f"{args.out}: {'up to date' if same else 'differs from the records (regenerate it)'}")
        return 0 if same else 1
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
