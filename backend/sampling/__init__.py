"""Turning logits into tokens: the batched sampler and structured output (grammar masks, llguidance)."""
