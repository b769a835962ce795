"""Evaluation helpers."""

from .multiple_choice import multiple_choice_accuracy
from .perplexity import perplexity

__all__ = ["multiple_choice_accuracy", "perplexity"]
