"""Graph decode per token with the decode step's weight prefetch (ops.linear.prefetch_beside)
always on, never on, and as the rule has it (only for products of up to PREFETCH_MAX_ROWS rows),
on a 1.3b-like MambaLMHeadModel (random init, bf16).

Usage (on the GPU machine, kernels built): python scripts/tune_prefetch.py
Each setting recaptures the decode graph; per-token µs as ``bench generate`` takes them
(bench.model.per_token_ms: generate(65 new) against generate(1 new), the median of 3 pairs a
turn), the settings alternating in rotating order over ``ROUNDS`` (4) turns; medians and every
turn's value are printed per batch of ``BATCHES="16 1"``.
"""

import os
import statistics

import torch

from mamba2_rocm.bench.generate import config_kwargs
from mamba2_rocm.bench.model import _time_once_ms, per_token_ms
from mamba2_rocm.bench.timing import env_items
from mamba2_rocm.models import MambaConfig, MambaLMHeadModel
from mamba2_rocm.ops import linear as lin

SETTINGS = {"always": (True, 1 << 30), "never": (False, 0), "rule": (True, lin.PREFETCH_MAX_ROWS)}


def main() -> None:
    os.environ.setdefault("MAMBA2_ROCM_BACKEND", "kernel")
    torch.manual_seed(0)
    model = MambaLMHeadModel(MambaConfig(**config_kwargs("1.3b")), device="cuda",
                             dtype=torch.bfloat16)  # fmt: skip
    gen = torch.Generator(device="cuda").manual_seed(1)
    rounds = int(os.environ.get("ROUNDS", "4"))
    for batch in env_items("BATCHES", (16, 1), int):
        start = torch.randint(0, model.config.vocab_size, (batch, 16), device="cuda", generator=gen)

        def generate(n, start=start):
            with torch.no_grad():
                model.generate(start, max_length=start.shape[1] + n, cg=True, top_k=1)

        per: dict = {name: [] for name in SETTINGS}
        names = list(SETTINGS)
        for r in range(rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                lin.PREFETCH, lin.PREFETCH_MAX_ROWS = SETTINGS[name]
                model._decoding_cache = None  # a fresh capture under this setting
                generate(65)  # the capture
                ms = per_token_ms(_time_once_ms(torch), lambda: generate(65), lambda: generate(1),
                                  64, pairs=3)  # fmt: skip
                per[name].append(ms * 1e3)
        lin.PREFETCH, lin.PREFETCH_MAX_ROWS = SETTINGS["rule"]
        cells = [f"{name} {statistics.median(v):.1f} us ({batch / statistics.median(v) * 1e6:.0f} "
                 f"tok/s) {[round(x) for x in v]}" for name, v in per.items()]  # fmt: skip
        print(f"b{batch}: " + "; ".join(cells), flush=True)


if __name__ == "__main__":
    main()
