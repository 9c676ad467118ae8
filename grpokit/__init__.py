"""grpokit: GRPO-family post-training of causal language models from verifiable rewards."""

__version__ = "0.1.0"
