"""`threads: auto` on a CPU that is not ours alone: the kernels' thread count chosen online.

With idle cores the kernels are fastest on every core of the process's affinity mask. With a busy
neighbour (a browser, a second job, `specplug train data` beside a benchmark) one thread fewer
is often faster: the chunk pool (csrc/chunk_pool.h) hands a descheduled thread's work to the
others, but the step still pays for the switches and for the caches the neighbour evicts.
Which count wins depends on the load, and the load changes, so the governor measures it.

It times every forward (wall clock) per row-count bucket (rows rounded up to a power of two, so a
decode step is compared with decode steps and a prefill chunk with prefill chunks). After
`period` forwards at the current count it may run a short probe of `probe` forwards at one
thread fewer (or one more, alternately, once below the maximum) and moves there when the probe
was faster by more than `margin` on the buckets both saw. A probe that loses doubles the period,
up to `max_period`; a move resets it, so a change of load is followed within ~50 forwards.

Probes cost time when they lose, so they run only where they may win:
- down, only when the process got visibly fewer cores than it has threads during its forwards
  (process CPU time over wall time, below threads - 0.6): on idle cores the kernels' threads
  run all the time, so an idle machine never probes;
- up, only when the kernel reports no other runnable task beside ours (/proc/stat's
  procs_running, sampled over the last forwards before the probe), on Linux; elsewhere always.

Results do not depend on the thread count (each output value is reduced by one thread in one
fixed order), so switching changes timings only, never a token.
"""
from __future__ import annotations

import time
from collections import defaultdict

import torch


class ThreadGovernor:
    def __init__(self, n_max: int, period: int = 16, probe: int = 6, max_period: int = 1024, margin: float = 0.03,
                 alpha: float = 0.2):
        assert n_max >= 2
        self.n_max, self.base, self.probe_len, self.max_period = n_max, period, probe, max_period
        self.margin, self.alpha = margin, alpha
        self.current = n_max  # the count in use between probes
        self.period = period
        self.left = period  # forwards before the next probe
        self.probing: int | None = None  # the count under test, or None
        self.probe_left = 0
        self.samples: dict[int, list[float]] = defaultdict(list)  # bucket -> probe times (s)
        self.ewma: dict[int, float] = {}  # bucket -> recent time at `current` (s)
        self.up_next = False  # alternate probing down and up when both are possible
        self.moves = 0
        self.probes = 0
        self.skipped = 0  # probe points passed without a probe (it could not win)
        self.forwards: dict[int, int] = defaultdict(int)  # thread count -> forwards run with it
        self._t0 = self._c0 = 0.0
        self.cpu = self.wall = 0.0  # process CPU seconds and wall seconds inside forwards since the last decision
        self.others: list[int] = []  # other runnable tasks seen at the ends of the last forwards
        self._bucket = 0
        self._active = n_max
        torch.set_num_threads(n_max)

    @property
    def threads(self) -> int:
        return self._active

    def begin(self, rows: int) -> None:
        self._bucket = 1 << max(0, int(rows) - 1).bit_length()
        self._active = self.probing if self.probing is not None else self.current
        if self._active != torch.get_num_threads():  # a switch (or another target set the count meanwhile)
            torch.set_num_threads(self._active)
        self._c0 = time.process_time()
        self._t0 = time.perf_counter()

    def end(self) -> None:
        dt = time.perf_counter() - self._t0
        b = self._bucket
        self.forwards[self._active] += 1
        if self.probing is None:
            self.cpu += time.process_time() - self._c0
            self.wall += dt
            old = self.ewma.get(b)
            self.ewma[b] = dt if old is None else old + self.alpha * (dt - old)
            self.left -= 1
            if 0 < self.left <= 4 and self.current < self.n_max:
                n = _runnable()
                if n is not None:
                    self.others.append(max(0, n - 1))  # this thread is running; the kernels' workers are parked
            if self.left <= 0:
                self._start_probe()
            return
        if self.probe_left < self.probe_len:  # the first forward after a switch warms the other threads up
            self.samples[b].append(dt)
        self.probe_left -= 1
        if self.probe_left <= 0:
            self._finish_probe()

    def _start_probe(self) -> None:
        down, up = self.current - 1, self.current + 1
        if self.up_next and up <= self.n_max or down < 1:
            cand = up
        else:
            cand = down
        self.up_next = not self.up_next
        cores_had = self.cpu / self.wall if self.wall else float(self.current)
        others = sorted(self.others)[len(self.others) // 2] if self.others else 0
        self.cpu = self.wall = 0.0
        self.others.clear()
        # (measured on 2 idle cores: 1.54-1.69 cores in forwards at 2 threads, the workers parking between
        # calls; beside one busy neighbour 1.13)
        pointless = (cand < self.current and cores_had > self.current - 0.6) or (cand > self.current and others > 0)
        if not 1 <= cand <= self.n_max or pointless:
            self.skipped += 1
            self.period = min(self.period * 2, self.max_period)
            self.left = self.period
            return
        self.probing, self.probe_left = cand, self.probe_len + 1
        self.samples.clear()
        self.probes += 1

    def _finish_probe(self) -> None:
        num = den = 0.0
        for b, xs in self.samples.items():
            ref = self.ewma.get(b)
            if ref is not None and xs:
                xs = sorted(xs)
                num += xs[len(xs) // 2] * len(xs)  # the median: a probe forward the neighbour preempted is noise
                den += ref * len(xs)
        cand, self.probing = self.probing, None
        if den and num < den * (1 - self.margin):
            self.current = cand
            self.moves += 1
            self.period = self.base
            self.ewma = {b: sorted(xs)[len(xs) // 2] for b, xs in self.samples.items() if xs}
        else:
            self.period = min(self.period * 2, self.max_period)
        self.left = self.period

    def describe(self) -> str:
        """e.g. 'auto: 2 threads for 97% of forwards, 1 for 3%'."""
        total = sum(self.forwards.values()) or 1
        parts = [f"{n} thread{'s' * (n > 1)} for {100 * c / total:.0f}%"
                 for n, c in sorted(self.forwards.items(), key=lambda kv: -kv[1])]
        return "auto: " + (", ".join(parts) if parts else f"{self.n_max} threads") + " of forwards"


def _runnable() -> int | None:
    """Runnable tasks on the machine now (Linux /proc/stat procs_running), or None where unknown."""
    try:
        with open("/proc/stat", "rb") as f:
            for line in f:
                if line.startswith(b"procs_running"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None
