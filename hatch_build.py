"""Hatch metadata hook: one extra per recipe, pinned to this exact version.

``pip install "mamba2-rocm[gfx1030]"`` then installs ``mamba2-rocm-gfx1030==<same version>``;
the list comes from ``recipes/``, the single source of truth, never typed by hand. The ``test``
extra lives in ``[tool.mamba2-rocm]`` because optional-dependencies are dynamic here.
"""

from pathlib import Path

from hatchling.metadata.plugin.interface import MetadataHookInterface


class RecipeExtrasHook(MetadataHookInterface):
    def update(self, metadata: dict) -> None:
        version = metadata["version"]
        extras = dict(self.config.get("static-extras", {}))
        for recipe in sorted(Path(self.root, "recipes").glob("*.toml")):
            extras[recipe.stem] = [f"mamba2-rocm-{recipe.stem}=={version}"]
        # the drop-in import names mamba_ssm / causal_conv1d (mamba2_rocm.dropin), opt-in
        extras["dropin"] = [f"mamba2-rocm-dropin=={version}"]
        metadata["optional-dependencies"] = extras
