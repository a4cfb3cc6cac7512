"""Pure-PyTorch implementations: fallback tiers and test references."""
