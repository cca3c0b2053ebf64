"""`specplug run` / `specplug generate`: prompts in, answers out, nothing lost.

- Every finished answer is appended to `--output` at once (one JSON line in one write, fsynced),
  so the file is valid JSONL at every moment; Ctrl-C keeps what is done, writes the statistics
  and says how to continue; `--resume` skips (id, turn) pairs already in the file.
- An existing output is never overwritten without `--force`, and an input file (the prompts, the
  config) is never written to; bad output paths are reported before the model loads, and the
  outputs are claimed then (`claimed_outputs`): a second run on the same files fails at once.
- A full disk or an I/O error ends the run with one line (OutputWriteError, exit code 1): the
  file, the error, how many answers are safely in the output, the command that resumes.
- Records with several turns run every turn, the model's own answer fed into the next one (as
  `specplug bench` does); each turn is a line of its own.
- With several answers and no `--output`, each answer is printed with its id.
- With `--record DIR` (or `record:` in the YAML) every answer's token ids, and its prompt's, are
  also kept in DIR as token shards (specplug.record).
"""
from __future__ import annotations

import json
import os
import sys
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Iterator, Sequence

from specplug.api import prompt_ids
from specplug.engine import Request
from specplug.errors import SpecplugError
from specplug.outputs import LineFile, OutputWriteError, claim, describe_os_error, write_atomic, write_error
from specplug.record import Recorder


def check_paths(output: str | None, stats: str | None, inputs: Sequence[str | Path], force: bool,
                resume: bool) -> None:
    """Refuse, before anything runs, output paths that cannot be written or must not be."""
    if resume and not output:
        raise SpecplugError("--resume needs --output (the file whose finished answers to skip)")
    if resume and force:
        raise SpecplugError("give either --resume (continue the output) or --force (overwrite it), not both")
    ins = [Path(i) for i in inputs if i is not None and Path(i).exists()]
    for path, flag in ((output, "--output"), (stats, "--stats")):
        if path is None:
            continue
        p = Path(path)
        if p.is_dir():
            raise SpecplugError(f"{flag} {p} is a directory; give a file path")
        if not p.parent.is_dir():
            raise SpecplugError(f"{flag} {p}: the folder {p.parent} does not exist")
        for i in ins:
            if p.exists() and os.path.samefile(p, i) or p.resolve() == i.resolve():
                raise SpecplugError(f"{flag} {p} is an input of this run ({i}); write the results somewhere else")
        if p.exists() and p.stat().st_size > 0 and not (force or resume):
            claim(p, flag).release()  # a run writing it now is named (OutputBusyError), not its file
            raise SpecplugError(f"{flag} {p} exists; add --resume to continue it (answers already there are "
                                f"skipped) or --force to overwrite it")


@contextmanager
def claimed_outputs(output: str | None, stats: str | None, inputs: Sequence[str | Path], force: bool,
                    resume: bool) -> Iterator[None]:
    """Claim --output and --stats for the whole block (see specplug.outputs; a second run on them
    fails at once) and, unless resuming, create the output now: exclusively, or emptied with --force.
    Meant to be entered before the model loads."""
    check_paths(output, stats, inputs, force, resume)  # the usual messages before any lock file
    with ExitStack() as held:
        for path, flag in ((output, "--output"), (stats, "--stats")):
            if path:
                held.enter_context(claim(path, flag))
        check_paths(output, stats, inputs, force, resume)  # again under the lock: a run may just have ended
        if output and not resume:
            try:
                LineFile(output, "truncate" if force else "new").close()
            except FileExistsError:
                raise SpecplugError(f"--output {output} exists; add --resume to continue it or --force to "
                                    "overwrite it") from None
            except OSError as exc:
                raise write_error(f"--output {output}", exc) from None
        yield


def read_done(path: Path) -> dict[tuple, dict]:
    """(id, turn) -> record of an output file being resumed. A last line cut by an interrupted write
    is dropped from the file; a malformed line elsewhere is an error naming it."""
    done: dict[tuple, dict] = {}
    if not path.exists():
        return done
    lines = path.read_text(encoding="utf-8").split("\n")
    good = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            key = (json.dumps(rec["id"]), int(rec.get("turn", 0)))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            if all(not rest.strip() for rest in lines[n:]):  # the last line, cut mid-write
                print(f"specplug: {path}:{n}: dropping an incomplete last line", file=sys.stderr)
                break
            raise SpecplugError(f"{path}:{n}: not a result line of `specplug run`; cannot resume from this file")
        done[key] = rec
        good.append(line)
    kept = "".join(g + "\n" for g in good)
    if kept != "\n".join(lines):  # rewritten only when something is dropped, and atomically
        write_atomic(path, kept, "--output")
    return done


class _SinkFailed(Exception):
    """An append to --output failed (carries the OSError out of the engine's callback)."""


def run_records(engine, cfg, records: list[dict], output: str | None, stats_path: str | None,
                resume: bool = False, resume_command: str | None = None) -> int:
    """Generate every turn of every record; see the module docstring. `resume_command` is what a
    failed write tells the user to run (default: the same command with --resume)."""
    with ExitStack() as held:  # a no-op where claimed_outputs holds them already
        for path, flag in ((output, "--output"), (stats_path, "--stats")):
            if path:
                held.enter_context(claim(path, flag))
        recorder = Recorder.from_config(cfg.record, engine, "run")  # `record:` / --record: off unless asked
        if recorder is not None:
            held.callback(recorder.close)
        return _run_records(engine, cfg, records, output, stats_path, resume, resume_command, recorder)


def _run_records(engine, cfg, records, output, stats_path, resume, resume_command, recorder=None) -> int:
    tok = engine.target.tokenizer
    out_path = Path(output) if output else None
    done = read_done(out_path) if resume and out_path else {}
    skipped = sum(1 for r in records for t in range(len(r["turns"])) if (json.dumps(r["id"]), t) in done)
    if skipped:
        print(f"specplug: resuming {out_path}: {skipped} answer(s) already there are skipped", file=sys.stderr)
    total = sum(len(r["turns"]) for r in records) - skipped
    stream_one = total == 1 and out_path is None
    try:
        sink = LineFile(out_path, "append" if resume else "truncate") if out_path else None
    except OSError as exc:
        raise write_error(f"--output {out_path}", exc) from None
    history: dict[int, list[dict]] = {i: [] for i in range(len(records))}
    saved = 0
    bar = None
    if out_path is not None and total > 1:
        from tqdm import tqdm

        bar = tqdm(total=total, unit="answer", file=sys.stderr)
    try:
        for turn in range(max(len(r["turns"]) for r in records)):
            reqs, owners = [], []
            for i, r in enumerate(records):
                if turn >= len(r["turns"]):
                    continue
                msgs = history[i] + [{"role": "user", "content": r["turns"][turn]}]
                prev = done.get((json.dumps(r["id"]), turn))
                if prev is not None:
                    history[i] = msgs + [{"role": "assistant", "content": prev["text"]}]
                    continue
                system = r.get("system") or cfg.system  # a record's own system prompt wins over the run's
                ids = prompt_ids(tok, msgs, True, system) if cfg.chat else tok.encode(r["turns"][turn])
                reqs.append(Request(ids, cfg.max_tokens, len(owners)))  # id: index into owners
                owners.append((i, msgs))
            if not reqs:
                continue
            stream = tok.stream(skip_special=True) if stream_one else None

            def on_tokens(_index, ids, stream=stream):
                if stream is not None:
                    for t in ids:
                        sys.stdout.write(stream.push(t))
                    sys.stdout.flush()

            def on_finish(res, turn=turn):
                nonlocal saved
                if recorder is not None:
                    recorder.offer(res.prompt_ids, res.token_ids)
                i, msgs = owners[res.id]
                rid = records[i]["id"]
                text = tok.decode(res.token_ids, skip_special=True)
                history[i] = msgs + [{"role": "assistant", "content": text}]
                line = {"id": rid, "turn": turn, "prompt": msgs[-1]["content"], "text": text,
                        "token_ids": res.token_ids, "finish_reason": res.finish_reason, "stats": res.stats.to_dict()}
                if sink is not None:
                    try:
                        sink.append(json.dumps(line))
                    except OSError as exc:
                        raise _SinkFailed(exc) from exc
                    saved += 1
                elif not stream_one:
                    print(f"### {rid}" + (f" (turn {turn + 1})" if len(records[i]["turns"]) > 1 else ""))
                    print(text + "\n", flush=True)
                if bar is not None:
                    bar.update(1)

            engine.run(reqs, on_tokens, on_finish)
            if stream is not None:
                sys.stdout.write(stream.flush() + "\n")
    except _SinkFailed as failed:
        if bar is not None:
            bar.close()
        sink.close()
        kept = f"{len(done) + saved} answer(s) are safely in it, whole lines"
        try:
            _write_stats(engine, stats_path)
            kept += f"; statistics written to {stats_path}" if stats_path else ""
        except OutputWriteError as exc:
            kept += f"; --stats {stats_path} could not be written either: {describe_os_error(exc.__context__ or exc)}"
        again = resume_command or "the same command with --resume"
        raise write_error(f"--output {out_path}", failed.__cause__, f"{kept}; free space, then run: {again}") from None
    except KeyboardInterrupt:
        if bar is not None:
            bar.close()
        _finish(engine, sink, stats_path)
        where = f"{saved} answer(s) were saved to {out_path}; run the same command with --resume to continue" \
            if out_path else "nothing was saved (no --output)"
        print(f"\nspecplug: interrupted: {where}", file=sys.stderr)
        raise
    if bar is not None:
        bar.close()
    _finish(engine, sink, stats_path)
    return 0


def _finish(engine, sink, stats_path: str | None) -> None:
    import torch

    if sink is not None:
        sink.close()
    gov = getattr(engine.model, "governor", None)
    engine.stats.threads = (gov.n_max if gov else torch.get_num_threads()) if engine.model.device.type == "cpu" else 0
    engine.stats.threads_auto = gov.describe() if gov else ""
    print(engine.stats.summary(), file=sys.stderr)
    _write_stats(engine, stats_path)


def _write_stats(engine, stats_path: str | None) -> None:
    if stats_path:
        write_atomic(stats_path, json.dumps(engine.stats.to_dict(), indent=2), "--stats")
