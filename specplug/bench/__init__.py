"""`specplug bench`: speculative vs plain decoding on real prompt sets."""
