"""Run by tests/test_parallel.py under torchrun: several parallel layouts in one launch (each launch costs
seconds), each training the same recipe with `pretrain` on its own DeviceMesh of the same processes.

    torchrun --nproc-per-node N tests/parallel_worker.py DATA_DIR OUT_DIR NAME=MODEL:k=v,k=v ...

k=v are ParallelDims fields (tp, cp, pp, dp_shard, dp_replicate; pp_schedule, stages_per_rank), `ga`
(--grad-accum) and `ac` (--ac); every given degree counts as a flag given (applied even at degree 1). Each layout
writes its run folder OUT_DIR/NAME (log.json, the exported model); the test compares them with
one-process runs of the same recipe.
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from nanoforge.train.parallel.dims import ParallelDims
from nanoforge.train.parallel.layout import Parallel
from nanoforge.train.pretrain import pretrain

sys.path.insert(0, str(Path(__file__).parent))
from test_parallel import recipe  # noqa: E402  (the recipe the test's one-process runs use)


def main(data_dir: str, out_dir: str, *specs: str) -> None:
    world = int(__import__("os").environ["WORLD_SIZE"])
    started = False
    for spec in specs:
        name, rest = spec.split("=", 1)
        model, _, opts = rest.partition(":")
        kw = dict(o.split("=") for o in opts.split(",") if o)
        ga = int(kw.pop("ga", 1))
        extra = {"ac": kw.pop("ac")} if "ac" in kw else {}  # a TrainConfig field: activation checkpointing
        ints = {k: int(v) for k, v in kw.items() if k != "pp_schedule"}
        dims = ParallelDims(**ints, pp_schedule=kw.get("pp_schedule", "1f1b"), world_size=world, explicit=frozenset(ints))
        if not started:
            layout = Parallel.start(dims, "cpu")
            started = True
        else:
            layout = Parallel.build(dims, torch.device("cpu"))
        pretrain(recipe(model, data_dir, ga, **extra), Path(out_dir) / name, layout=layout)
        dist.barrier()
    layout.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
