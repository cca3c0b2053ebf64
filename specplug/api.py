"""The Python API: a RunConfig (or keyword arguments) -> a ready Engine; prompts -> token ids."""
from __future__ import annotations

from typing import Sequence

from specplug.config import RunConfig, target_args
from specplug.engine import Engine, Speculator, target_info
from specplug.errors import PluginError, SpecplugError
from specplug.plugins import HookCaller, get_type, new_plugin_manager
from specplug.pricing import Pricing, builtin, for_run
from specplug.runtime import KVCache, Target, Tokenizer, load_target
from specplug.types import EmbeddingRequest, TargetInfo


def build_speculators(cfg: RunConfig, info: TargetInfo) -> list[Speculator]:
    """Instantiate, register and check every configured speculator (in config order)."""
    pm = new_plugin_manager()
    out = []
    for sc in cfg.speculators:
        cls = get_type(sc.type).cls
        try:
            inst = cls(sc.params, info)
        except SpecplugError:
            raise
        except Exception as exc:
            raise PluginError(f"speculator {sc.name!r} (type {sc.type}) failed to start: "
                              f"{type(exc).__name__}: {exc}") from None
        out.append(start_speculator(pm, inst, sc.name, sc.type, sc.policy, info))
    pm.check_pending()
    return out


def start_speculator(pm, inst: object, name: str, type_name: str, policy, info: TargetInfo | None) -> Speculator:
    """Register one speculator instance and run its start-up hooks against `info`, as the host
    does for every configured speculator."""
    pm.register(inst, name=name)
    caller = HookCaller(pm, inst, name)
    return Speculator(name, caller, policy, startup_hooks(caller, type_name, info))


def startup_hooks(caller: HookCaller, type_name: str, info: TargetInfo | None) -> EmbeddingRequest:
    """are_compatible(target) (a message is a PluginError), then request_embeddings(target), checked."""
    name = caller.name
    try:
        problem = caller.call("are_compatible", target=info)
        req = caller.call("request_embeddings", target=info) or EmbeddingRequest()
    except Exception as exc:
        raise PluginError(f"speculator {name!r} (type {type_name}) failed its start-up hooks: "
                          f"{type(exc).__name__}: {exc}") from None
    if problem:
        where = info.model_path if info is not None else "the target"
        raise PluginError(f"speculator {name!r} (type {type_name}) is not compatible with {where}: {problem}")
    n_layer = info.n_layer if info is not None else 1 << 30
    if not isinstance(req, EmbeddingRequest) or any(not 0 <= layer < n_layer
                                                     for layer in (*req.layers, *req.kv_layers)):
        raise PluginError(f"speculator {name!r} (type {type_name}) requested embeddings {req!r}; "
                          f"layers and kv_layers must be in [0, {n_layer})")
    return req


def build_engine(cfg: RunConfig, target: Target | None = None, speculators: bool = True,
                 cache: KVCache | None = None, pricing: Pricing | None = None) -> Engine:
    """Load the target (unless given) and build an Engine; speculators=False gives plain decoding.
    `cache`: a KV cache to share with engines that never run at the same time. `pricing`: how drafts
    are priced; default: the config's `verify_curve` resolved now (specplug.pricing.for_run, which may
    time the target for ~2 s); engines built around one target can share one."""
    if target is None:
        target = load_target(cfg.model, **target_args(cfg))
    if pricing is None:
        pricing = for_run(target.model, cfg) if speculators else builtin(target.model)
    info = target_info(target, cfg.parallel, cfg.context, pricing.cost)
    specs = build_speculators(cfg, info) if speculators else []
    return Engine(target, specs, n_parallel=cfg.parallel, max_ctx=cfg.context, sampling=cfg.sampling,
                  prefill_chunk=cfg.prefill_chunk, ignore_eos=cfg.ignore_eos, cache=cache,
                  hook_warn_ms=cfg.hook_warn_ms, pricing=pricing, chain=cfg.chain)


def prompt_ids(tokenizer: Tokenizer, turns: str | Sequence[dict], chat: bool, system: str | None = None) -> list[int]:
    """Text (or a list of chat messages) -> token ids, through the chat template when `chat`."""
    if isinstance(turns, str):
        if not chat:
            return tokenizer.encode(turns)
        turns = [{"role": "user", "content": turns}]
    messages = ([{"role": "system", "content": system}] if system else []) + list(turns)
    ids = tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    if len(ids) > 1 and ids[0] == ids[1] == tokenizer.bos_id:  # the template wrote BOS itself
        ids = ids[1:]
    return ids
