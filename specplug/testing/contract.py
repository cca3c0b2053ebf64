"""The contract kit, for plugin authors: a speculator through every check the host makes (start-up,
greedy == plain, sampled tokens distributed as the target samples them). The host's own per-draft
checks are `specplug.contract`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from specplug.engine import Request, target_info
from specplug.sampling import SamplingParams
from specplug.testing.engine import greedy_outputs, make_engine, speculator
from specplug.testing.stats import sampled_like_target

DEFAULT_CONTRACT_PROMPTS = (
    "the cat sat on the mat and the cat sat on the mat and the cat sat on the",
    "one two three four one two three four one two three four one two",
    "a b c a b c a b c a b c a b c a b c",
    "Write a short poem about the sea.",
)
CONTRACT_SAMPLING = dict(temperature=0.7, top_k=5)  # sampling settings of check_speculator's distribution test


@dataclass
class ContractReport:
    """What check_speculator saw of one speculator (drafts verified and accepted per run)."""

    name: str
    greedy_drafts: int  # drafts verified in the greedy run
    greedy_accepted_tokens: int
    sampling_drafts: int
    sampling_accepted_tokens: int
    sampling_p_value: float
    sampling_test: str  # the chi-square line


class _HostLog:
    """Collects the host's log records of one run (warnings, and the tracebacks it logs at debug)."""

    def __init__(self):
        import logging

        self.records: list = []
        self._logger = logging.getLogger("specplug")
        self._handler = logging.Handler(logging.DEBUG)
        self._handler.emit = self.records.append  # type: ignore[method-assign]

    def __enter__(self):
        import logging

        self._level = self._logger.level
        self._logger.setLevel(logging.DEBUG)
        self._logger.addHandler(self._handler)
        return self

    def __exit__(self, *exc):
        self._logger.removeHandler(self._handler)
        self._logger.setLevel(self._level)

    def text(self) -> str:
        return "\n".join(r.getMessage() for r in self.records)


def check_speculator(spec, params=None, *, target, prompts: Sequence[str | Sequence[int]] | None = None,
                     max_tokens: int = 24, n_parallel: int = 4, sampling=None, samples_per_prompt: int = 12,
                     alpha: float = 1e-3, name: str | None = None, **policy) -> ContractReport:
    """Run a speculator through the host's checks on `target` (e.g. the `tiny_target` fixture) and
    fail, with an AssertionError naming the rule, where it breaks one. Returns what it saw.

    `spec`: a speculator class, built as the host builds it, `spec(params or spec.Params(), info)`,
    or a factory `spec(info) -> instance`; a fresh instance for each run. Checks:
      - start-up as the host does it: the class checks (Params fields, every @hookimpl a real
        hook), the Params values, `are_compatible` and `request_embeddings`;
      - greedy: the output equals plain greedy decoding for every prompt, run `n_parallel` at a time;
      - sampling (`sampling`, default temperature 0.7, top_k 5): every prompt `samples_per_prompt`
        times with its own seed; every emitted token is one the target's sampling can produce, and
        the tokens are distributed as the target samples them (`sampled_like_target`, p >= alpha);
      - in both runs the speculator was asked, had drafts verified, and was never disabled: every
        result of `draft` passed specplug.contract.check_drafts and no hook raised, nor wrote the
        target's KV cache through `DraftRequest.kv` (the host's warning and any traceback are in
        the failure message).
    `prompts`: texts (encoded with the target's tokenizer) or token id lists; the default mixes
    repetitive texts (for lookup methods) with plain ones. `policy`: DraftPolicy fields, n_max,
    n_min, p_min, ...; cost_trim defaults to False so that the speculator is asked every step (on a
    tiny target drafting costs about a target step, and the host's pricing would pause it).
    """
    tok = target.tokenizer
    prompt_ids = [list(p) if not isinstance(p, str) else tok.encode(p) for p in (prompts or DEFAULT_CONTRACT_PROMPTS)]
    sp = sampling if sampling is not None else SamplingParams(**CONTRACT_SAMPLING)
    info = target_info(target, n_parallel, 512)
    policy.setdefault("cost_trim", False)
    name = name or getattr(spec, "__name__", type(spec).__name__)

    def fresh():
        if isinstance(spec, type) and hasattr(spec, "Params"):
            inst = spec(params if params is not None else spec.Params(), info)
        else:
            inst = spec(info)
        return speculator(inst, name, target=info, **policy)

    def check_ran(eng, log: _HostLog, run: str):
        (s,) = eng.specs
        if not s.enabled:
            why = eng.stats.disabled.get(name) or ""
            hint = (" (it wrote the target's KV cache through DraftRequest.kv, which is read-only: compute into "
                    "tensors of your own)" if "ReadOnlyError" in why else "")
            raise AssertionError(f"{run}: the host disabled speculator {name!r}: {why}{hint}\nhost log:\n{log.text()}")
        if s.stats.asked == 0:
            raise AssertionError(f"{run}: speculator {name!r} was never asked to draft (does it implement `draft`?)")
        if s.stats.drafts == 0:
            raise AssertionError(f"{run}: speculator {name!r} never had a draft verified, so the run tests nothing "
                                 "of it: give prompts it can draft for")

    with _HostLog() as log:
        plain, _ = greedy_outputs(target, [], prompt_ids, max_tokens, n_parallel=n_parallel)
        got, eng = greedy_outputs(target, [fresh()], prompt_ids, max_tokens, n_parallel=n_parallel)
    check_ran(eng, log, "greedy")
    for i, (a, b) in enumerate(zip(plain, got)):
        if a != b:
            j = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            raise AssertionError(f"greedy: with speculator {name!r} prompt {i}'s output differs from plain greedy "
                                 f"decoding at token {j}:\nplain       {a}\nspeculative {b}")
    (s,) = eng.specs
    greedy = (s.stats.drafts, s.stats.accepted_tokens)

    reqs = [Request(p, max_tokens, (i, k), seed=1000 * i + k)
            for k in range(samples_per_prompt) for i, p in enumerate(prompt_ids)]
    with _HostLog() as log:
        eng = make_engine(target, [fresh()], n_parallel=n_parallel, sampling=sp, ignore_eos=True)
        res = eng.run(reqs)
    check_ran(eng, log, f"sampling ({sp})")
    pv, line = sampled_like_target(target, res, sp)
    if pv < alpha:
        raise AssertionError(f"sampling ({sp}): with speculator {name!r} the emitted tokens are not distributed as "
                             f"the target samples them: {line} (alpha {alpha:g})")
    (s,) = eng.specs
    return ContractReport(name, *greedy, s.stats.drafts, s.stats.accepted_tokens, pv, line)

