"""Mooncake Store's put and get rates on this host, the way a 1 prefill + 1 decode cluster uses them: a writer
process puts whole KV blocks into its own segment (as a prefill instance does) and gets them back (local), then
another process with its own segment gets them (over the transfer engine's TCP on loopback, as a decode
instance does). Each with 1, 2, 4 and 8 threads calling at once (the KV connector's `--kv-pool-workers`).

    python benchmarks/pool_transfer.py            # table; $OUT/pool_transfer.json (default ./out)
    BLOCK=1835008 PER_CALL=32 CALLS=4 SEGMENT_GB=6 python benchmarks/pool_transfer.py

BLOCK: bytes per object (default Qwen3-0.6B's 16-token block: 28 layers x K,V x 16 x 8 heads x 128 x 2 bytes);
PER_CALL objects per batched call; CALLS calls per thread. Needs Mooncake Store (`.[disagg]`); everything on
127.0.0.1.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from nanoforge.serve.disagg.mooncake_store import MooncakeMaster, MooncakeStore  # noqa: E402

BLOCK = int(os.environ.get("BLOCK", "1835008"))
PER_CALL = int(os.environ.get("PER_CALL", "32"))
CALLS = int(os.environ.get("CALLS", "4"))
SEGMENT = int(float(os.environ.get("SEGMENT_GB", "6")) * 2**30)
THREADS = (1, 2, 4, 8)


def buffer() -> torch.Tensor:
    buf = torch.randint(0, 255, (max(THREADS) * PER_CALL * BLOCK,), dtype=torch.uint8)
    return buf.pin_memory() if torch.cuda.is_available() else buf


def timed(store: MooncakeStore, kind: str, threads: int, buf: torch.Tensor) -> dict:
    """`threads` threads, each making CALLS batched calls of PER_CALL objects (keys named by thread and call, so
    a get finds what the put of the same thread count wrote)."""
    base = buf.data_ptr()
    done = [0] * threads

    def work(t: int) -> None:
        for c in range(CALLS):
            keys = [f"pool-transfer/{threads}/{t}/{c}/{i}" for i in range(PER_CALL)]
            ptrs = [base + (t * PER_CALL + i) * BLOCK for i in range(PER_CALL)]
            done[t] += sum((store.put_from if kind == "put" else store.get_into)(keys, ptrs, BLOCK))

    workers = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    start = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    seconds = time.perf_counter() - start
    n = sum(done)
    return {"kind": kind, "threads": threads, "objects": n, "asked": threads * CALLS * PER_CALL,
            "seconds": seconds, "gb_per_s": n * BLOCK / seconds / 1e9, "ms_per_object": 1e3 * seconds / max(n, 1)}


def writer(master: str) -> None:
    store = MooncakeStore(master, segment_bytes=SEGMENT)
    store.wait_warm()  # into resident memory, as an instance's saves once it serves
    buf = buffer()
    store.register_buffer(buf.data_ptr(), buf.numel())
    rows = [timed(store, "put", t, buf) for t in THREADS]
    rows += [timed(store, "get", t, buf) for t in THREADS]
    for r in rows:
        r["kind"] += " (own segment)"
    print(json.dumps(rows), flush=True)
    sys.stdin.read()  # hold the segment until the reader is done
    store.close()


def main() -> int:
    with MooncakeMaster() as master:
        proc = subprocess.Popen([sys.executable, __file__, "--writer", master.address], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)
        line = proc.stdout.readline()
        if not line:
            proc.wait()
            print("the writer process failed (see above)", file=sys.stderr)
            return 1
        rows = json.loads(line)
        store = MooncakeStore(master.address, segment_bytes=1 << 30)
        store.wait_warm()
        buf = buffer()
        store.register_buffer(buf.data_ptr(), buf.numel())
        for t in THREADS:
            rows.append({**timed(store, "get", t, buf), "kind": "get (another process's segment)"})
        store.close()
        proc.communicate("")
    print(f"{BLOCK} bytes an object, {PER_CALL} a call, {CALLS} calls a thread")
    for r in rows:
        print(f"{r['kind']:<34} {r['threads']} threads  {r['objects']:>5}/{r['asked']:<5} objects  "
              f"{r['gb_per_s']:6.2f} GB/s  {r['ms_per_object']:.3f} ms an object")
    out = Path(os.environ.get("OUT", "out"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "pool_transfer.json").write_text(json.dumps({"block": BLOCK, "per_call": PER_CALL, "rows": rows}, indent=1))
    print(f"wrote {out / 'pool_transfer.json'}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--writer":
        writer(sys.argv[2])
    else:
        sys.exit(main())
