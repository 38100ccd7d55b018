"""A rank's work on its device: the model loaded and sharded, the KV cache, a step's inputs staged, the forward (CUDA graphs), sampling and pooling."""
