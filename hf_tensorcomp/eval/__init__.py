"""Evaluation helpers."""

from .perplexity import perplexity

__all__ = ["perplexity"]
