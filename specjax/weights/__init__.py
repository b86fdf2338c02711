"""What a model is made of on disk: orbax checkpoints (`checkpoint`) and tokenizers."""
