"""wedgectl's vLLM plugin: fixes that turn every silent hang into a fast, clear failure, and faults for repros.

vLLM loads it in every process through the ``vllm.general_plugins`` entry
point ``wedge_engine.plugin:register``. With neither ``WEDGE_ENGINE_FIXES``
nor ``WEDGE_ENGINE_FAULT`` in the environment it patches nothing.
"""

__version__ = "0.2.0"
