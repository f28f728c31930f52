"""wedgectl's vLLM plugin: fault injection for hang repros now, fixes later.

vLLM loads it in every process through the ``vllm.general_plugins`` entry
point ``wedge_engine.plugin:register``. Without ``WEDGE_ENGINE_FAULT`` in the
environment it patches nothing.
"""

__version__ = "0.1.0"
