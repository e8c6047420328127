"""Evaluation of trained models: extrapolation perplexity, attention maps, run comparison."""
