"""grpokit: GRPO-family post-training of causal language models from verifiable rewards.

`grpokit.GRPO` (grpokit/api.py) is the Python entry point; it is imported on first use, so
`import grpokit` (and `import grpokit.algo`, `grpokit.config`, ...) stays light.
"""

__version__ = "0.1.0"

__all__ = ["GRPO", "__version__"]


def __getattr__(name: str):
    if name == "GRPO":
        from grpokit.api import GRPO

        return GRPO
    raise AttributeError(f"module 'grpokit' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | {"GRPO"})
