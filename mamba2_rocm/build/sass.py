"""The loops of one NVIDIA kernel's SASS, instruction by instruction class: a static count for
kernels bound by how many instructions they issue (chunk_scan is: docs/design.md, SSD forward),
so that a change to a loop body can be weighed on this machine before a GPU times it.

    python -m mamba2_rocm.build.sass CUBIN KERNEL [--loop ADDR] [--top N]

prints each loop (a backward branch and the code it jumps back over) with its static
instruction count and the most frequent opcodes; ``--loop ADDR`` also lists the loop starting
there. Static counts only: a loop body with branches inside it runs a subset of them, so read
the listing for the path a case takes. Needs ``cuobjdump``: CUDA's toolkit has it, and without
one it comes from PyPI (``pip install nvidia-cuda-cuobjdump``: the binary is under
``nvidia/cu13/bin`` in site-packages, which is searched too).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sysconfig
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from mamba2_rocm.build.driver import DEFAULT_CUDA

_INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_BRANCH = re.compile(r"\bBRA\b(?:\s+!?U?P\w+,)?\s+(?:`\(\S+\)\s*)?0x([0-9a-f]+)")
_PREDICATE = re.compile(r"^@!?U?P\w+\s+")


@dataclass(frozen=True)
class Loop:
    start: int  # address of the branch target
    end: int  # address of the backward branch
    instructions: tuple[tuple[int, str], ...]

    def opcodes(self) -> Counter:
        """Opcode (without modifiers or predicate) -> count over the loop's instructions."""
        return Counter(opcode(text) for _, text in self.instructions)


def opcode(text: str) -> str:
    """'@!P0 LDG.E.128 R4, [R2]' -> 'LDG'."""
    return _PREDICATE.sub("", text).split()[0].split(".")[0]


def parse(sass: str) -> list[tuple[int, str]]:
    """(address, instruction) of every instruction in cuobjdump -sass text."""
    return [(int(m.group(1), 16), m.group(2)) for m in _INSTR.finditer(sass)]


def loops(instructions: list[tuple[int, str]]) -> list[Loop]:
    """Every backward branch with the instructions from its target to it, in address order."""
    index = {addr: i for i, (addr, _) in enumerate(instructions)}
    found = []
    for i, (addr, text) in enumerate(instructions):
        m = _BRANCH.search(text)
        if not m:
            continue
        target = int(m.group(1), 16)
        if target < addr and target in index:
            found.append(Loop(target, addr, tuple(instructions[index[target] : i + 1])))
    return found


def find_cuobjdump() -> str:
    """cuobjdump from PATH, $CUDA_HOME/bin (default ``driver.DEFAULT_CUDA``), or the PyPI wheel."""
    cuda = Path(os.environ.get("CUDA_HOME", DEFAULT_CUDA))
    candidates = [shutil.which("cuobjdump"), str(cuda / "bin" / "cuobjdump")]
    purelib = Path(sysconfig.get_paths()["purelib"])
    candidates += [str(p) for p in sorted(purelib.glob("nvidia/cu*/bin/cuobjdump"))]
    for c in candidates:
        if c and Path(c).is_file():
            return c
    raise FileNotFoundError(
        "no cuobjdump: install CUDA's toolkit or `pip install nvidia-cuda-cuobjdump`"
    )


def kernel_sass(cubin: Path, kernel: str) -> str:
    """cuobjdump -sass of one kernel of a cubin."""
    out = subprocess.run(
        [find_cuobjdump(), "-sass", "-fun", kernel, str(cubin)],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    if not parse(out.stdout):
        raise ValueError(f"{cubin} has no SASS for kernel {kernel!r}")
    return out.stdout


def report(instructions: list[tuple[int, str]], top: int = 12, listing: int | None = None) -> str:
    lines = [f"{len(instructions)} instructions"]
    for lp in loops(instructions):
        mix = ", ".join(f"{op} {n}" for op, n in lp.opcodes().most_common(top))
        lines.append(
            f"loop {lp.start:#06x}-{lp.end:#06x}: {len(lp.instructions)} instructions: {mix}"
        )
        if listing == lp.start:
            lines += [f"  {addr:#06x}  {text}" for addr, text in lp.instructions]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m mamba2_rocm.build.sass", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("cubin", type=Path)
    p.add_argument("kernel")
    p.add_argument("--loop", type=lambda s: int(s, 16), help="list the loop at this address")
    p.add_argument("--top", type=int, default=12, help="opcodes shown per loop")
    args = p.parse_args(argv)
    try:
        print(report(parse(kernel_sass(args.cubin, args.kernel)), args.top, args.loop))
    except (FileNotFoundError, ValueError, subprocess.CalledProcessError) as e:
        p.error(str(e))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
