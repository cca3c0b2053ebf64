"""Issues 37/39: a head's first-token hits on a data set (teacher-forced, as `specplug heads eval`),
split by what the context's lookup (`specplug.heads.lookup`; the head's own `lookup_n`, the pair for a
head without the lookup) says about the row: it proposes the target's next token ("copy_right"),
proposes another ("copy_wrong"), or has nothing ("no_bigram").
Where the head misses copy_right rows a prompt lookup would get, the head cannot copy.

    python scripts/lookup_classes.py DATA_DIR HEAD.gguf [HEAD.gguf ...] > out.json
"""
import json
import sys
from pathlib import Path

import torch

from specplug.heads import HeadFile
from specplug.heads.lookup import NONE, sequence_lookups
from specplug.train.distill import step_mask
from specplug.train.finetune import BaseHead
from specplug.train.loop import build, load_trainer


def classes(tokens: list[int], n: int = 2) -> list[int]:
    """Per position t (predicting tokens[t + 1]): 0 copy right, 1 copy wrong, 2 no earlier pair (n: the
    longest m-gram the lookup matches)."""
    look = sequence_lookups(tokens, n)
    return [2 if look[t] == NONE or t + 1 >= len(tokens) else 0 if look[t] == tokens[t + 1] else 1
            for t in range(len(tokens))]


def run(data_dir: str, head_path: str) -> dict:
    head = HeadFile(head_path)
    cls = load_trainer(head.meta.method)
    base = BaseHead(head, cls)
    opts = base.options({})
    look_n = getattr(opts, "lookup_n", 2)
    data, trainer = build(cls, opts, Path(data_dir), torch.device("cpu"), val_fraction=1.0, init=base)
    trainer.module.eval()
    hit = torch.zeros(3)
    tot = torch.zeros(3)
    d2t = trainer.d2t
    with torch.no_grad():
        for g in data.batches("val", 8192, shuffle=False):
            b = data.collate(g)
            cl = torch.full(b.tokens.shape, 3, dtype=torch.long)
            for i, (a, n, p, _) in enumerate(g):
                cl[i, :n] = torch.tensor(classes(b.tokens[i, :n].tolist(), look_n))
            look, rows = trainer._lookups(b) if hasattr(trainer, "_lookups") else (None, None)  # eagle3's
            extra = () if look is None else (look,)
            for r, out in trainer.module.unroll(b.tokens, b.positions, trainer._taps(b), 1, *extra):
                m = step_mask(b, 0)
                logits = trainer.module.logits(out[m]) if rows is None else trainer.module.logits(out[m], rows[m])
                h = d2t[logits.argmax(-1)] == b.topk_ids[..., 0][m]
                c = cl[m]
                for k in range(3):
                    hit[k] += float(h[c == k].sum())
                    tot[k] += float((c == k).sum())
    names = ["copy_right", "copy_wrong", "no_bigram"]
    return {"head": head_path, "rows": {n: int(tot[k]) for k, n in enumerate(names)},
            "top1": {n: round(float(hit[k] / max(1, tot[k])), 4) for k, n in enumerate(names)},
            "overall": round(float(hit.sum() / tot.sum()), 4)}


if __name__ == "__main__":
    torch.set_num_threads(2)
    res = [run(sys.argv[1], h) for h in sys.argv[2:]]
    print(json.dumps(res, indent=1))
