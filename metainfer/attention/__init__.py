"""Attention backends (the paged dense GQA backend; MLA next), their metadata and forward context."""

from metainfer.attention.backend import AttentionBackend
from metainfer.attention.metadata import AttentionMetadata, forward_context, get_attention_metadata
from metainfer.attention.paged import PagedAttentionBackend

__all__ = ["AttentionBackend", "AttentionMetadata", "PagedAttentionBackend", "forward_context",
           "get_attention_metadata"]
