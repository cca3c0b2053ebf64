"""Build `specplug/data/agent_traffic/requests.jsonl`: deployment-like traffic for the bench.

Two kinds of requests, shuffled together in a fixed order (one stream, served in order, the way
a suffix-decoding speculator that learns from earlier answers would see it):

- `extract-json` (120): one template of a structured-output service applied to many documents,
  JSON out. Three templates, 40 requests each: facts from a Wikipedia passage (instructions and
  schema in the system prompt), a Python function's interface from its source (all in the user
  turn), and a question answered from five retrieved passages with the supporting quote
  (system prompt plus passages). The documents are the Spec-Bench `rag` passages and the
  HumanEval prompts bundled in `specplug/data/`.
- `tool-call` (120): function calling with the tool definitions as JSON in the system prompt.
  60 single requests to "live" apps of the Berkeley Function Calling Leaderboard (user-written
  queries, grouped by the tool set they were asked against), a second turn carrying a
  synthesized acknowledgement for every other one; 60 conversations with BFCL's multi-turn
  apps (file system, trading, travel, vehicle, ...), whose second turn carries the results
  of BFCL's ground-truth calls run on BFCL's own simulated backends, and whose third turn (where
  it fits) is the user's next request.

The BFCL data and backends come from the PyPI wheel `bfcl-eval` (Apache-2.0), pinned by version
and sha256; without `--bfcl-wheel` the script downloads it with pip (`--no-deps`). Every prompt
is checked to fit the bench's budget with SmolLM2's tokenizer: each turn's chat prompt, counting
every earlier answer as 128 tokens, at most 1200 tokens (128 more generated fit in 2048).
Deterministic: the same inputs give the same file byte for byte. Usage:

    python scripts/make_agent_traffic.py                      # writes the file, prints counts
    python scripts/make_agent_traffic.py --bfcl-wheel bfcl_eval-2026.3.23-py3-none-any.whl --check
"""
from __future__ import annotations

import argparse
import ast
import collections
import copy
import gzip
import hashlib
import importlib
import json
import random
import re
import statistics
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "specplug" / "data" / "agent_traffic" / "requests.jsonl"
BFCL_VERSION = "2026.3.23"
BFCL_WHEEL = f"bfcl_eval-{BFCL_VERSION}-py3-none-any.whl"
BFCL_SHA256 = "3bb6dfa5f0c68ad403c9ec50b00db2bb3b4cc9b38ab1ff33f48fe30d853d3a0a"
SEED = 20261207
PROMPT_BUDGET = 1200  # tokens of a record's own text: system prompt and every user turn, in the chat template
CONTEXT, ANSWER_TOKENS = 2048, 128  # every turn's prompt, earlier answers counted as 128 tokens, + 128 fits
PER_TEMPLATE = 40
LIVE_REQUESTS, LIVE_PER_APP, LIVE_TOOL_TOKENS = 60, 6, 700
MULTI_REQUESTS, MULTI_PER_APP, MULTI_TOOL_TOKENS = 60, 8, 800

# ---- templates -------------------------------------------------------------------------------------

WIKI_SYSTEM = """You are an information extraction service. The user sends a passage from an encyclopedia. \
Reply with one JSON object and nothing else, with exactly these keys:
{"title": string (the article's title, "" if the passage does not show it), \
"topic": "person" | "place" | "organization" | "event" | "work" | "concept" | "other", \
"entities": [{"name": string, "type": "person" | "place" | "organization" | "work" | "other"}], \
"dates": [string], "quantities": [{"value": number, "unit": string, "of": string}], \
"summary": string (one sentence)}
Use only what the passage states; use [] where nothing fits."""

FUNC_USER = """Extract the interface of this Python function as JSON with the keys "name", \
"parameters" (a list of {{"name": string, "type": string}}), "returns" (the return type), \
"summary" (one sentence) and "examples" (a list of {{"call": string, "result": string}} taken from \
the docstring). Reply with the JSON object only.

```python
{code}```"""

RAG_SYSTEM = """You answer questions from retrieved passages. Reply with one JSON object and nothing else:
{"answer": string, "passage": the number of the passage that supports the answer (1-5) or null, \
"quote": the supporting words copied exactly from that passage, "confidence": "high" | "medium" | "low"}
If no passage answers the question, use null for "passage" and "" for "quote"."""

TOOL_SYSTEM = """You are an assistant that completes the user's requests by calling functions. \
These functions are available, described as JSON Schema:
<tools>
{tools}
</tools>
To call a function, reply with one JSON object per call, each inside <tool_call></tool_call> tags:
<tool_call>
{{"name": "<function name>", "arguments": {{"<parameter>": <value>}}}}
</tool_call>
Results come back inside <tool_response></tool_response> tags. When no further call is needed, \
answer the user in one or two sentences."""

# BFCL's parameter types that JSON Schema spells otherwise (Python-flavoured schemas)
JSON_TYPES = {"dict": "object", "float": "number", "tuple": "array", "list": "array", "bool": "boolean",
              "any": "string"}

# BFCL's multi-turn API classes: backend module and function-doc file (bfcl_eval/constants)
MULTI_CLASSES = {
    "GorillaFileSystem": "gorilla_file_system", "MathAPI": "math_api", "MessageAPI": "message_api",
    "TwitterAPI": "posting_api", "TicketAPI": "ticket_api", "TradingBot": "trading_bot",
    "TravelAPI": "travel_booking", "VehicleControlAPI": "vehicle_control",
}
DOC_FILE = {"TwitterAPI": "posting_api"}  # the function docs share the module names
STATELESS = {"MathAPI"}


# ---- inputs ----------------------------------------------------------------------------------------

def load_tokenizer():
    from specplug.runtime import Tokenizer, resolve_model
    from specplug.runtime.gguf_file import GGUFFile

    return Tokenizer.from_metadata(GGUFFile(resolve_model("smollm2-135m")).metadata)


def bfcl_wheel(path: str | None, tmp: Path) -> Path:
    if path is None:
        subprocess.run([sys.executable, "-m", "pip", "download", f"bfcl-eval=={BFCL_VERSION}", "--no-deps",
                        "--only-binary", ":all:", "-d", str(tmp)], check=True)
        path = str(tmp / BFCL_WHEEL)
    got = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    if got != BFCL_SHA256:
        sys.exit(f"{path}: sha256 {got}, expected {BFCL_SHA256} (bfcl-eval {BFCL_VERSION})")
    return Path(path)


def jsonl(zf: zipfile.ZipFile, name: str) -> list[dict]:
    return [json.loads(line) for line in zf.read(f"bfcl_eval/data/{name}").decode("utf-8").splitlines() if line]


def bundled(name: str) -> list[dict]:
    from specplug.bench.data import dataset_path

    path = dataset_path(name)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


# ---- budget ----------------------------------------------------------------------------------------

class Budget:
    def __init__(self, tok):
        from specplug.api import prompt_ids

        self.tok, self.prompt_ids = tok, prompt_ids

    def turn_lengths(self, system: str | None, turns: list[str]) -> list[int]:
        """Each turn's prompt length, earlier answers counted as ANSWER_TOKENS tokens each."""
        out, msgs = [], []
        for i, text in enumerate(turns):
            msgs.append({"role": "user", "content": text})
            out.append(len(self.prompt_ids(self.tok, msgs, True, system)) + i * ANSWER_TOKENS)
            msgs.append({"role": "assistant", "content": ""})
        return out

    def own_length(self, system: str | None, turns: list[str]) -> int:
        """The record's own text in the chat template: system prompt and user turns, empty answers between."""
        return self.turn_lengths(system, turns)[-1] - (len(turns) - 1) * ANSWER_TOKENS

    def fits(self, system: str | None, turns: list[str]) -> bool:
        return (self.own_length(system, turns) <= PROMPT_BUDGET
                and max(self.turn_lengths(system, turns)) + ANSWER_TOKENS <= CONTEXT)

    def tokens(self, text: str) -> int:
        return len(self.tok.encode(text))


# ---- extraction requests ---------------------------------------------------------------------------

def rag_records() -> list[tuple[int, list[str], str]]:
    """(question_id, five passages, question) of Spec-Bench's `rag` category."""
    out = []
    for r in bundled("spec_bench"):
        if r["category"] == "rag":
            lines = r["turns"][0].split("\n")
            assert len(lines) == 6, r["question_id"]
            out.append((r["question_id"], lines[:5], lines[5]))
    assert len(out) == 80
    return out


def extraction(budget: Budget) -> list[dict]:
    rag = rag_records()
    recs = []
    # facts from one or two passages (records 41-80 of the rag category: not the ones asked below)
    for i, (qid, passages, _) in enumerate(rag[40:40 + PER_TEMPLATE]):
        doc = passages[i % 5] if i % 2 == 0 else passages[i % 5] + "\n" + passages[(i + 1) % 5]
        recs.append({"template": "wiki-facts", "source": f"spec_bench:{qid}", "system": WIKI_SYSTEM, "turns": [doc]})
    # a function's interface from its source: every 4th HumanEval problem
    for r in bundled("humaneval")[::4][:PER_TEMPLATE]:
        recs.append({"template": "function-spec", "source": r["task_id"],
                     "turns": [FUNC_USER.format(code=r["prompt"])]})
    # a question answered from five passages (records 1-40)
    for qid, passages, question in rag[:PER_TEMPLATE]:
        text = "Passages:\n" + "\n".join(f"[{k}] {p}" for k, p in enumerate(passages, 1)) + f"\n\nQuestion: {question}"
        recs.append({"template": "rag-answer", "source": f"spec_bench:{qid}", "system": RAG_SYSTEM, "turns": [text]})
    for r in recs:
        assert budget.fits(r.get("system"), r["turns"]), r["source"]
        r["category"] = "extract-json"
    return recs


# ---- tool calls ------------------------------------------------------------------------------------

def json_schema(fn: dict) -> dict:
    """A BFCL function doc as {name, description, parameters} with JSON Schema's type names."""
    def fix(node):
        if isinstance(node, dict):
            node = {k: fix(v) for k, v in node.items()}
            if isinstance(node.get("type"), str):
                node["type"] = JSON_TYPES.get(node["type"], node["type"])
        elif isinstance(node, list):
            node = [fix(v) for v in node]
        return node

    desc = re.sub(r"^This tool belongs to .*?Tool description: ", "", fn["description"])  # multi-turn docs
    return {"name": fn["name"], "description": desc, "parameters": fix(fn["parameters"])}


def tool_system(functions: list[dict]) -> str:
    return TOOL_SYSTEM.format(tools="\n".join(json.dumps(json_schema(f), ensure_ascii=False) for f in functions))


def tool_response(name: str, content) -> str:
    body = json.dumps({"name": name, "content": content}, ensure_ascii=False, default=str)
    return f"<tool_response>\n{body}\n</tool_response>"


def first_value(options: list):
    """BFCL's possible answers list accepted values; "" marks an optional argument left out."""
    return next((v for v in options if v != ""), None)


def ack(source_id: str, name: str, args: dict) -> dict:
    """A synthesized result for an app without a backend: success, an id, the arguments echoed."""
    ref = hashlib.sha256(f"{source_id}/{name}".encode()).hexdigest()[:10]
    return {"status": "success", "id": ref, "request": args}


def live_apps(zf: zipfile.ZipFile, budget: Budget) -> list[dict]:
    """Single requests to BFCL's live apps: one tool set, many users' queries."""
    groups: dict[str, list[tuple[dict, list]]] = collections.defaultdict(list)
    for name in ("live_simple", "live_multiple"):
        answers = {a["id"]: a["ground_truth"] for a in jsonl(zf, f"possible_answer/BFCL_v4_{name}.json")}
        for r in jsonl(zf, f"BFCL_v4_{name}.json"):
            if len(r["question"]) == 1 and len(r["question"][0]) == 1 and answers.get(r["id"]):
                groups[json.dumps(r["function"], sort_keys=True)].append((r, answers[r["id"]]))
    apps = [g for g in groups.values() if len(g) >= LIVE_PER_APP
            and budget.tokens("\n".join(json.dumps(json_schema(f)) for f in g[0][0]["function"])) <= LIVE_TOOL_TOKENS]
    apps.sort(key=lambda g: (-len(g), g[0][0]["id"]))
    recs = []
    for app in apps:
        taken = 0
        for r, truth in app:
            if taken == LIVE_PER_APP or len(recs) == LIVE_REQUESTS:
                break
            system = tool_system(r["function"])
            turns = [r["question"][0][0]["content"]]
            if len(recs) % 2:  # every other request also gets the call's result back
                calls = [(fn, {k: first_value(v) for k, v in args.items() if first_value(v) is not None})
                         for call in truth for fn, args in call.items()]
                turns.append("\n".join(tool_response(fn, ack(r["id"], fn, a)) for fn, a in calls))
            if not budget.fits(system, turns):
                continue
            recs.append({"template": "bfcl-live", "source": f"bfcl:{r['id']}", "system": system, "turns": turns})
            taken += 1
    assert len(recs) == LIVE_REQUESTS, len(recs)
    return recs


class Backends:
    """BFCL's simulated multi-turn APIs, imported from the unpacked wheel."""

    def __init__(self, root: Path):
        sys.path.insert(0, str(root))
        prefix = "bfcl_eval.eval_checker.multi_turn_eval.func_source_code."
        self.modules = {c: importlib.import_module(prefix + m) for c, m in MULTI_CLASSES.items()}

    def run(self, entry: dict, calls: list[str]) -> list[tuple[str, object]]:
        """Execute ground-truth calls (Python syntax) on fresh instances loaded with the entry's state."""
        instances = []
        for c in entry["involved_classes"]:
            obj = getattr(self.modules[c], c)()
            if c not in STATELESS:
                obj._load_scenario(copy.deepcopy(entry["initial_config"].get(c, {})), long_context=False)
            instances.append(obj)
        out = []
        for text in calls:
            node = ast.parse(text, mode="eval").body
            name = node.func.id
            args = [ast.literal_eval(a) for a in node.args]
            kwargs = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
            obj = next(o for o in instances if callable(getattr(o, name, None)))
            try:
                result = getattr(obj, name)(*args, **kwargs)
            except Exception as exc:  # a backend's own error is a plausible tool result too
                result = {"error": f"{type(exc).__name__}: {exc}"}
            out.append((name, json.loads(json.dumps(result, default=str))))
        return out


def multi_turn_apps(zf: zipfile.ZipFile, root: Path, budget: Budget) -> list[dict]:
    """Conversations with BFCL's multi-turn apps: request, results of the calls, next request."""
    entries = jsonl(zf, "BFCL_v4_multi_turn_base.json")
    truth = {a["id"]: a["ground_truth"] for a in jsonl(zf, "possible_answer/BFCL_v4_multi_turn_base.json")}
    docs = {c: jsonl(zf, f"multi_turn_func_doc/{DOC_FILE.get(c, m)}.json") for c, m in MULTI_CLASSES.items()}
    # an app's tool list: the functions this conversation calls, then the app's most called ones, while they fit
    used = collections.Counter(t.split("(")[0] for e in entries for turn in truth[e["id"]][:2] for t in turn)
    size = {c: {fn["name"]: budget.tokens(json.dumps(json_schema(fn))) for fn in fns} for c, fns in docs.items()}

    def tool_list(app: tuple[str, ...], needed: set[str]) -> list[dict] | None:
        fns = [fn for c in app for fn in docs[c]]
        cost = {fn["name"]: size[c][fn["name"]] for c in app for fn in docs[c]}
        if not needed <= set(cost):
            return None
        chosen, total = set(needed), sum(cost[n] for n in needed)
        for fn in sorted(fns, key=lambda f: (-used[f["name"]], f["name"])):
            if fn["name"] not in chosen and total + cost[fn["name"]] <= MULTI_TOOL_TOKENS:
                chosen.add(fn["name"])
                total += cost[fn["name"]]
        return [fn for fn in fns if fn["name"] in chosen] if total <= MULTI_TOOL_TOKENS else None

    backends = Backends(root)
    recs, per_app = [], collections.Counter()
    for e in entries:
        if len(recs) == MULTI_REQUESTS:
            break
        app = tuple(e["involved_classes"])
        if per_app[app] == MULTI_PER_APP or len(e["question"]) < 2:
            continue
        gt = truth[e["id"]]
        functions = tool_list(app, {t.split("(")[0] for turn in gt[:2] for t in turn})
        if not gt[0] or functions is None:
            continue
        system = tool_system(functions)
        results = "\n".join(tool_response(n, c) for n, c in backends.run(e, gt[0]))
        q = [turn[0]["content"] for turn in e["question"][:2]]
        for turns in ([q[0], results, q[1]], [q[0], results], [q[0]]):
            if budget.fits(system, turns):
                break
        else:
            continue
        recs.append({"template": "bfcl-multi-turn", "source": f"bfcl:{e['id']}", "system": system, "turns": turns})
        per_app[app] += 1
    assert len(recs) == MULTI_REQUESTS, len(recs)
    return recs


# ---- assembly --------------------------------------------------------------------------------------

def build(wheel: Path, tmp: Path, budget: Budget) -> list[dict]:
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(tmp / "bfcl")
        recs = extraction(budget)
        tools = live_apps(zf, budget) + multi_turn_apps(zf, tmp / "bfcl", budget)
    for r in tools:
        r["category"] = "tool-call"
    recs += tools
    count = collections.Counter()
    for r in recs:
        count[r["template"]] += 1
        r["id"] = f"{r['template']}-{count[r['template']]:03d}"
    random.Random(SEED).shuffle(recs)  # one mixed stream, as a deployment sees it
    keys = ("id", "category", "template", "source", "system", "turns")
    return [{k: r[k] for k in keys if k in r} for r in recs]


def summary(recs: list[dict], budget: Budget) -> str:
    lines = [f"{len(recs)} requests"]
    for key in ("category", "template"):
        c = collections.Counter(r[key] for r in recs)
        lines.append(f"  by {key}: " + ", ".join(f"{k} {v}" for k, v in sorted(c.items())))
    turns = collections.Counter((r["category"], len(r["turns"])) for r in recs)
    lines.append("  user turns: " + ", ".join(f"{c} x{n}: {v}" for (c, n), v in sorted(turns.items())))
    own = [budget.own_length(r.get("system"), r["turns"]) for r in recs]
    first = [budget.turn_lengths(r.get("system"), r["turns"][:1])[0] for r in recs]
    worst = [max(budget.turn_lengths(r.get("system"), r["turns"])) for r in recs]
    for name, xs in (("prompt tokens (system + all user turns)", own), ("first-turn prompt tokens", first),
                     (f"largest turn's prompt (answers as {ANSWER_TOKENS})", worst)):
        lines.append(f"  {name}: min {min(xs)}, median {statistics.median(xs):g}, max {max(xs)}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bfcl-wheel", help=f"{BFCL_WHEEL} (default: pip download it)")
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--check", action="store_true", help="compare with --out instead of writing it")
    args = ap.parse_args()
    budget = Budget(load_tokenizer())
    with tempfile.TemporaryDirectory() as tmp:
        recs = build(bfcl_wheel(args.bfcl_wheel, Path(tmp)), Path(tmp), budget)
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in recs)
    print(summary(recs, budget))
    out = Path(args.out)
    if args.check:
        same = out.is_file() and out.read_text(encoding="utf-8") == text
        print(f"{out}: {'identical' if same else 'DIFFERS'}")
        return 0 if same else 1
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text, encoding="utf-8")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
