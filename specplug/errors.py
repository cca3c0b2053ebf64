"""User-facing errors. Every error a user can cause is a SpecplugError whose message names what to fix."""
class SpecplugError(Exception):
    """Base class of every error specplug shows to a user."""
class ConfigError(SpecplugError):
    """Bad YAML configuration: the message names the key."""
class ModelError(SpecplugError):
    """Unreadable, unsupported or corrupt model file: the message names the file."""
class TokenizerError(ModelError):
    """Tokenizer metadata missing or unsupported."""
class PluginError(SpecplugError):
    """A speculator plugin failed to load or misbehaved: the message names the plugin."""
class ContextFullError(SpecplugError):
    """A sequence would exceed the context size."""
