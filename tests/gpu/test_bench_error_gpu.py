"""``bench ssd-error``'s harness on the GPU: the kernel tier's output error against the float64
recurrence stays near the rounding floor in every dtype (the bench's numbers are only worth
reading if the harness measures the kernels, not the torch tier)."""

import pytest
from helpers import gpu_available

from mamba2_rocm.bench import ssd_error

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpu_available(), reason="needs a GPU")]

CASES = {
    "odd": (2, 131, 5, 40, 1, 32, 64, ()),
    "varlen": (1, 301, 4, 64, 2, 64, 128, ("varlen",)),
}


def test_kernel_error_is_near_the_rounding_floor(monkeypatch):
    monkeypatch.setattr(ssd_error.ssd_bench, "_triton_scan", lambda: None)  # (ours only)
    rows = [r for r in ssd_error.run(cases=CASES) if "summary" not in r]
    assert len(rows) == 6 and {r["impl"] for r in rows} == {"kernel"}
    for r in rows:
        if r["dtype"] == "float32":
            assert r["rel_rms"] < 1e-4, r
        else:  # 16-bit outputs: within a few roundings of the floor
            assert r["floor_rel_rms"] <= r["rel_rms"] < 3 * r["floor_rel_rms"], r
