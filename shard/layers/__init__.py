"""Tensor-parallel building blocks of the models: linears, embeddings, norms, rotary."""
