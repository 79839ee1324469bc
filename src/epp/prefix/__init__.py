"""Block hashing and the prefix index of what each pod holds in its KV cache."""
