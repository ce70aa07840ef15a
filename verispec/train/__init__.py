"""Training the default model pair on the Python standard library: corpus, tokenizer, target, draft."""
