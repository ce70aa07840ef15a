"""Checkpoints as they are stored: Hugging Face folders and GGUF files, their configs, tokenizers and chat templates."""
