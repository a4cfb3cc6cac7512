"""``nox -s matrix``: the CI matrices, generated from ``recipes/`` (never hand-copied).

Three GitHub Actions matrices (each ``{"include": [...]}``, for ``fromJSON``):

- ``build``: every recipe, built on GitHub-hosted Linux runners;
- ``gpu``: every recipe with ``runner_labels``, run on those self-hosted labels;
- ``gate``: each recipe's ``gpu_gate``, for the release summary.

``has_gpu`` is ``"true"`` or ``"false"``: GitHub rejects an empty matrix, so the GPU jobs are
skipped by a condition instead when no recipe has runners.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mamba2_rocm.pipeline.recipes import Recipe

__all__ = ["github_outputs", "matrices"]


def matrices(recipes: list[Recipe]) -> dict[str, Any]:
    return {
        "build": {"include": [{"target": r.target} for r in recipes]},
        "gpu": {
            "include": [
                {"target": r.target, "runs-on": list(r.runner_labels), "gate": r.gpu_gate}
                for r in recipes
                if r.runner_labels
            ]
        },
        "gate": {"include": [{"target": r.target, "gate": r.gpu_gate} for r in recipes]},
        "has_gpu": "true" if any(r.runner_labels for r in recipes) else "false",
    }


def github_outputs(recipes: list[Recipe], path: Path) -> None:
    """Append ``name=value`` lines for ``$GITHUB_OUTPUT`` (one-line JSON values)."""
    with open(path, "a") as f:
        for name, value in matrices(recipes).items():
            text = value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))
            f.write(f"{name}={text}\n")
