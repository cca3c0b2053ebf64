"""pytest plugin (entry point `pytest11`) for specplug and third-party speculator authors. Filled in below."""
