"""specplug: every speculative-decoding method a plugin (see the README).

Importing the package, before torch is imported, sets `GOMP_SPINCOUNT=30000` unless
`OMP_WAIT_POLICY` or `GOMP_SPINCOUNT` is already set. After each torch operation, torch's OpenMP
threads otherwise spin waiting for the next one (libgomp's default count, 300,000), and on a
machine with few cores they take the cores from the gguf kernels' own threads: a target forward
right after a head's draft (dozens of small torch operations) took 1.6x as long with 2 rows and
1.9x with 4 as the same forward back to back (AMD EPYC Zen 4, 2 threads, 2026-11-26;
`scripts/omp_wait.py` at commit c8dab82). A short spin keeps back-to-back torch operations as quick
and leaves the cores free. It has no effect where torch was imported first; set the variable yourself there.
"""
import os as _os

if "OMP_WAIT_POLICY" not in _os.environ and "GOMP_SPINCOUNT" not in _os.environ:
    _os.environ["GOMP_SPINCOUNT"] = "30000"
