"""The build pipeline: recipes, Docker toolchain, staged builds of arch-tagged wheels."""
