"""pytest plugin (entry point `pytest11`) for specplug and for third-party speculator authors.

Every name below is importable from `specplug.testing`; the module that holds it is named first.

fixtures (registered by installing specplug):
  tiny_gguf     path of a tiny random llama GGUF (byte-level vocab, chat template), per session
  tiny_target   that model loaded as a Target (float32, no quantization)
  tiny_target_info  the TargetInfo the host gives speculators for it (4 sequences, 512 positions)
  make_engine   make_engine(target, [speculators], **engine_kwargs) -> Engine
  speculator_contract   check_speculator bound to tiny_target
  tiny_q8_gguf, tiny_q8_target             a Q8_0 tiny model (scale 1.5), loaded with quant gguf
tiny_model: a tiny GGUF model
  write_tiny_gguf(path, ...)               write your own tiny model (arch, sizes, tensor types; its
                                           vocabulary is tiny_model._byte_vocab(): patch it there)
  random_k_quant(rows, cols, qtype, rng)   random valid K-quant blocks
engine: engine helpers
  speculator(obj, name, target, **policy)  an engine Speculator, checked and started as the host does
  make_engine(target, specs, **kw)         an Engine around a target
  greedy_outputs(target, specs, prompts)   the token ids generated for each prompt (greedy), and the engine
  assert_greedy_equal(target, specs, ...)  speculative greedy output == plain greedy output, and every
                                           speculator under test stayed enabled and had drafts verified
  record_drafts(spec_or_engine)            a list that fills with every draft request and answer (DraftRecord)
contract: the contract kit, for plugin authors (a speculator through every check the host makes)
  check_speculator(cls_or_factory, params, target=...)  start-up checks, greedy == plain, the sampled
                                           tokens distributed as the target samples them, drafts
                                           verified and the speculator never disabled -> ContractReport
  CONTRACT_SAMPLING, DEFAULT_CONTRACT_PROMPTS   what it samples with and the prompts it runs by default
stats: is a sample distributed as the target samples?
  sampled_like_target(target, results, sampling)  (p-value, line): were these answers sampled from the target?
  target_pit(target, results, sampling)    each generated token's place in the target's distribution
  chi_square(counts, probs), chi2_sf(stat, df)    Pearson's test (no scipy needed)
heads: head test setup
  HeadKit(trainer, speculator, ...)        a head method's tiny target, data set, training and speculator, and
                                           the module fixtures `work`, `tiny`, `data`, `trained` (`fixtures(name)`)
  repetitive_prompts(n), make_train_data(model, dir, prompts, taps=...)
                                           a training data set from a tiny target, for head tests
                                           (write the target with scale=1.5: its greedy answers
                                           repeat tokens in runs, which a head can learn quickly)
  fine_tune_with_lookup(trainer, head, data, out)  a head fine-tuned to read the pair lookup, zero-started
kernels: kernel checks
  isa_env(isa)                             load models on one kernel path (SPECPLUG_ISA) inside a block
  check_native_step(rt)                    a chain head's one-call native step (PairStep) agrees with its
                                           Python form, picks its own argmax, and is batch-invariant
  check_lookup_step(rt), drafted_lookups(target, spec, prompts)   the same for a head reading the lookup,
                                           and the lookups a drafter hands its head
server: an app served in a thread
  running(app)                             with running(create_app(engine, "tiny")) as url: HTTP tests of a
                                           speculator under `specplug serve` (yields the base URL)
fakes: test speculators used by the core's own tests: RandomDrafts, Oracle, Scripted, Faulty.
"""
from specplug.testing.contract import (
    CONTRACT_SAMPLING,
    DEFAULT_CONTRACT_PROMPTS,
    ContractReport,
    check_speculator,
)
from specplug.testing.engine import (
    DraftRecord,
    assert_greedy_equal,
    greedy_outputs,
    make_engine,
    record_drafts,
    speculator,
)
from specplug.testing.fakes import Faulty, Oracle, RandomDrafts, Scripted
from specplug.testing.fixtures import (  # pytest finds the fixtures here, where the pytest11 entry point points
    _make_engine_fixture,  # noqa: F401  (the fixture `make_engine`)
    speculator_contract,
    tiny_gguf,
    tiny_q8_gguf,
    tiny_q8_target,
    tiny_target,
    tiny_target_info,
)
from specplug.testing.heads import HeadKit, fine_tune_with_lookup, make_train_data, repetitive_prompts
from specplug.testing.kernels import check_lookup_step, check_native_step, drafted_lookups, isa_env
from specplug.testing.server import running
from specplug.testing.stats import chi2_sf, chi_square, sampled_like_target, target_pit
from specplug.testing.tiny_model import CHATML, K_QUANT_BYTES, random_k_quant, write_tiny_gguf

__all__ = [
    "CHATML", "CONTRACT_SAMPLING", "ContractReport", "DEFAULT_CONTRACT_PROMPTS", "DraftRecord", "Faulty",
    "HeadKit", "K_QUANT_BYTES", "Oracle", "RandomDrafts", "Scripted", "assert_greedy_equal", "check_lookup_step",
    "check_native_step", "check_speculator", "chi2_sf", "chi_square", "drafted_lookups", "fine_tune_with_lookup",
    "greedy_outputs", "isa_env", "make_engine", "make_train_data", "random_k_quant", "record_drafts",
    "repetitive_prompts", "running", "sampled_like_target", "speculator", "speculator_contract", "target_pit",
    "tiny_gguf", "tiny_q8_gguf", "tiny_q8_target", "tiny_target", "tiny_target_info", "write_tiny_gguf",
]
