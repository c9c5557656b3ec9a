"""The anatomy of any Hugging Face causal LM: its parts, the float32 read-out, block calls."""
