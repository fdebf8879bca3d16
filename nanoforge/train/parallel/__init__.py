"""Llama 3's 4D parallelism on one DeviceMesh, applied to the unchanged model (torchtitan-style).

`dims.ParallelDims` (degrees from the flags, checked before any process group), `layout.Parallel` (the
trainer's layout over the mesh), and one small module per parallelism: `fsdp` (FSDP2), `tp` (tensor and
sequence parallelism), `cp` (context parallelism), `pp` (pipeline parallelism); beside them `ac` (activation
checkpointing, which the single-device trainer applies too) and `plan` (the planner).
"""
