"""Server control for the lab and for operators: the vLLM runtime, repros, the patched engine and swap."""
