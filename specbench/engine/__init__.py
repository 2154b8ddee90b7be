"""Layer 1, the engine: the target model, its KV cache, CUDA graphs, sampling, lossless
verification, the policy interface and the one decode loop every policy shares (`core`), and
loading a target from GGUF / Hugging Face files. Imports nothing above it."""
