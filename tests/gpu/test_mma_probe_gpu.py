"""The matrix-core interface's self-test (csrc/mma_probe.hip) on whatever build serves the GPU:
the NVIDIA build (mma.sync), each emulation variant (gfx11 / gfx12 WMMA, gfx9 MFMA on wave64)
and, on a self-hosted AMD runner, the hardware itself. Operands are chosen so that every value
of D names its source: a wrong ``load_lane`` / ``load_lane_t`` / ``acc_row`` / ``acc_col`` fails
naming the formula and the cells it misplaced, not as a tolerance miss deep in the SSD."""

import pytest
import torch
from helpers import gpu_available

from mamba2_rocm.arch import MMA_PATHS, arch_info, expected_mma_path

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpu_available(), reason="needs a GPU")]
DEV = "cuda"
DTYPES = [torch.float16, torch.bfloat16]
IDS = ["f16", "bf16"]


@pytest.fixture(scope="module")
def build():
    from mamba2_rocm.runtime.loader import kernels_for_device

    kset = kernels_for_device(0)
    if kset is None:
        pytest.fail("no kernels serve this GPU: the self-test needs the kernel tier")
    return kset.kdir.manifest


def _probe(a, b, c, **kw):
    from mamba2_rocm.ops.mma_probe import run_mma_probe

    res = run_mma_probe(a, b, c, **kw)
    torch.cuda.synchronize()
    return res


def _matrix_or_skip(build):
    if expected_mma_path(build["target"], build.get("emulates")) == 0:
        pytest.skip("this build has no matrix-core path (the gfx10.3 FMA world): nothing to probe")


def _ids(n=16):
    """v[i][j] = 16 i + j + 1: every entry names its (row, col), exact in fp16 and bf16."""
    return torch.arange(1, n * n + 1, dtype=torch.float32, device=DEV).reshape(n, n)


def _misplaced(got, want, source: str) -> list[str]:
    """'D[r][c] = <source>[i][j]' for each cell holding another cell's value (first 8)."""
    bad = (got != want).nonzero().tolist()
    out = []
    for r, c in bad[:8]:
        v = got[r, c].item()
        src = (
            f"{source}[{int(v - 1) // 16}][{int(v - 1) % 16}]"
            if v == v and 1 <= v <= 256 and v == int(v)
            else repr(v)
        )
        out.append(f"D[{r}][{c}] = {src}, want {source}[{r}][{c}]")
    return out + ([f"... {len(bad)} cells in all"] if len(bad) > 8 else [])


def test_build_takes_its_targets_path(build):
    """The code object holds the path its target (or emulation) should take: a build that
    silently fell back (a lost emulation flag, a target without its matrix cores) fails here."""
    res = _probe(*(torch.zeros(16, 16, device=DEV, dtype=t) for t in (torch.float16,) * 2),
                 torch.zeros(16, 16, device=DEV))  # fmt: skip
    emulates = build.get("emulates")
    want = expected_mma_path(build["target"], emulates)
    assert res.path == want, (
        f"{build['target']} (emulates {emulates}): M2R_MMA {res.path} ({MMA_PATHS.get(res.path)}), want {want} ({MMA_PATHS[want]})"
    )
    from mamba2_rocm.build.driver import CLANG_EMULATIONS, EMULATED_WAVEFRONT

    wave = EMULATED_WAVEFRONT.get(emulates) or arch_info(build["target"]).wavefront_size
    assert res.wavefront == wave
    assert res.emulated == (emulates in CLANG_EMULATIONS)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_accumulator_layout_acc_row_acc_col(build, dtype):
    """A = B = 0, C names its cells: D must be C, and every cell written exactly once (acc_row /
    acc_col a bijection of (lane, register) onto the 16x16 tile)."""
    _matrix_or_skip(build)
    zero = torch.zeros(16, 16, device=DEV, dtype=dtype)
    res = _probe(zero, zero, _ids())
    holes = (res.hits != 1).nonzero().tolist()
    assert not holes, (
        f"acc_row/acc_col: cells written != once: {[(r, c, res.hits[r, c].item()) for r, c in holes[:8]]}"
    )
    assert not _misplaced(res.d, _ids(), "C"), "acc_row/acc_col: " + "; ".join(
        _misplaced(res.d, _ids(), "C")
    )


@pytest.mark.parametrize("k_major", [False, True], ids=["load_lane", "load_lane_t"])
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_a_fragment_layout(build, dtype, k_major):
    """B = I: D = A, each cell naming the A element that reached it (A staged as the kernels
    stage it: rows of k, or k-major read by load_lane_t)."""
    _matrix_or_skip(build)
    eye = torch.eye(16, device=DEV, dtype=dtype)
    res = _probe(_ids().to(dtype), eye, torch.zeros(16, 16, device=DEV), a_k_major=k_major)
    wrong = _misplaced(res.d, _ids(), "A")
    assert not wrong, f"A operand via {'load_lane_t' if k_major else 'load_lane'}: " + "; ".join(
        wrong
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_a_fragment_built_in_registers(build, dtype):
    """B = I with A built by each lane from the elements a_row / a_k name (make_a): D = A, each
    cell naming the A element that reached it; then a random exact product."""
    _matrix_or_skip(build)
    eye = torch.eye(16, device=DEV, dtype=dtype)
    res = _probe(_ids().to(dtype), eye, torch.zeros(16, 16, device=DEV), a_in_registers=True)
    wrong = _misplaced(res.d, _ids(), "A")
    assert not wrong, "A operand via a_row / a_k / make_a: " + "; ".join(wrong)
    gen = torch.Generator(device=DEV).manual_seed(torch.seed() % 2**31)
    a = torch.randint(-8, 9, (16, 16), device=DEV, generator=gen).float()
    b = torch.randint(-8, 9, (16, 16), device=DEV, generator=gen).float()
    for b_k_major in (False, True):
        res = _probe(a.to(dtype), b.to(dtype), torch.zeros(16, 16, device=DEV),
                     a_in_registers=True, b_k_major=b_k_major)  # fmt: skip
        assert torch.equal(res.d, (a.double() @ b.double().T).float())
        assert torch.equal(res.hits, torch.ones_like(res.hits))


@pytest.mark.parametrize("k_major", [False, True], ids=["load_lane", "load_lane_t"])
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_b_fragment_layout(build, dtype, k_major):
    """A = I: D = B^T, D[m][n] naming B[n][m]."""
    _matrix_or_skip(build)
    eye = torch.eye(16, device=DEV, dtype=dtype)
    res = _probe(eye, _ids().to(dtype), torch.zeros(16, 16, device=DEV), b_k_major=k_major)
    wrong = _misplaced(res.d.T, _ids(), "B")
    assert not wrong, (
        f"B operand via {'load_lane_t' if k_major else 'load_lane'} (cells of D^T): "
        + "; ".join(wrong)
    )


@pytest.mark.parametrize("mode", range(4), ids=["nn", "tn", "nt", "tt"])
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_product_is_exact(build, dtype, mode):
    """Small random integers: C + A B^T is exact in fp32, so D must equal it bit for bit, for
    every staging of the operands; fresh inputs per run."""
    _matrix_or_skip(build)
    gen = torch.Generator(device=DEV).manual_seed(torch.seed() % 2**31)
    a = torch.randint(-8, 9, (16, 16), device=DEV, generator=gen).float()
    b = torch.randint(-8, 9, (16, 16), device=DEV, generator=gen).float()
    c = torch.randint(-100, 101, (16, 16), device=DEV, generator=gen).float()
    res = _probe(a.to(dtype), b.to(dtype), c, a_k_major=bool(mode & 1), b_k_major=bool(mode & 2))
    want = (c.double() + a.double() @ b.double().T).float()
    assert torch.equal(res.d, want), f"max error {(res.d - want).abs().max().item()}"
    assert torch.equal(res.hits, torch.ones_like(res.hits))
