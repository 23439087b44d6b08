"""The model: the Llama-family decoder, its tensor-parallel layers, attention over the
paged KV cache, sampling and grammars."""
