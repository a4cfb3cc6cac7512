"""The ctypes structs match csrc/params.h field by field, as the host C++ compiler lays it out."""

import ctypes
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from mamba2_rocm.kernels import SOURCES
from mamba2_rocm.params import packer

CSRC = Path(__file__).resolve().parents[1] / "csrc"
# every struct a kernel takes: one left out of this list would go unchecked
STRUCTS = sorted({src.params for src in SOURCES.values()}, key=lambda s: s.__name__)


@pytest.fixture(scope="module")
def c_layout(tmp_path_factory):
    cxx = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if cxx is None:
        pytest.fail("a host C++ compiler (g++) is needed to check csrc/params.h")
    lines = ["#include <stdio.h>", "#include <stddef.h>", '#include "params.h"', "int main() {"]
    for st in STRUCTS:
        name = st.__name__
        lines.append(f'printf("{name} size %zu\\n", sizeof({name}));')
        for field, _ in st._fields_:
            lines.append(f'printf("{name} {field} %zu\\n", offsetof({name}, {field}));')
    lines.append("return 0; }")
    tmp = tmp_path_factory.mktemp("params")
    (tmp / "p.cpp").write_text("\n".join(lines))
    subprocess.run([cxx, "-I", str(CSRC), "-o", str(tmp / "p"), str(tmp / "p.cpp")], check=True)
    out = subprocess.run([str(tmp / "p")], check=True, capture_output=True, text=True).stdout
    return {tuple(line.split()[:2]): int(line.split()[2]) for line in out.splitlines()}


@pytest.mark.parametrize("struct", STRUCTS, ids=lambda s: s.__name__)
def test_struct_matches_header(struct, c_layout):
    name = struct.__name__
    assert c_layout[(name, "size")] == ctypes.sizeof(struct)
    for field, _ in struct._fields_:
        assert c_layout[(name, field)] == getattr(struct, field).offset, field


def test_header_has_no_fields_we_do_not_mirror():
    text = (CSRC / "params.h").read_text()
    for struct in STRUCTS:
        body = text.split(f"struct {struct.__name__} {{")[1].split("};")[0]
        declared = set()
        for line in body.splitlines():
            code = line.split("//")[0].strip().rstrip(";")
            if not code:
                continue
            declared.update(re.findall(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:,|$)", code))
        assert declared == {f for f, _ in struct._fields_}


def test_every_kernel_is_defined_in_its_source():
    for src in SOURCES.values():
        text = (CSRC / src.filename).read_text()
        assert src.params.__name__ in text, src.name


def _int_constants(*names: str) -> dict[str, int]:
    """The ``constexpr int kName = N;`` constants of these csrc sources."""
    text = "".join((CSRC / name).read_text() for name in names)
    return {m[0]: int(m[1]) for m in re.findall(r"constexpr int (k\w+) = (\d+);", text)}


def test_launch_geometry_matches_kernel_constants():
    """The grid the ops compute must cover what each kernel block processes."""
    import mamba2_rocm.ops.conv1d as ops

    consts = _int_constants("conv1d_fwd.hip", "conv1d_update.hip")
    assert consts["kThreads"] == ops._THREADS
    assert consts["kUpdateThreads"] == ops._THREADS
    assert (consts["kLongThreads"], consts["kRowVecs"]) == (ops._LONG_THREADS, ops._ROW_VECS)
    assert consts["kClPosPerThread"] == ops._CL_POS
    assert (consts["kShortThreads"], consts["kShortVecs"]) == (ops._SHORT_THREADS, ops._SHORT_VECS)
    assert (consts["kMultiRows"], consts["kMultiVecs"]) == (ops._MULTI_ROWS, ops._MULTI_VECS)
    bwd = (CSRC / "conv1d_bwd.hip").read_text()
    cb = {m[0]: int(m[1]) for m in re.findall(r"(k\w+) = (\d+)[;,]", bwd)}
    assert cb["kThreads"] == ops._BWD_THREADS
    assert (cb["kRowsC"], cb["kRowsL"]) == ops._BWD_ROWS
    assert (cb["kClC"], cb["kClL"]) == ops._BWD_CL
    assert (cb["kWalkThreads"], cb["kWalkTile"]) == (ops._WALK_THREADS, ops._WALK_TILE)
    assert (cb["kRLanes"], cb["kRWalkTile"]) == (ops._RWALK_LANES, ops._RWALK_TILE)
    assert cb["kReduceThreads"] == ops._REDUCE_THREADS
    from mamba2_rocm.ops._launch import COLUMN_SUM_COLS

    assert _int_constants("block_reduce.h")["kColumnSumCols"] == COLUMN_SUM_COLS  # both reduces
    import mamba2_rocm.ops.rmsnorm as norm

    for name in ("rmsnorm.hip", "rmsnorm_bwd.hip"):
        assert _int_constants(name)["kThreads"] == norm._THREADS, name
    assert _int_constants("rmsnorm_bwd.hip")["kRowMaxThreads"] == norm.RMSNORM_BWD_ROW_MAX_THREADS
    import mamba2_rocm.ops.ssd as ssd

    for name, pairs in (
        (
            "ssd_common.h",
            {
                "kThreads": ssd._THREADS,
                "kHeadsPerCumsum": ssd._CUMSUM_HEADS,
                "kStateP": ssd._STATE_TILES[0],
                "kStateN": ssd._STATE_TILES[1],
            },
        ),
        ("ssd_state_passing.hip", {"kPassVec": ssd._PASS_VEC}),
        (
            "ssd_bwd_common.h",
            {
                "kThreads": ssd._THREADS,
                "kTile": ssd._BWD_TILE,
                "kPassVec": ssd._PASS_VEC,
            },
        ),
    ):
        cs = _int_constants(name)
        assert {k: cs[k] for k in pairs} == pairs, name
    import mamba2_rocm.ops.state_update as ssu

    ssu_text = (CSRC / "state_update.hip").read_text()
    assert _int_constants("state_update.hip")["kThreads"] == ssu._THREADS
    assert (
        int(re.search(r"#define M2R_SSU_ROWS_PER_WIDE (\d+)", ssu_text)[1]) == ssu.SSU_ROWS_PER_WIDE
    )


def test_every_struct_packs_to_its_ctypes_size():
    """The launch path packs with struct (no implicit padding): the layouts must agree."""
    for params in STRUCTS:
        assert packer(params).size == ctypes.sizeof(params), params.__name__


def test_a_value_too_large_for_its_field_is_named():
    """A dimension >= 2**31 in a 32-bit field: the error names the field and the value (#19),
    not struct's format message."""
    import struct

    from mamba2_rocm.params import SsdParams, explain_pack_error, packer

    values = [0] * len(SsdParams._fields_)
    names = [n for n, _ in SsdParams._fields_]
    values[names.index("seqlen")] = 2**31
    values[names.index("dt_min")] = 0.0
    values[names.index("dt_max")] = 1.0
    with pytest.raises(struct.error):
        packer(SsdParams).pack(*values)
    err = explain_pack_error(SsdParams, tuple(values))
    assert "SsdParams.seqlen = 2147483648" in str(err) and "32-bit" in str(err)


def test_launcher_raises_the_named_error():
    import ctypes
    import types

    from mamba2_rocm.params import ConvUpdateParams
    from mamba2_rocm.runtime.loader import Launcher

    driver = types.SimpleNamespace(launch=lambda *a: pytest.fail("must not launch"))
    launcher = Launcher("m2r_test", ctypes.c_void_p(0), ConvUpdateParams, driver)
    values = [0] * len(ConvUpdateParams._fields_)
    values[[n for n, _ in ConvUpdateParams._fields_].index("dim")] = 2**40
    with pytest.raises(ValueError, match=r"ConvUpdateParams.dim = 1099511627776 does not fit"):
        launcher(tuple(values), (1, 1, 1), (1, 1, 1), 0)
