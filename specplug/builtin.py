"""Speculator types that ship with the core, exercising the public hook API like any plugin."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from specplug.hooks import hookimpl
from specplug.types import Draft, DraftRequest, TargetInfo


class Noop:
    """Drafts nothing. `specplug run` with it measures what the host itself costs per step."""

    @dataclass(frozen=True)
    class Params:
        pass

    def __init__(self, params: "Noop.Params", target: TargetInfo):
        self.params = params

    @hookimpl
    def draft(self, requests: Sequence[DraftRequest]) -> Sequence[Draft | None]:
        return [None] * len(requests)
