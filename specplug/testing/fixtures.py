"""The pytest fixtures `specplug.testing` registers (entry point `pytest11`): tiny models, their
targets, an engine factory and the contract kit bound to the tiny target."""
from __future__ import annotations

from pathlib import Path

import pytest

from specplug.engine import target_info
from specplug.runtime import load_target
from specplug.testing.contract import check_speculator
from specplug.testing.engine import make_engine
from specplug.testing.tiny_model import write_tiny_gguf
from specplug.types import TargetInfo


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory) -> Path:
    """A tiny random llama GGUF (byte-level vocabulary, ChatML template, F32 weights), one per session."""
    return write_tiny_gguf(tmp_path_factory.mktemp("specplug") / "tiny.gguf")


@pytest.fixture(scope="session")
def tiny_target(tiny_gguf):
    """`tiny_gguf` loaded with exact float weights (quant `none`): a `Target` (`.model`, `.tokenizer`)."""
    return load_target(str(tiny_gguf), device="cpu", dtype="float32", quant="none")


@pytest.fixture(scope="session")
def tiny_target_info(tiny_target) -> TargetInfo:
    """What the host tells speculators about `tiny_target` (4 parallel sequences, 512 positions):
    build your speculator with `MySpec(MySpec.Params(...), tiny_target_info)`."""
    return target_info(tiny_target, 4, 512)


@pytest.fixture(name="make_engine")
def _make_engine_fixture():
    """`specplug.testing.make_engine`: `make_engine(target, [speculators], **engine_kwargs) -> Engine`."""
    return make_engine


@pytest.fixture
def speculator_contract(tiny_target):
    """check_speculator on `tiny_target`: `speculator_contract(MySpec, MySpec.Params(...))` fails
    naming the rule a speculator breaks, and returns a ContractReport."""
    import functools

    return functools.partial(check_speculator, target=tiny_target)



@pytest.fixture(scope="session")
def tiny_q8_gguf(tmp_path_factory) -> Path:
    """A tiny llama GGUF with Q8_0 matrices (the GGUF-kernel path, quant `gguf`), written with
    scale=1.5: its greedy answers repeat tokens in runs, which a head learns in a few steps."""
    return write_tiny_gguf(tmp_path_factory.mktemp("specplug-q8") / "tiny-q8.gguf", tensor_type="Q8_0", scale=1.5)


@pytest.fixture(scope="session")
def tiny_q8_target(tiny_q8_gguf):
    """`tiny_q8_gguf` loaded on the GGUF-block kernels (quant `gguf`), as a default config runs a model."""
    return load_target(str(tiny_q8_gguf), device="cpu", dtype="float32", quant="gguf")
