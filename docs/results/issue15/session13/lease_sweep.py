"""How 1P+1D's simulated TTFT depends on the pool's lease: `simulate validate` with the pool's lease forced.

    PYTHONPATH=. python docs/results/issue15/session13/lease_sweep.py RUN_DIR PROFILE [LEASE_S ...]

A diagnosis, not a fit: the simulator's default is mooncake_master's default_kv_lease_ttl (10 s)."""

import sys

import nanoforge.sim.pool as pool
from nanoforge.cli import main

run_dir, profile, *leases = sys.argv[1:]
real = pool.KVPool.__init__
for lease in leases or ["10", "5"]:
    def forced(self, *a, _lease=float(lease), **k):
        k["lease_s"] = _lease
        real(self, *a, **k)

    pool.KVPool.__init__ = forced
    print(f"== pool lease {lease} s", flush=True)
    main(["simulate", "validate", run_dir, "--profile", profile, "--configs", "1p1d", "--quiet", "--out", "/tmp/lease"])
