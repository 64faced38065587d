"""Attention backends (paged dense GQA; MLA's paged latent cache), their metadata and forward context."""

from metainfer.attention.backend import AttentionBackend
from metainfer.attention.metadata import AttentionMetadata, forward_context, get_attention_metadata
from metainfer.attention.mla import MLABackend
from metainfer.attention.paged import PagedAttentionBackend

__all__ = ["AttentionBackend", "AttentionMetadata", "MLABackend", "PagedAttentionBackend", "forward_context",
           "get_attention_metadata"]
