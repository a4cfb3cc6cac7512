"""build.sass: loops of a kernel's SASS by instruction class (static counts for loop bodies)."""

import pytest

from mamba2_rocm.build import sass

SASS = """
        code for sm_90
                Function : m2r_example
        /*0000*/                   MOV R1, c[0x0][0x28] ;                      /* 0x00000a0000017a02 */
        /*0010*/                   S2R R0, SR_TID.X ;                          /* 0x0000000000007919 */
        /*0020*/                   LDS R2, [R0] ;                              /* 0x0000000000027984 */
        /*0030*/              @!P0 LDG.E.128 R4, desc[UR6][R2.64] ;            /* 0x0000000000049981 */
        /*0040*/                   HMMA.16816.F32.BF16 R8, R4, R6, R8 ;        /* 0x0000000000089981 */
        /*0050*/                   ISETP.GE.AND P0, PT, R0, 0x10, PT ;         /* 0x0000000000009981 */
        /*0060*/               @P0 BRA 0x20 ;                                  /* 0x0000000000009981 */
        /*0070*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;               /* 0x0000000000009981 */
        /*0080*/              @!P1 BRA P2, 0x90 ;                              /* 0x0000000000009981 */
        /*0090*/                   FMUL R3, R2, R2 ;                           /* 0x0000000000009981 */
        /*00a0*/                   BRA `(.L_x_1) 0x70 ;                        /* 0x0000000000009981 */
        /*00b0*/                   EXIT ;                                      /* 0x0000000000009981 */
"""


def test_parse_and_loops():
    ins = sass.parse(SASS)
    assert len(ins) == 12 and ins[3] == (0x30, "@!P0 LDG.E.128 R4, desc[UR6][R2.64]")
    found = sass.loops(ins)
    # the branch at 0x60 back to 0x20, and the one at 0xa0 back to 0x70 (0x80 goes forward)
    assert [(lp.start, lp.end, len(lp.instructions)) for lp in found] == [
        (0x20, 0x60, 5),
        (0x70, 0xA0, 4),
    ]
    assert found[0].opcodes() == {"LDS": 1, "LDG": 1, "HMMA": 1, "ISETP": 1, "BRA": 1}
    assert sass.opcode("@!UP0 LDG.E.128 R4, [R2]") == "LDG"


def test_report_lists_a_loop():
    text = sass.report(sass.parse(SASS), top=2, listing=0x20)
    assert text.splitlines()[0] == "12 instructions"
    assert "loop 0x0020-0x0060: 5 instructions: " in text
    assert "  0x0040  HMMA.16816.F32.BF16 R8, R4, R6, R8" in text
    assert "0x0090  FMUL" not in text  # only the loop asked for is listed


def test_cuobjdump_from_the_pypi_wheel_else_named(monkeypatch, tmp_path):
    monkeypatch.setattr(sass.shutil, "which", lambda _: None)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "cuda"))
    monkeypatch.setattr(sass.sysconfig, "get_paths", lambda: {"purelib": str(tmp_path)})
    with pytest.raises(FileNotFoundError, match="pip install nvidia-cuda-cuobjdump"):
        sass.find_cuobjdump()
    wheel_bin = tmp_path / "nvidia" / "cu13" / "bin"
    wheel_bin.mkdir(parents=True)
    (wheel_bin / "cuobjdump").write_text("")
    assert sass.find_cuobjdump() == str(wheel_bin / "cuobjdump")
