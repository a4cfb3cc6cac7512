"""Host time spent inside the ops a model reaches through the ``mamba_ssm`` / ``causal_conv1d``
names, per decode token: what of a decode step's host time is ours (or, on the peer's side,
mamba_ssm's Triton launchers').

A decode step at batch 1 is host-bound: the GPU waits for the next launch. The whole step's time
per token is measured end to end (``bench model``'s tok/s); this module splits off the part spent
inside the named ops: :class:`OpClock` replaces each op's module attribute with a wrapper that
adds the time between entry and return (no device sync: an op returns once its launches are
queued, so that is its host time) to the op's account. It must be installed before the model's
module is imported (transformers binds these names when it imports its modeling modules); the
wrapper keeps the op's signature (``functools.wraps``), which transformers inspects.

The overhead of a wrapper (two ``perf_counter`` calls, a dict update: about 0.3 µs) is inside
what it measures; it is small against the 20-60 µs an op's host path takes.
"""

from __future__ import annotations

import functools
import importlib
import sys
import time
from dataclasses import dataclass, field

#: (module, attribute) of every op a Mamba / Mamba2 model reaches through the upstream names
#: (transformers' hub-kernel fallbacks and mamba_ssm's own modules)
OPS = (
    ("causal_conv1d", "causal_conv1d_fn"),
    ("causal_conv1d", "causal_conv1d_update"),
    ("mamba_ssm.ops.triton.selective_state_update", "selective_state_update"),
    ("mamba_ssm.ops.triton.ssd_combined", "mamba_chunk_scan_combined"),
    ("mamba_ssm.ops.triton.ssd_combined", "mamba_split_conv1d_scan_combined"),
    ("mamba_ssm.ops.triton.layernorm_gated", "rmsnorm_fn"),
    ("mamba_ssm.ops.triton.layer_norm", "rms_norm_fn"),
    ("mamba_ssm.ops.triton.layer_norm", "layer_norm_fn"),
    ("mamba_ssm.ops.selective_scan_interface", "selective_scan_fn"),
    ("mamba_ssm.ops.selective_scan_interface", "mamba_inner_fn"),
)


@dataclass
class Account:
    """One op's calls and host seconds since the last reset, and whose op it is."""

    owner: str  # "mamba2-rocm" or the real package's name
    calls: int = 0
    seconds: float = 0.0


@dataclass
class OpClock:
    """Wrappers around :data:`OPS` (those that import here) that time each call on the host."""

    accounts: dict[str, Account] = field(default_factory=dict)
    _patched: list[tuple[object, str, object]] = field(default_factory=list)

    def install(self, ops=OPS) -> OpClock:
        for module_name, attr in ops:
            try:
                module = importlib.import_module(module_name)
                fn = getattr(module, attr)
            except Exception:  # not installed here, or that release lacks the name
                continue
            if getattr(fn, "__m2r_clock__", None) is self:
                continue
            name = f"{module_name}.{attr}"
            owner = getattr(fn, "__module__", "") or ""
            self.accounts[name] = Account(
                "mamba2-rocm" if owner.startswith("mamba2_rocm") else owner.split(".")[0]
            )
            timed = self._wrap(fn, self.accounts[name])
            # the op's home module and, where it re-exports the same function, the package's
            # root: transformers looks there first (``mamba_ssm.selective_state_update``)
            homes = [module]
            root = sys.modules.get(module_name.partition(".")[0])
            if root is not None and root is not module and getattr(root, attr, None) is fn:
                homes.append(root)
            for home in homes:
                setattr(home, attr, timed)
                self._patched.append((home, attr, fn))
        return self

    def _wrap(self, fn, account: Account):
        clock = time.perf_counter

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            start = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                account.seconds += clock() - start
                account.calls += 1

        timed.__m2r_clock__ = self
        return timed

    def uninstall(self) -> None:
        for module, attr, fn in reversed(self._patched):
            setattr(module, attr, fn)
        self._patched.clear()

    def reset(self) -> None:
        for account in self.accounts.values():
            account.calls, account.seconds = 0, 0.0

    def snapshot(self) -> dict[str, tuple[int, float]]:
        """op -> (calls, host seconds) of the ops called since the last reset."""
        return {k: (a.calls, a.seconds) for k, a in self.accounts.items() if a.calls}

    def per_token(self, run_long, run_short, tokens: int) -> dict[str, dict]:
        """Per op: calls and host µs per token of ``run_long`` beyond ``run_short`` (e.g.
        ``generate`` of n + 1 tokens and of 1: the prompt's prefill cancels, and an op called
        as often in both is left out), ``tokens`` the difference in tokens (decode steps)."""
        self.reset()
        run_long()
        long = self.snapshot()
        self.reset()
        run_short()
        short = self.snapshot()
        out = {}
        for name, (calls, seconds) in long.items():
            c0, s0 = short.get(name, (0, 0.0))
            if calls == c0:  # called as often in both (the prefill's ops): not a decode step's
                continue
            out[name] = {"owner": self.accounts[name].owner,
                         "calls_per_token": (calls - c0) / tokens,
                         "host_us_per_token": (seconds - s0) / tokens * 1e6}  # fmt: skip
        return out


def owner_totals(per_op: dict[str, dict]) -> dict[str, float]:
    """Host µs per token summed per owner (``mamba2-rocm``, ``mamba_ssm``, ...)."""
    totals: dict[str, float] = {}
    for row in per_op.values():
        totals[row["owner"]] = totals.get(row["owner"], 0.0) + row["host_us_per_token"]
    return totals
