"""``mamba_ssm.utils.generation`` (mamba2-rocm drop-in facade: re-exports only)."""

from mamba2_rocm.models.generation import (
    DecodingCGCache,
    GenerationMixin,
    InferenceParams,
    capture_graph,
    decode,
    modify_logit_for_repetition_penalty,
    modify_logits_for_min_p_filtering,
    modify_logits_for_top_k_filtering,
    modify_logits_for_top_p_filtering,
    sample,
    update_graph_cache,
)

__all__ = [
    "DecodingCGCache",
    "GenerationMixin",
    "InferenceParams",
    "capture_graph",
    "decode",
    "modify_logit_for_repetition_penalty",
    "modify_logits_for_min_p_filtering",
    "modify_logits_for_top_k_filtering",
    "modify_logits_for_top_p_filtering",
    "sample",
    "update_graph_cache",
]
