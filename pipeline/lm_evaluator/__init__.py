"""The evaluator: turns retrieval events into LLM feedback with a real local causal LM."""
