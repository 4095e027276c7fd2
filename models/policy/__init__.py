"""The policy and how it learns: the network, its trainer and optimisers, the rows of its output
layer, its weights as safetensors and row-sparse deltas, and cold-start rows for new memories."""
