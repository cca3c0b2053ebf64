"""kvdraft: a Gemma 4-style drafter that reads the target's KV cache (see `speculator` and `head`)."""
