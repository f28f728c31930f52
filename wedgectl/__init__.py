"""wedgectl: tell apart the ways an LLM inference server hangs while looking healthy."""

__version__ = "0.1.0"

__all__ = ["__version__"]
