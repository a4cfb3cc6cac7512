"""``python -m mamba2_rocm bench conv1d|decode|ssd|ssd-paths|ssd-error|rmsnorm|add-norm|
selective-scan|host|linear|model|generate``."""

from __future__ import annotations

import argparse
import json
import sys

#: the benches that measure every dtype in one run (their records name no --dtype)
ALL_DTYPES = ("ssd-error",)
#: the op families whose benchmark has a training (forward + backward) mode
BACKWARD_OPS = ("conv1d", "ssd", "selective-scan", "rmsnorm", "add-norm")


def _run(args: argparse.Namespace) -> int:
    import importlib

    bench = importlib.import_module(f"mamba2_rocm.bench.{args.op.replace('-', '_')}")
    extra = {}
    if args.shape:
        if args.op not in ("model", "generate"):
            raise ValueError("--shape applies to `bench model` / `bench generate` only")
        extra["shapes"] = tuple(args.shape)
    if args.op in ("ssd", "decode"):
        extra["triton_procs"] = args.triton_procs
    if getattr(args, "rounds", 1) != 1:  # (a namespace made without the option: one round)
        if args.op != "model":
            raise ValueError("--rounds applies to `bench model` only")
        if args.rounds < 1:
            raise ValueError(f"--rounds takes a count >= 1, got {args.rounds}")
        extra["rounds"] = args.rounds
    if getattr(args, "breakdown", False):
        if args.op != "generate":
            raise ValueError("--breakdown applies to `bench generate` only")
        extra["breakdown"] = True
    if args.backward:
        if args.op not in BACKWARD_OPS:
            raise ValueError(f"--backward applies to bench {' / '.join(BACKWARD_OPS)}")
        extra["backward"] = True
    rows = bench.run(dtype=args.dtype, **extra)  # host: bf16 always (the dtype is not its subject)
    from mamba2_rocm.bench.timing import kernel_build_note

    note = kernel_build_note()
    print(note, file=sys.stderr if args.json else sys.stdout)
    print(json.dumps(rows, indent=1) if args.json else bench.format_table(rows))
    if args.record:
        from mamba2_rocm.bench import records

        path = records.write(args.op, _command(args), rows)
        print(f"record: {path} (python -m mamba2_rocm.bench.records renders docs/performance.md)",
              file=sys.stderr)  # fmt: skip
    return 0


def _command(args: argparse.Namespace) -> str:
    """The command line a record names (the options that change what is measured)."""
    parts = ["python -m mamba2_rocm bench", args.op]
    if args.op not in ALL_DTYPES:
        parts += ["--dtype", args.dtype]
    if args.backward:
        parts.append("--backward")
    for shape in args.shape or ():
        parts += ["--shape", shape]
    if getattr(args, "breakdown", False):  # (a namespace made without the option: off)
        parts.append("--breakdown")
    if getattr(args, "rounds", 1) != 1:
        parts += ["--rounds", str(args.rounds)]
    if args.op in ("ssd", "decode"):
        parts += ["--triton-procs", str(args.triton_procs)]
    return " ".join(parts)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmark an op family on the local GPU")
    p.add_argument(
        "op",
        choices=[
            "conv1d",
            "decode",
            "ssd",
            "ssd-paths",
            "ssd-error",
            "rmsnorm",
            "add-norm",
            "selective-scan",
            "host",
            "linear",
            "model",
            "generate",
        ],
        help="which op family, or model: a transformers Mamba2 end to end (mamba2_rocm.bench.model); "
        "generate: mamba_ssm's MambaLMHeadModel, ours vs upstream's (mamba2_rocm.bench.generate); "
        "ssd-paths: the SSD forward's per-shape choices against their alternatives on this GPU "
        "(mamba2_rocm.bench.ssd_paths); ssd-error: the SSD forward's output error vs float64, "
        "ours vs Triton, every dtype (mamba2_rocm.bench.ssd_error); linear: a decode step's "
        "projections, our kernel vs the BLAS library (mamba2_rocm.bench.linear)",
    )
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--json", action="store_true", help="machine-readable rows instead of the table")
    p.add_argument("--triton-procs", type=int, default=3, metavar="N",
                   help="ssd / decode: mamba_ssm's Triton timed in N fresh processes, the best "
                        "kept (its autotuner picks per process; 0: not timed)")  # fmt: skip
    p.add_argument("--backward", action="store_true",
                   help=f"{' / '.join(BACKWARD_OPS)}: forward + backward (training) instead of "
                        "the forward, with peak memory")  # fmt: skip
    p.add_argument("--record", action="store_true",
                   help="also write the run as a JSON record under records/bench/ (device, "
                        "software, commit, date, command, rows)")  # fmt: skip
    p.add_argument("--shape", action="append", choices=["130m", "1.3b"],
                   help="bench model / generate: only these checkpoint shapes (repeatable; "
                        "default: all)")  # fmt: skip
    p.add_argument("--rounds", type=int, default=1,
                   help="bench model: run the sides in turns this many times (each its own "
                        "process; the order rotates) and report each metric's median")  # fmt: skip
    p.add_argument("--breakdown", action="store_true",
                   help="bench generate: also each side's prefill and training-step device time "
                        "by kernel family, and the ratio our kernels could reach at best "
                        "(mamba2_rocm.bench.breakdown)")  # fmt: skip
    p.set_defaults(func=_run)
