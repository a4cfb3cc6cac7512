"""Calibrate the SSD forward's state passing on this GPU: every point of ``bench ssd``'s grid
run three ways (``mamba_chunk_scan_combined``, bf16, CUDA/HIP-graph time per call, the better of
two rounds each): separate (chunk_state, then the state-passing kernel), chained with the link
from the accumulators, chained with the link through LDS; against the path the host rules
(``mamba2_rocm.ops.ssd._chained``, table ``CHAIN_CHAINS_PER_SM``; ``_lds_link``,
``CHAIN_LDS_CHAINS_PER_SM``) pick on this GPU. Prints one line per point and a summary of the
points where the rules' pick is more than 0.5% slower than the fastest; ``--json FILE`` writes
the rows. This is how the rules were measured on the H100; an AMD runner reruns it to see whether
its multiprocessor count moves the steps.

Usage (kernels built, on the GPU machine): python scripts/sweep_ssd_chain.py [--json FILE]
"""

import argparse
import json
import math

import torch
from profile_ssd import make_call  # (scripts/, on the path when run as a script)

from mamba2_rocm import mamba_chunk_scan_combined
from mamba2_rocm.bench.ssd import grid
from mamba2_rocm.bench.timing import time_graph
from mamba2_rocm.ops import ssd as ssd_ops
from mamba2_rocm.ops._launch import sm_count


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", metavar="FILE", help="write the rows to FILE")
    args = ap.parse_args()
    sms = sm_count(torch.device("cuda"))
    rule, lds_rule = ssd_ops._chained, ssd_ops._lds_link
    print(f"device: {torch.cuda.get_device_name()}, {sms} multiprocessors")
    rows = []
    try:
        for label, shape in grid():
            b, L, h, p, g, n, cs = shape
            chains, chunks = b * ssd_ops._state_tiles(p, n) * h, math.ceil(L / cs)
            x, B = torch.empty(b, L, h, p, device="meta"), torch.empty(b, L, g, n, device="meta")
            ssd_ops._chained, ssd_ops._lds_link = rule, lds_rule  # the rules' own pick first
            picked = ssd_ops._state_path(chains, chunks, sms, x, B, cs)
            call = make_call(mamba_chunk_scan_combined, *shape)[0]
            us = {}
            for _ in range(2):
                for path in ssd_ops._STATE_STAGES:
                    ssd_ops._chained = lambda *a, v=path != "separate": v
                    ssd_ops._lds_link = lambda *a, v=path == "chained_lds": v
                    t = time_graph(call, replays=10, per_graph=10).median_us
                    us[path] = min(us.get(path, math.inf), t)
            loss = us[picked] / min(us.values()) - 1
            rows.append(dict(case=label, shape=shape, chains=chains, chunks=chunks,
                             **{f"{k}_us": round(v, 1) for k, v in us.items()},
                             rule=picked, rule_loss=round(loss, 4)))  # fmt: skip
            print(f"{label:14} b{b} l{L:<5} h{h:<3} p{p} n{n} c{cs}  chains {chains:4} chunks {chunks:3}  "
                  + "  ".join(f"{k} {v:7.1f}" for k, v in us.items())
                  + f" us  rule: {picked}{f'  ({100 * loss:.1f}% slower)' if loss > 0.005 else ''}",
                  flush=True)  # fmt: skip
            del call
            torch.cuda.empty_cache()
    finally:
        ssd_ops._chained, ssd_ops._lds_link = rule, lds_rule
    missed = [r for r in rows if r["rule_loss"] > 0.005]
    print(f"the rules' pick is more than 0.5% slower at {len(missed)} of {len(rows)} points"
          + "".join(f"\n  {r['case']} {r['shape'][:2]}: {100 * r['rule_loss']:.1f}%" for r in missed))  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
