"""Counters per speculator and per sequence, and the time split target / speculators / host."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class SpecStats:
    """One speculator over a run (or one sequence)."""

    drafts: int = 0  # drafts verified
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    accepted_at: list[int] = field(default_factory=list)  # accepted_at[i]: drafts whose token i was accepted
    drafted_at: list[int] = field(default_factory=list)  # drafted_at[i]: drafts that had a token i
    # reached_at[i]: drafts with a token i whose tokens < i were accepted
    reached_at: list[int] = field(default_factory=list)
    # the engine's view of the speculator (run-wide; zero in a sequence's own statistics)
    seq_steps: int = 0  # sequence-steps where it could have been asked
    asked: int = 0  # sequence-steps where it was asked (the others: paused, or no draft could pay)
    draft_calls: int = 0
    draft_s: float = 0.0  # seconds in its `draft` hook
    proposed: int = 0  # drafts of at least one token it returned (verified or not)
    proposed_first_hit: int = 0  # of those, drafts whose first token is the token the target committed there
    hook_s: dict[str, float] = field(default_factory=dict)  # seconds per hook
    hook_calls: dict[str, int] = field(default_factory=dict)

    def add(self, n_drafted: int, n_accepted: int) -> None:
        self.drafts += 1
        self.drafted_tokens += n_drafted
        self.accepted_tokens += n_accepted
        reached = min(n_accepted + 1, n_drafted)
        for arr, n in ((self.drafted_at, n_drafted), (self.accepted_at, n_accepted), (self.reached_at, reached)):
            if len(arr) < n_drafted:
                arr.extend([0] * (n_drafted - len(arr)))
            for i in range(n):
                arr[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["acceptance_rate"] = round(self.acceptance_rate, 4)
        d["acceptance_per_position"] = [round(a / n, 4) if n else 0.0
                                        for a, n in zip(self.accepted_at, self.drafted_at)]
        d["acceptance_per_position_conditional"] = [round(a / n, 4) if n else 0.0
                                                    for a, n in zip(self.accepted_at, self.reached_at)]
        d["draft_s"] = round(self.draft_s, 4)
        d["hook_s"] = {k: round(v, 4) for k, v in self.hook_s.items()}
        # drafting time per token the target accepted; the share of sequence-steps it was asked on
        # and whose draft was verified; first-token match over every draft it returned (verified or not)
        d["draft_ms_per_accepted"] = (round(1000 * self.draft_s / self.accepted_tokens, 4)
                                      if self.accepted_tokens else None)
        d["asked_share"] = round(self.asked / self.seq_steps, 4) if self.seq_steps else 0.0
        d["verified_share"] = round(self.drafts / self.seq_steps, 4) if self.seq_steps else 0.0
        d["first_token_match"] = round(self.proposed_first_hit / self.proposed, 4) if self.proposed else None
        return d


@dataclass
class SeqStats:
    """One sequence: what it produced and how many target forwards it took."""

    prompt_tokens: int = 0
    generated_tokens: int = 0  # the stop token excluded
    emitted_tokens: int = 0  # tokens the target produced, the stop token included
    target_forwards: int = 0  # decoding forwards (prompt chunks not counted)
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    by_speculator: dict[str, SpecStats] = field(default_factory=dict)
    time_prefill_s: float = 0.0  # prompt processing up to and including the first generated token
    time_s: float = 0.0  # admission to finish; time_s - time_prefill_s is the decoding phase

    @property
    def mean_accepted_length(self) -> float:
        """Tokens the target produced per decoding forward, the stop token included (plain decoding: 1.0)."""
        return self.emitted_tokens / self.target_forwards if self.target_forwards else 0.0

    def to_dict(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "generated_tokens": self.generated_tokens,
                "target_forwards": self.target_forwards, "drafted_tokens": self.drafted_tokens,
                "accepted_tokens": self.accepted_tokens,
                "acceptance_rate": round(self.accepted_tokens / self.drafted_tokens, 4) if self.drafted_tokens else 0.0,
                "mean_accepted_length": round(self.mean_accepted_length, 4),
                "time_s": {"total": round(self.time_s, 4), "prefill": round(self.time_prefill_s, 4)},
                "by_speculator": {k: v.to_dict() for k, v in self.by_speculator.items()}}


@dataclass
class RunStats:
    """A whole run: speculators, time split, totals."""

    speculators: dict[str, SpecStats] = field(default_factory=dict)
    disabled: dict[str, str] = field(default_factory=dict)  # speculator -> why it was turned off
    # speculator -> its own line for the summary (files it wrote, ...)
    notes: dict[str, str] = field(default_factory=dict)
    threads: int = 0  # CPU threads the target ran on (0: not a CPU target)
    threads_auto: str = ""  # under `threads: auto`: the counts the governor chose, and how often
    time_target_s: float = 0.0
    time_speculators_s: float = 0.0
    time_total_s: float = 0.0
    prompt_tokens: int = 0
    generated_tokens: int = 0  # the stop tokens excluded
    emitted_tokens: int = 0  # the stop tokens included
    target_forwards: int = 0

    @property
    def time_host_s(self) -> float:
        return max(0.0, self.time_total_s - self.time_target_s - self.time_speculators_s)

    def to_dict(self) -> dict:
        return {
            "generated_tokens": self.generated_tokens, "prompt_tokens": self.prompt_tokens,
            "target_forwards": self.target_forwards,
            "mean_accepted_length": (round(self.emitted_tokens / self.target_forwards, 4)
                                     if self.target_forwards else 0.0),
            "tok_s": round(self.generated_tokens / self.time_total_s, 3) if self.time_total_s else 0.0,
            "time_s": {"total": round(self.time_total_s, 4), "target": round(self.time_target_s, 4),
                       "speculators": round(self.time_speculators_s, 4), "host": round(self.time_host_s, 4)},
            "speculators": {k: v.to_dict() for k, v in self.speculators.items()},
            "disabled": dict(self.disabled),
            "notes": dict(self.notes),
            "threads": self.threads,
            **({"threads_auto": self.threads_auto} if self.threads_auto else {}),
        }

    def summary(self) -> str:
        d = self.to_dict()
        t = d["time_s"]
        lines = [f"{d['generated_tokens']} tokens in {t['total']:.2f} s = {d['tok_s']:.1f} tok/s; "
                 f"{d['target_forwards']} target forwards, mean accepted length {d['mean_accepted_length']:.2f}; "
                 f"time target {t['target']:.2f} s, speculators {t['speculators']:.2f} s, host {t['host']:.2f} s"
                 + (f"; {self.threads_auto or f'{self.threads} CPU threads'}" if self.threads else "")]
        for name, s in d["speculators"].items():
            per = " ".join(f"{x:.2f}" for x in s["acceptance_per_position"][:8])
            lines.append(f"  {name}: {s['drafts']} drafts, {s['drafted_tokens']} drafted, "
                         f"{s['accepted_tokens']} accepted "
                         f"({100 * s['acceptance_rate']:.1f}%); acceptance by position: {per}")
            if s["seq_steps"]:
                per_kept = s["draft_ms_per_accepted"]
                lines.append(f"    asked on {100 * s['asked_share']:.0f}% of steps, "
                             f"verified on {100 * s['verified_share']:.0f}%; "
                             f"drafting {1000 * s['draft_s']:.0f} ms"
                             + (f" ({per_kept:.2f} ms per accepted token)" if per_kept is not None else ""))
        for name, note in d["notes"].items():
            lines.append(f"  {name}: {note}")
        for name, why in d["disabled"].items():
            lines.append(f"  {name}: DISABLED ({why})")
        return "\n".join(lines)
