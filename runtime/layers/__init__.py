"""Model-agnostic building blocks: Megatron parallel layers, norms, rotary embedding, activations."""
