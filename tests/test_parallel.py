"""Parallel training (nanoforge/train/parallel) on the CPU with gloo: torchrun on loopback, 2 and 4 processes,
tiny Llama and Qwen3 models, packed documents of random lengths that cross every chunk boundary.

Each layout trains the same recipe for 5 steps as a one-process run does; the losses (every step, every
evaluation, the final whole-split one) agree to fp32 rounding and so do the weights after the steps. Both
runs go through `pretrain`, so the loaders' shares, the loss divisor, clipping, the optimizer, evaluation
and the checkpoint export are all in the comparison. Then: DCP checkpoints reshard (2 processes -> 4 -> 1)
with the same optimizer state and losses as a run that never stopped; a rank that dies or hangs ends the run
within the process-group timeout with one line; bad layouts are one line and exit 2 before any process group.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from conftest import finish

REPO = Path(__file__).resolve().parents[1]
WORDS = "the king shall speak of war and love to thee my lord what now good night sweet prince".split()


def recipe(model: str, data_dir, grad_accum: int = 1, **kw):
    """The recipe every layout trains: 5 steps of 4 x 32 tokens per micro-batch at a learning rate high enough
    that the weights move, fp32, no compile; Qwen3 with 2 KV heads (tensor parallelism keeps whole ones) and its
    preset's 2 layers, Llama with 4 (interleaved 1F1B cuts 2 ranks x 2 stages)."""
    from nanoforge.train.config import TrainConfig

    overrides = {"n_kv_heads": 2} if model == "tiny-qwen3" else {"n_layers": 4}
    return TrainConfig(model=model, model_overrides=overrides, data=[str(data_dir)], batch_size=4, seq_len=32,
                       grad_accum=grad_accum, max_steps=5, lr=1e-2, min_lr=1e-3, warmup_steps=1, eval_interval=5,
                       eval_iters=2, log_interval=1, seed=0, compile=False, device="cpu", dtype="fp32").replace(**kw)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Documents of 1 to 8 words (5 to 50 characters): several per 32-token row, crossing rows and chunks."""
    from nanoforge.data.prepare import make_tokenizer, prepare

    root = tmp_path_factory.mktemp("parallel")
    rng = np.random.default_rng(0)
    docs = root / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": " ".join(rng.choice(WORDS, size=rng.integers(1, 9)))}) + "\n"
                            for _ in range(600)))
    out = root / "data"
    prepare([docs], out, make_tokenizer("char", [docs]), val_fraction=0.1)
    return out


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(k: int) -> list[int]:
    """k different free ports (for jobs that run side by side)."""
    socks = [socket.socket() for _ in range(k)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def env() -> dict:
    return os.environ | {"OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}


def torchrun(n: int, *argv, timeout: float = 300) -> subprocess.CompletedProcess:
    return finish(launch(n, *argv), timeout)


def launch(n: int, *argv, port: int | None = None) -> subprocess.Popen:
    """torchrun started in the background: a test runs what does not depend on it meanwhile (2 CPU cores)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n), "--master-addr", "127.0.0.1",
           "--master-port", str(port or free_port()), *map(str, argv)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env(), cwd=REPO)


def one_process(cfg, out) -> dict:
    from nanoforge.train.pretrain import pretrain

    return pretrain(cfg, out)


def log(out) -> dict:
    return json.loads((Path(out) / "log.json").read_text())


def assert_same_run(got_dir, want_dir, what: str) -> None:
    got, want = log(got_dir), log(want_dir)
    for part in ("train", "val"):
        g, w = [r["loss"] for r in got["history"][part]], [r["loss"] for r in want["history"][part]]
        assert len(g) == len(w) and g == pytest.approx(w, rel=1e-5, abs=1e-6), (what, part, g, w)
    assert got["final_val_loss_full_split"] == pytest.approx(want["final_val_loss_full_split"], rel=1e-5), what
    a, b = load_file(Path(got_dir) / "model.safetensors"), load_file(Path(want_dir) / "model.safetensors")
    assert a.keys() == b.keys(), what
    diff = torch.cat([(a[k] - b[k]).abs().flatten() for k in a])
    # Adam's first steps divide each gradient by its own size, so an element whose gradient is near zero moves
    # by up to lr (1e-2) on rounding noise alone: a few elements differ by ~1e-5, the mean by 1e-8 to 2e-7. A wrong
    # gradient anywhere moves the mean (and the losses) by orders of magnitude more.
    assert diff.max() < 1e-4 and diff.mean() < 1e-6, (what, diff.max().item(), diff.mean().item())


# --- arithmetic and bad layouts: no process group ------------------------------------------------------

def test_dims_resolve_the_mesh_and_name_it():
    from nanoforge.train.parallel.dims import ParallelDims
    from nanoforge.train.parallel.pp import bubble_fraction

    d = ParallelDims(tp=2, pp=2, world_size=16)
    assert d.dp_shard == 4 and d.dp == 4 and d.fsdp_size == 4 and d.describe() == "pp 2 x dp_shard 4 x tp 2, 1f1b"
    assert ParallelDims(cp=2, world_size=2).fsdp_size == 2  # cp ranks reduce gradients with the data ranks
    assert not ParallelDims(tp=2, world_size=2).enabled("fsdp")
    assert ParallelDims(tp=1, dp_shard=1, world_size=1, explicit=frozenset({"tp", "dp_shard"})).enabled("fsdp")
    assert ParallelDims(pp=4, pp_schedule="interleaved-1f1b", world_size=4).n_stages == 8
    assert bubble_fraction(4, 8) == pytest.approx(3 / 11) and bubble_fraction(4, 8, 2) == pytest.approx(3 / 19)


def test_context_parallel_chunks_balance_causal_work():
    """Rank i holds chunks i and 2cp - 1 - i: every rank's queries see the same number of keys in all."""
    from nanoforge.train.parallel.cp import chunk_index, gathered_index

    for cp in (2, 4):
        T = 8 * cp
        index = [chunk_index(T, cp, r) for r in range(cp)]
        assert sorted(torch.cat(index).tolist()) == list(range(T))
        work = {int((i + 1).sum()) for i in index}  # query at position p sees p + 1 keys
        assert len(work) == 1
        assert torch.equal(gathered_index(T, cp), torch.cat(index))


@pytest.mark.parametrize("case", ["no-torchrun", "product", "heads", "layers", "tied", "batch", "seq", "schedule"])
def test_bad_layouts_are_one_line_and_exit_2_before_any_process_group(case, data, tmp_path, monkeypatch, capsys):
    import torch.distributed as dist

    from nanoforge.cli import main

    base = ["train", "--preset", "tiny-llama", "--data", str(data), "--out", str(tmp_path / "run"),
            "--batch-size", "4", "--seq-len", "32", "--max-steps", "1"]
    world, flags, message = {
        "no-torchrun": (None, ["--tp", "2"], "launch with torchrun --nproc-per-node 2"),
        "product": (4, ["--tp", "3"], "4 processes cannot be split into dp_shard ? x tp 3"),
        "heads": (3, ["--tp", "3"], "--tp 3 must divide the model's n_heads (4)"),
        "layers": (4, ["--pp", "4"], "2 layers cannot be cut into 4 equal pipeline stages"),
        "tied": (2, ["--pp", "2", "--preset", "tiny-qwen3"], "this model ties them"),
        "batch": (4, ["--dp-shard", "4", "--batch-size", "6"], "--batch-size 6"),
        "seq": (2, ["--cp", "2", "--seq-len", "30"], "seq_len 30 must be a multiple of 4"),
        "schedule": (2, ["--pp", "2", "--pp-schedule", "zigzag"], "--pp-schedule 'zigzag'"),
    }[case]
    if world:  # as torchrun starts each process; no process group may be touched before the check
        monkeypatch.setenv("WORLD_SIZE", str(world))
        monkeypatch.setenv("RANK", "0")
    capsys.readouterr()
    assert main(base + flags) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not dist.is_initialized() and not (tmp_path / "run").exists()


# --- the planner ----------------------------------------------------------------------------------------

def test_planner_counts_the_memory_and_time_of_a_layout():
    """Hand-counted for llama3-8b on 64 GPUs, tp 8 x pp 2 x dp 4 (1F1B), 8K-token sequences, 1M tokens a step."""
    from nanoforge.model.config import preset
    from nanoforge.train.parallel.plan import GiB, Hardware, Layout, Workload, estimate, layer_params

    m = preset("llama3-8b")
    hw, w = Hardware(gpus=64), Workload(seq_len=8192, batch_tokens=2**20)
    est = estimate(m, Layout(tp=8, cp=1, pp=2, dp=4, schedule="1f1b"), w, hw)
    p_stage = 16 * layer_params(m) + m.vocab_size * m.d_model + m.d_model  # 16 blocks + embedding (or head)
    mem = est["memory_gib"]
    assert est["micro_batches"] == 2**20 // 8192 // 4 == 32
    assert mem["weights"] + mem["grads"] + mem["optimizer"] == pytest.approx(16 * p_stage / 32 / GiB)
    assert mem["gathered"] == pytest.approx((2 * p_stage + 2 * layer_params(m)) / 8 / GiB)  # a stage stays gathered
    per_token = 4 * 4096 / 8 + 4 * 4096 + 2 * 6144 / 8 + 2 * 4096 / 8 + 4 * 32 / 8 + 8 * 14336 / 8
    assert mem["activations"] == pytest.approx(16 * 2 * 8192 * per_token / GiB)  # 16 blocks x 2 micro-batches
    assert est["bubble"] == pytest.approx(1 / 33)
    flops = m.flops_per_token(8192) * 2**20
    assert est["time_s"]["compute"] == pytest.approx(flops / 64 / (989e12 * 0.5))
    assert est["mfu"] == pytest.approx(flops / (64 * 989e12 * est["time_s"]["step"]))
    assert est["fits"] and not est["recompute"]
    # the head's micro-batch of logits: bf16 logits and their bf16 gradient when compiled (the default), plus the
    # fp32 copy and its log-softmax when eager
    assert mem["logits"] == pytest.approx(4 * 8192 * m.vocab_size / 8 / GiB)
    eager = estimate(m, Layout(tp=8, cp=1, pp=2, dp=4, schedule="1f1b"), w, Hardware(gpus=64, compiled=False))
    assert eager["memory_gib"]["logits"] == pytest.approx(10 * 8192 * m.vocab_size / 8 / GiB)


def test_plan_lists_runnable_layouts_fitting_first_and_llama3_405b(tmp_path, capsys):
    from nanoforge.cli import main

    out = tmp_path / "plan.json"
    assert main(["plan", "--model", "llama3-70b", "--gpus", "64", "--batch-tokens", "2M", "--llama3",
                 "--json", str(out)]) == 0
    text = capsys.readouterr().out
    report = json.loads(out.read_text())
    rows = report["layouts"]
    assert rows and all(r["tp"] * r["cp"] * r["pp"] * r["dp"] == 64 for r in rows)
    assert all(64 % r["tp"] == 0 and 8 % r["tp"] == 0 and 80 % r["pp"] == 0 for r in rows)  # runnable here
    fits = [r["fits"] for r in rows]
    assert fits == sorted(fits, reverse=True) and not all(fits)  # fitting layouts first; some do not fit
    steps = [r["time_s"]["step"] for r in rows if r["fits"]]
    assert steps == sorted(steps)
    paper = report["llama3_405b"]
    assert {(r["tp"], r["cp"], r["pp"], r["dp"]) for r in paper} == {(8, 1, 16, 64), (8, 1, 16, 128), (8, 16, 16, 8)}
    for r in paper:  # the paper's layouts fit 80 GB H100s (with recomputation in this model of them)
        assert r["fits"] and r["bubble"] == pytest.approx((16 - 1) / (r["stages_per_rank"] * r["micro_batches"] + 15))
    assert "Llama 3 405B's published layouts" in text and "TP 8 CP 16 PP 16 DP 8: 38%" in text
    capsys.readouterr()
    assert main(["plan", "--model", "llama3-8b", "--gpus", "3", "--batch-tokens", "1M"]) == 2
    assert "no layout of 3 GPUs" in capsys.readouterr().err


# --- every layout trains like one process --------------------------------------------------------------

LAYOUTS = {
    2: {"fsdp": "tiny-qwen3:dp_shard=2", "tp": "tiny-qwen3:tp=2", "cp": "tiny-qwen3:cp=2",
        "pp_gpipe": "tiny-llama:pp=2,pp_schedule=gpipe,ga=2", "pp_1f1b": "tiny-llama:pp=2,ga=2",
        # activation checkpointing: FSDP2 gathers again for the recomputation; every other block of a stage
        "fsdp_ac": "tiny-qwen3:dp_shard=2,ac=full", "pp_1f1b_ac": "tiny-llama:pp=2,ga=2,ac=2"},
    4: {"dp_tp": "tiny-qwen3:dp_shard=2,tp=2", "tp_cp": "tiny-qwen3:tp=2,cp=2",
        "pp_dp": "tiny-llama:pp=2,dp_shard=2,ga=2", "hsdp": "tiny-llama:dp_replicate=2,dp_shard=2",
        "pp_interleaved_dp": "tiny-llama:pp=2,pp_schedule=interleaved-1f1b,dp_shard=2,ga=2",
        # recomputed under TP's redistributions and CP's key gathers
        "tp_cp_ac": "tiny-qwen3:tp=2,cp=2,ac=full"},
}


def references(data, root: Path) -> dict:
    """One-process runs of the recipe, by (model, grad_accum)."""
    runs = {}
    for model, ga in (("tiny-qwen3", 1), ("tiny-llama", 1), ("tiny-llama", 2)):
        out = root / f"{model}-{ga}"
        one_process(recipe(model, data, ga), out)
        losses = [r["loss"] for r in log(out)["history"]["train"]]
        assert losses[-1] < losses[0] - 0.05 and len(set(losses)) == 5  # it trains: the comparison means something
        runs[model, ga] = out
    return runs


def test_every_layout_trains_like_one_process(data, tmp_path):
    """FSDP2, TP (+SP), CP, PP (GPipe, 1F1B) on 2 processes; dp x tp, tp x cp, pp x dp, HSDP and interleaved
    1F1B x dp on 4; activation checkpointing under FSDP2, PP, and TP x CP: losses and weights after 5 steps equal
    the one-process run's (without checkpointing). The 2- and the 4-process
    launch run side by side (each process spends seconds importing), the one-process runs here meanwhile."""
    launched = {n: launch(n, REPO / "tests" / "parallel_worker.py", data, tmp_path / f"on{n}",
                          *(f"{name}={spec}" for name, spec in LAYOUTS[n].items()), port=port)
                for n, port in zip(LAYOUTS, free_ports(len(LAYOUTS)))}
    try:
        want = references(data, tmp_path / "one_process")
    finally:
        runs = {n: finish(proc) for n, proc in launched.items()}
    for n, run in runs.items():
        assert run.returncode == 0, (n, run.stderr[-3000:])
        for name, spec in LAYOUTS[n].items():
            model, _, opts = spec.partition(":")
            ga = 2 if "ga=2" in opts else 1
            assert_same_run(tmp_path / f"on{n}" / name, want[model, ga], name)
            ran = log(tmp_path / f"on{n}" / name)
            assert ran["checkpointed_blocks"] == {"ac=full": [0, 1], "ac=2": [0]}.get(opts.split(",")[-1], []), name
            described = ran["parallel"]  # e.g. "dp_shard 2 x tp 2"
            assert all(f"{k} {v}" in described for k, v in (o.split("=") for o in opts.split(","))
                       if k in ("pp", "dp_replicate", "dp_shard", "cp", "tp")), described
    # on 2 processes, 2 stages, 2 micro-batches (three pipelined runs): (2 - 1) / (2 + 2 - 1) of a step idle
    assert runs[2].stdout.count("bubble fraction 33.3%") == 3, runs[2].stdout


# --- checkpoints reshard; failures end the run ---------------------------------------------------------

def cli_args(data, out, *extra):
    return ["train", "--preset", "tiny-llama", "--data", str(data), "--out", str(out), "--batch-size", "4",
            "--seq-len", "32", "--lr", "1e-2", "--warmup-steps", "1", "--lr-decay-steps", "8", "--eval-iters", "2",
            "--log-interval", "1", "--eval-interval", "3", *extra]


def test_checkpoints_resume_exactly_and_reshard_from_2_to_4_processes_to_1(data, tmp_path):
    """tp 2 (2 processes) for 4 steps: the sharded AdamW state equals one process's at step 4. Resumed at the same
    layout to step 6: bit for bit the tp 2 run that never stopped. Then at dp_shard 4 (4 processes) to step 8,
    and on one process to 10: the 10 losses, every evaluation and the final weights are those of one process
    that never stopped. The model folder is a plain HF model at every step."""
    from nanoforge.cli import main
    from nanoforge.train.checkpoint import load_shards, load_state

    straight, four, straight_tp, moved = (tmp_path / n for n in ("straight", "four", "straight_tp", "moved"))
    every2 = ("--eval-interval", "2")  # every segment ends at an evaluation, as the straight runs evaluate
    # the two tp 2 runs side by side, and meanwhile the one-process runs here (none depends on another)
    launched = [launch(2, "-m", "nanoforge", *cli_args(data, out, "--max-steps", steps, "--tp", "2", *every2),
                       port=port) for (out, steps), port in zip(((straight_tp, "6"), (moved, "4")), free_ports(2))]
    try:
        assert main(cli_args(data, straight, "--max-steps", "10", *every2)) == 0
        assert main(cli_args(data, four, "--max-steps", "4", *every2)) == 0
    finally:
        runs = [finish(proc) for proc in launched]
    for run in runs:
        assert run.returncode == 0, run.stderr[-3000:]
    # The sharded optimizer state at step 4 is what one process holds there (loaded here without a process group).
    want = load_state(four)["optimizer"]
    got = {name: {k: torch.zeros_like(t) for k, t in parts.items()} for name, parts in want.items()}
    assert load_shards(moved / "dcp", {"optimizer": got}, distributed=False) == {"optimizer"}
    assert got.keys() == want.keys() and any("wqkv.q.weight" in k for k in got)
    for name in want:  # the moments are running sums of gradients: fp32 rounding of the gradients, ~1e-7
        for k in want[name]:
            torch.testing.assert_close(got[name][k], want[name][k], rtol=1e-4, atol=1e-6)
        assert got[name]["step"] == want[name]["step"] == 4
    run = torchrun(2, "-m", "nanoforge", *cli_args(data, moved, "--max-steps", "6", "--resume", "--tp", "2", *every2))
    assert run.returncode == 0, run.stderr[-3000:]
    a, b = log(moved)["history"], log(straight_tp)["history"]  # exact resume at an unchanged layout
    assert [r["loss"] for r in a["train"]] == [r["loss"] for r in b["train"]]
    assert [(r["step"], r["loss"]) for r in a["val"]] == [(r["step"], r["loss"]) for r in b["val"]]
    wa, wb = load_file(moved / "model.safetensors"), load_file(straight_tp / "model.safetensors")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    nanoforge = shutil.which("nanoforge")  # the console script, as `torchrun ... $(which nanoforge) train` runs it
    run = torchrun(4, *([nanoforge] if nanoforge else ["-m", "nanoforge"]),
                   *cli_args(data, moved, "--max-steps", "8", "--resume", "--dp-shard", "4", *every2))
    assert run.returncode == 0, run.stderr[-3000:]
    assert load_state(moved)["layout"] == "dp_shard 4" and load_state(moved)["step"] == 8
    assert main(cli_args(data, moved, "--max-steps", "10", "--resume", *every2)) == 0
    assert not (moved / "dcp").exists()  # one process writes a one-process checkpoint
    assert_same_run(moved, straight, "2 -> 4 -> 1 processes")


def spawn(rank: int, world: int, port: int, argv: list[str], log_path: Path) -> subprocess.Popen:
    """One rank as torchrun starts it (its environment), without torchrun's agent, which would stop the others
    itself when one dies: here the run's own timeouts must."""
    e = env() | {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world),
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    return subprocess.Popen([sys.executable, "-m", "nanoforge", *argv], env=e, cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=log_path.open("w"))


def timed_wait(proc: subprocess.Popen, since: float) -> tuple[int, float]:
    code = proc.wait(timeout=60)
    return code, time.time() - since


def test_a_rank_that_dies_or_hangs_ends_the_run_within_the_timeout(data, tmp_path):
    """Rank 1 is killed in one run, and stopped in another (it holds its connections but never answers) mid-run:
    rank 0 stops with one line naming the cause within --dist-timeout (5 s) of the next collective, exit code 1;
    the last checkpoint stays and resumes. The killed run starts while the hung one waits out its timeout."""
    from nanoforge.cli import main

    ranks, ended = {}, {}
    with ThreadPoolExecutor(2) as waiters:
        try:
            for how in ("hung", "killed"):
                out, port = tmp_path / how / "run", free_port()
                out.parent.mkdir()
                argv = cli_args(data, out, "--max-steps", "100000", "--eval-interval", "2", "--dp-shard", "2",
                                "--dist-timeout", "5")
                ranks[how] = [spawn(r, 2, port, argv, out.parent / f"rank{r}.err") for r in range(2)]
                deadline = time.time() + 120
                while not (out / "trainer_state.pt").exists():  # the first checkpoint (step 2): training runs
                    assert time.time() < deadline and ranks[how][0].poll() is None, \
                        (out.parent / "rank0.err").read_text()[-2000:]
                    time.sleep(0.2)
                ranks[how][1].send_signal(signal.SIGKILL if how == "killed" else signal.SIGSTOP)
                ended[how] = waiters.submit(timed_wait, ranks[how][0], time.time())
            ended = {how: future.result() for how, future in ended.items()}
        finally:
            for p in (p for run in ranks.values() for p in run):
                p.kill()
                p.wait()
    for how, (code, took) in ended.items():
        out = tmp_path / how / "run"
        err = (out.parent / "rank0.err").read_text().strip().splitlines()
        assert code == 1, (how, err[-20:])
        assert err[-1].startswith("nanoforge train: rank 0 of 2 stopped: another rank failed or did not answer "
                                  "within --dist-timeout 5 s") and "--resume" in err[-1], (how, err[-5:])
        assert "Traceback" not in "\n".join(err), how
        # a dead peer's socket closes at once; a hung one times out
        assert took < (3 if how == "killed" else 5 + 10), (how, took)
        state = torch.load(out / "trainer_state.pt", weights_only=True)
        assert state["step"] % 2 == 0 and state["step"] >= 2 and (out / "dcp").is_dir(), how
        # the last checkpoint resumes (here on one process)
        assert main(cli_args(data, out, "--max-steps", str(state["step"] + 1), "--resume")) == 0
        assert torch.load(out / "trainer_state.pt", weights_only=True)["step"] == state["step"] + 1
