"""The model: Flax Llama, weight import, tokenizer, tensor-parallel sharding."""
