"""The persistent decode kernel (kernels/decode_layers.py, serve/layer_kernel.py) against the model's own
layer-by-layer forward over the same paged cache, and the engine with it against the reference generator.

On the CPU the kernel runs under the Triton interpreter as one launch of one program (the interpreter runs
programs one after another: a second could not get past a barrier), checked bit for bit against launches of a
phase at a time by three programs; the `gpu` tests run it as one launch of a program an SM and check that it
equals the phase-at-a-time launches bit for bit, i.e. that the barriers hold.
"""

from __future__ import annotations

import random

import pytest
import torch
from conftest import interpreter
from test_serve_engine import make_model, prompts, tok  # noqa: F401  (tok: the fixture)

from nanoforge import LLM, SamplingParams
from nanoforge.errors import NanoforgeError
from nanoforge.model.config import preset
from nanoforge.model.generate import generate
from nanoforge.model.transformer import Transformer
from nanoforge.serve import layer_kernel
from nanoforge.serve.model_runner import PagedAttention

FAMILIES = ["tiny-llama", "tiny-qwen2", "tiny-qwen3"]
BLOCK = 16


def decode_case(model: Transformer, ctx: int, seed: int = 0):
    """A one-token decode step at position ctx - 1 over a paged cache of random keys and values (blocks out of
    order): the inputs `Transformer.forward` takes with the engine's backend, and the caches."""
    cfg, dev, dtype = model.cfg, model.embed.weight.device, model.embed.weight.dtype
    gen = torch.Generator(device="cpu").manual_seed(seed)
    blocks = -(-ctx // BLOCK)
    shape = (cfg.n_layers, blocks + 3, BLOCK, cfg.n_kv_heads, cfg.head_dim)
    k, v = (torch.randn(shape, generator=gen).to(dev, dtype) for _ in range(2))
    table = torch.randperm(blocks + 2, generator=gen)[:blocks + 1].to(dev, torch.int32)[None]
    pos = ctx - 1
    slot = (table[0, pos // BLOCK].long() * BLOCK + pos % BLOCK).reshape(1)
    cs = model.rope_table(ctx, dtype)[pos:pos + 1]
    rope = cs[None, :, 0:1], cs[None, :, 1:2]
    return dict(ids=torch.tensor([[int(torch.randint(cfg.vocab_size, (1,), generator=gen))]], device=dev),
                positions=torch.tensor([[pos]], device=dev), rope=rope, k=k, v=v, table=table, slot=slot,
                seq_lens=torch.tensor([ctx], device=dev, dtype=torch.int32),
                cu=torch.tensor([0, 1], device=dev, dtype=torch.int32))


def run_step(model: Transformer, case: dict, kernel) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The step's final hidden state and the caches after it (copies: each run writes the token's K and V)."""
    k, v = case["k"].clone(), case["v"].clone()
    attn = PagedAttention(k, v, case["slot"], case["table"], case["seq_lens"], case["cu"], max_q_len=1,
                          layer_kernel=kernel)
    with torch.inference_mode():
        h = model(case["ids"], case["positions"], attn, return_hidden=True, rope=case["rope"])
    return h, k, v


@interpreter
@pytest.mark.parametrize("ctx", [1, 37, 70])  # the first token; one split; three splits with full key tiles
@pytest.mark.parametrize("name", FAMILIES)
def test_layers_in_one_kernel_equal_the_layer_by_layer_forward(monkeypatch, name, ctx):
    """Every layer of a one-token decode step in the kernel (one launch of one program, interpreted) gives the
    final hidden state of the model's own forward and writes the same K and V into the same slots, fp32."""
    monkeypatch.setenv("NANOFORGE_KERNELS", "triton")
    torch.manual_seed(0)
    model = Transformer(preset(name, max_seq_len=256)).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(6.0)
    case = decode_case(model, ctx)
    want_h, want_k, want_v = run_step(model, case, None)
    before = [p.detach().clone() for p in model.parameters()]
    kernel = layer_kernel.LayerKernel(model)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # stacking keeps every value
    assert model.layers[1].mlp.w_in.weight.data_ptr() == kernel.layers.w_in[1].data_ptr()  # a view, not a copy
    got_h, got_k, got_v = run_step(model, case, kernel)
    torch.testing.assert_close(got_h, want_h, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_k, want_k, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_v, want_v, rtol=1e-5, atol=1e-5)
    assert not torch.equal(got_k, case["k"])  # the token's key was written


def kernel_inputs(model: Transformer, case: dict):
    """`decode_layers`' arguments for a case, the caches copied (each launch writes the token's K and V)."""
    cs = torch.stack((case["rope"][0].reshape(-1), case["rope"][1].reshape(-1)))
    return (model.embed(case["ids"])[0], cs, case["k"].clone(), case["v"].clone(), case["table"][0], case["seq_lens"],
            case["slot"])


@interpreter
@pytest.mark.parametrize("name,ring", [(n, "0") for n in FAMILIES] + [("tiny-llama", "4")])
def test_one_persistent_program_computes_what_a_launch_per_phase_does(monkeypatch, name, ring):
    """The persistent launch's own code (each phase's first weight tile loaded while it waits at the barrier in
    front of it, the next layer's before the last one, every barrier, the count reset at the end), interpreted
    with one program, which passes each barrier at its own arrival: bit for bit the launches per phase of three
    programs, the barrier's counts back at zero after it and none given up, twice (the second launch counts from
    zero). With NANOFORGE_DECODE_RING=4 (the weight tiles after each program's first through a pipelined loop),
    both ways equal the launches per phase without it, bit for bit."""
    from nanoforge.kernels import decode_layers as dl
    from nanoforge.kernels.dispatch import arrival_counters

    monkeypatch.setenv("NANOFORGE_KERNELS", "triton")
    torch.manual_seed(0)
    model = Transformer(preset(name, max_seq_len=256)).eval()
    case = decode_case(model, 70)
    kernel = layer_kernel.LayerKernel(model)
    with torch.inference_mode():
        args = kernel_inputs(model, case)
        want = dl.decode_layers(kernel.layers, *args, persistent=False) + (args[2],)
        monkeypatch.setenv("NANOFORGE_DECODE_RING", ring)
        if ring != "0":
            args = kernel_inputs(model, case)
            got = dl.decode_layers(kernel.layers, *args, persistent=False) + (args[2],)
            assert all(torch.equal(a, b) for a, b in zip(got, want))
        for _ in range(2):
            args = kernel_inputs(model, case)
            got = dl.decode_layers(kernel.layers, *args, persistent=True) + (args[2],)
            assert all(torch.equal(a, b) for a, b in zip(got, want))
            hkv = model.cfg.n_kv_heads
            assert arrival_counters(torch.device("cpu"), hkv + 2)[:hkv + 2].eq(0).all()
    assert dl.barrier_timeouts(torch.device("cpu")) == 0
    kernel.check(torch.device("cpu"))


@interpreter
# the launch that gave up computes garbage by design: numpy's overflow, NaN and invalid-value warnings, which vary
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # from run to run with what the buffers held
def test_a_barrier_that_waits_too_long_gives_up_counts_it_and_the_launch_ends(monkeypatch):
    """A persistent launch whose programs cannot all run at once (two programs under the interpreter, which runs
    them one after the other: the first waits at its first barrier for a second that has not started) ends: the
    first gives up after the spin limit, lifting every later barrier of the launch, the second finds them open.
    The give-up is counted once, the engine's check raises on it in one line, the counts are back at zero, and
    the next launch computes the right numbers."""
    from nanoforge.kernels import decode_layers as dl

    monkeypatch.setenv("NANOFORGE_KERNELS", "triton")
    monkeypatch.setattr(dl, "SPIN_LIMIT", 20)
    torch.manual_seed(0)
    model = Transformer(preset("tiny-llama", max_seq_len=256)).eval()
    case = decode_case(model, 37)
    kernel = layer_kernel.LayerKernel(model)
    cpu = torch.device("cpu")
    with torch.inference_mode():
        want = dl.decode_layers(kernel.layers, *kernel_inputs(model, case), persistent=False)
        dl.decode_layers(kernel.layers, *kernel_inputs(model, case), persistent=True, programs=2)
        with pytest.raises(RuntimeError, match="gave up waiting 1 time"):
            kernel.check(cpu)
        assert dl.barrier_timeouts(cpu) == 0  # the check read and reset the count
        got = dl.decode_layers(kernel.layers, *kernel_inputs(model, case), persistent=True)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert dl.barrier_timeouts(cpu) == 0


@interpreter
@pytest.mark.parametrize("name,switches", [(n, {}) for n in FAMILIES] + [
    ("tiny-qwen3", {"NANOFORGE_DECODE_PREFETCH_KV": "2"}),
    ("tiny-llama", {"NANOFORGE_DECODE_RING_AHEAD": "0", "NANOFORGE_DECODE_RING": "3"}),
    ("tiny-qwen3", {"NANOFORGE_DECODE_RING_AHEAD": "0", "NANOFORGE_DECODE_RING": "2"}),
    ("tiny-qwen2", {"NANOFORGE_DECODE_RING": "3"}),
    ("tiny-qwen3", {"NANOFORGE_DECODE_RING": "2", "NANOFORGE_DECODE_RING_ON": "qkv,gate_up"})])
def test_tagged_vectors_without_barriers_compute_what_a_launch_per_phase_does(monkeypatch, name, switches):
    """NANOFORGE_DECODE_SYNC=tagged, bf16: the persistent launch with no barrier (each phase's vector stored as
    words carrying the launch's tag, polled by the phases that read it; the residual stream in every program's
    registers), interpreted with one program, which wrote each word before it reads it: bit for bit the launches
    per phase, three times over. Each launch takes the next tag (its count), the attention splits' own counts
    stay multiples of the split count (never reset), the shared arrival counts are untouched and no word was
    stale. With the attention phase's context asked of L2 after phase A (where the wait for A's words can hide
    it; on a GPU only), the same bits; with the weights through a ring (NANOFORGE_DECODE_RING: every tile of its
    projections, the input polled in the pipelined loop's first pass, on all four and on two with the other two
    through registers, so that a wrong layer's or projection's tile, or a residual taken twice, would show), too;
    and with NANOFORGE_DECODE_RING_AHEAD=0 (the first tile from registers, the rest a pipelined loop), too."""
    from nanoforge.kernels import decode_layers as dl
    from nanoforge.kernels.dispatch import arrival_counters

    monkeypatch.setenv("NANOFORGE_KERNELS", "triton")
    torch.manual_seed(0)
    model = Transformer(preset(name, max_seq_len=256)).eval().bfloat16()
    case = decode_case(model, 70)
    kernel = layer_kernel.LayerKernel(model)
    hkv, cpu = model.cfg.n_kv_heads, torch.device("cpu")
    with torch.inference_mode():
        args = kernel_inputs(model, case)
        want = dl.decode_layers(kernel.layers, *args, persistent=False) + (args[2],)
        monkeypatch.setenv("NANOFORGE_DECODE_SYNC", "tagged")
        for key, value in switches.items():
            monkeypatch.setenv(key, value)
        for launch in range(1, 4):
            args = kernel_inputs(model, case)
            got = dl.decode_layers(kernel.layers, *args, persistent=True) + (args[2],)
            assert all(torch.equal(a, b) for a, b in zip(got, want))
            (tags, _, counts), = kernel.layers.tagged.values()
            assert counts.tolist() == [launch * model.cfg.n_layers * dl.INTERPRET_SPLITS] * hkv + [launch, 0]
            assert arrival_counters(cpu, hkv + 2)[:hkv + 2].eq(0).all()
            words = tags.view(model.cfg.n_layers, -1)
            assert torch.equal(words >> 16, torch.full_like(words, launch))  # every word this launch's (tags 1, 2, ...)
    assert dl.barrier_timeouts(cpu) == 0


@interpreter
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # (the launch that read stale words computes garbage)
def test_a_tagged_launch_whose_words_never_come_counts_them_and_ends(monkeypatch):
    """Tagged, two programs under the interpreter, which runs them one after the other: the first finds the
    words the second has not written yet stale, counts them and goes on (on a GPU after the spin limit) instead
    of waiting forever; the engine's check raises in one line, and the next launch computes the right numbers."""
    from nanoforge.kernels import decode_layers as dl

    monkeypatch.setenv("NANOFORGE_KERNELS", "triton")
    torch.manual_seed(0)
    model = Transformer(preset("tiny-qwen3", max_seq_len=256)).eval().bfloat16()
    case = decode_case(model, 37)
    kernel = layer_kernel.LayerKernel(model)
    cpu = torch.device("cpu")
    with torch.inference_mode():
        want = dl.decode_layers(kernel.layers, *kernel_inputs(model, case), persistent=False)
        monkeypatch.setenv("NANOFORGE_DECODE_SYNC", "tagged")
        dl.decode_layers(kernel.layers, *kernel_inputs(model, case), persistent=True, programs=2)
        with pytest.raises(RuntimeError, match="gave up waiting [0-9]+ time"):
            kernel.check(cpu)
        got = dl.decode_layers(kernel.layers, *kernel_inputs(model, case), persistent=True)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert dl.barrier_timeouts(cpu) == 0


def test_the_ring_is_off_or_two_to_six_stages(monkeypatch):
    """NANOFORGE_DECODE_RING: 0 (registers) or a ring of 2 to 6 stages; anything else is one line naming it (a ring
    of one stage would hold no tile in flight)."""
    from nanoforge.kernels import decode_layers as dl

    for value, want in (("0", 0), ("2", 2), ("6", 6)):
        monkeypatch.setenv("NANOFORGE_DECODE_RING", value)
        assert dl.ring_stages() == want
    for value in ("1", "7", "four"):
        monkeypatch.setenv("NANOFORGE_DECODE_RING", value)
        with pytest.raises(NanoforgeError, match="NANOFORGE_DECODE_RING"):
            dl.ring_stages()


def test_the_ring_serves_the_projections_it_is_set_on(monkeypatch):
    """NANOFORGE_DECODE_RING_ON: every projection (unset, `all`) or a comma-separated set of them, each of the
    kernel's four rings the ring's stages where it is on and 0 elsewhere; `ring_on` overrides the environment;
    anything else is one line naming the setting and the projections."""
    from nanoforge.kernels import decode_layers as dl

    monkeypatch.setenv("NANOFORGE_DECODE_RING", "3")
    assert dl.ring_constants() == {"RING_QKV": 3, "RING_O": 3, "RING_IN": 3, "RING_OUT": 3}
    monkeypatch.setenv("NANOFORGE_DECODE_RING_ON", "QKV, gate_up")
    assert dl.ring_constants() == {"RING_QKV": 3, "RING_O": 0, "RING_IN": 3, "RING_OUT": 0}
    assert dl.ring_constants(4, "down") == {"RING_QKV": 0, "RING_O": 0, "RING_IN": 0, "RING_OUT": 4}
    monkeypatch.delenv("NANOFORGE_DECODE_RING")
    assert set(dl.ring_constants().values()) == {0}
    for value in ("gate", "qkv,", "", "all,o"):
        monkeypatch.setenv("NANOFORGE_DECODE_RING_ON", value)
        with pytest.raises(NanoforgeError, match="NANOFORGE_DECODE_RING_ON must be all or a comma-separated set of "
                                                 "qkv, o, gate_up, down"):
            dl.ring_constants()


def test_a_poll_takes_as_many_words_a_thread_as_every_layout_gives_it(monkeypatch):
    """The tagged poll's PTX: `pack` words a thread, each reloaded (predicated, all in flight) only while stale,
    the loop's branch not claimed uniform (a warp's threads leave it apart), an optional back-off between rounds
    (NANOFORGE_DECODE_POLL_SLEEP_NS, doubling up to NANOFORGE_DECODE_POLL_SLEEP_CAP_NS: one argument, the cap in
    its high 16 bits); its width a power of two that
    divides the words any layout of a vector gives each of 256 threads (at least width / 256: 4 from 1,024), at
    most 16 (Llama-3.2-1B's 8,192 gate-and-up words take two loops)."""
    from nanoforge.kernels import decode_layers as dl

    widths = (64, 512, 1024, 2048, 4096, 8192, 16384)
    assert [dl.poll_pack(w) for w in widths] == [1, 2, 4, 8, 16, 16, 16]
    for n in dl.POLL_PACKS:
        ptx = dl.poll_tags_ptx(n)
        assert ptx.count("ld.relaxed.gpu.global.u32") == n and ptx.count("setp.ne.u32") == n + 1
        assert f"${n - 1}, [${2 * n - 1}]" in ptx and f"mov.b32 $0, ${2 * n};" in ptx  # (outputs, addresses, words)
        assert "bra.uni" not in ptx and dl.poll_constraints(n).count(",") == 6 * n - 1
        assert f"and.b32 nfZ, ${5 * n}, 65535;" in ptx and "@nfAny nanosleep.u32 nfZ;" in ptx  # (the back-off,
        assert f"shr.u32 nfC, ${5 * n}, 16;" in ptx and "min.u32 nfZ, nfZ, nfC;" in ptx  # when > 0; its cap)
    assert dl.poll_sleep_arg() == 256 | 512 << 16  # (the defaults)
    monkeypatch.setenv("NANOFORGE_DECODE_POLL_SLEEP_NS", "4096")
    monkeypatch.setenv("NANOFORGE_DECODE_POLL_SLEEP_CAP_NS", "16384")
    assert dl.poll_sleep_arg() == 4096 | 16384 << 16 and dl.poll_sleep_arg() < 2 ** 31  # (an int32 argument)
    monkeypatch.setenv("NANOFORGE_DECODE_POLL_SLEEP_CAP_NS", "20000")
    with pytest.raises(NanoforgeError, match="NANOFORGE_DECODE_POLL_SLEEP_CAP_NS must be a whole number from 0 to "
                                             "16384"):
        dl.poll_sleep_arg()


@pytest.mark.gpu
def test_gpu_a_barrier_that_waits_too_long_gives_up_counts_it_and_the_launch_ends(monkeypatch):
    """A plain (not cooperative) persistent launch of one program more than an SM's threads allow resident at
    once, whatever its registers: the last program cannot start until another ends, so the others give up at the
    first barrier after the spin limit (each counting it) and lift the rest; the launch ends, and the next one,
    of a program an SM, computes what the launches per phase do with none given up. The count is read for
    `cuda`, the launches ran on `cuda:0`: the same device (session 32's run read another key and saw 0)."""
    from nanoforge.kernels import decode_layers as dl

    monkeypatch.setenv("NANOFORGE_DECODE_SYNC", "barrier")  # (tagged launches are the default)

    monkeypatch.setenv("NANOFORGE_DECODE_COOPERATIVE", "0")
    monkeypatch.setattr(dl, "SPIN_LIMIT", 4000)
    torch.manual_seed(0)
    model = Transformer(preset("llama3-1b", n_layers=2, max_seq_len=512)).cuda().bfloat16().eval()
    case = decode_case(model, 300)
    kernel = layer_kernel.LayerKernel(model)
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    resident = props.multi_processor_count * (props.max_threads_per_multi_processor // (32 * dl.WARPS))
    with torch.inference_mode():
        want = dl.decode_layers(kernel.layers, *kernel_inputs(model, case), persistent=False)
        dl.decode_layers(kernel.layers, *kernel_inputs(model, case), persistent=True, programs=resident + 1)
        torch.cuda.synchronize()
        assert dl.barrier_timeouts(dev) >= 1
        got = dl.decode_layers(kernel.layers, *kernel_inputs(model, case), persistent=True)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert dl.barrier_timeouts(dev) == 0


@interpreter
@pytest.mark.parametrize("name", FAMILIES)
def test_engine_with_layers_in_one_kernel_decodes_the_reference_tokens(tok, monkeypatch, name):
    """NANOFORGE_DECODE_LAYERS=persistent: the engine's one-token decode steps run the kernel (interpreted),
    batches of several and prefills the layers one by one; greedy and seeded rows give the reference
    generator's tokens."""
    monkeypatch.setenv("NANOFORGE_DECODE_LAYERS", "persistent")
    model = make_model(tok, name)
    ps = prompts(2, random.Random(3), 5, 20)
    want = [generate(model, p, max_new_tokens=6) for p in ps] + \
        [generate(model, ps[0], max_new_tokens=6, temperature=0.8, seed=5)]
    shared = ps[1][:12] + prompts(1, random.Random(4), 5, 5)[0]  # a prefix hit on ps[1]'s cached blocks
    want_shared = generate(model, shared, max_new_tokens=6)
    monkeypatch.setenv("NANOFORGE_KERNELS", "triton")
    calls = []
    real = layer_kernel.decode_layers
    monkeypatch.setattr(layer_kernel, "decode_layers", lambda *a, **k: calls.append(1) or real(*a, **k))
    llm = LLM(model, tok, num_gpu_blocks=40, block_size=4)
    assert llm.engine.runner.layer_kernel is not None
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    got = [llm.generate([p], greedy)[0].outputs[0].token_ids for p in ps]  # one sequence: the kernel's steps
    seeded = SamplingParams(temperature=0.8, max_tokens=6, seed=5, ignore_eos=True)
    got.append(llm.generate([ps[0]], seeded)[0].outputs[0].token_ids)
    assert got == want
    assert len(calls) == 3 * 5  # every decode step of the three requests (the first token is the prefill's)
    assert llm.generate([shared], greedy)[0].outputs[0].token_ids == want_shared
    assert llm.engine.stats()["prefix_cache_hit_rate"] > 0


@interpreter
def test_engine_with_tagged_vectors_decodes_what_it_does_with_barriers(tok, monkeypatch):
    """NANOFORGE_DECODE_SYNC=tagged in the engine (bf16, interpreted): every one-token decode step a tagged launch
    (the launch count, which gives each its tag, advances once a step), the tokens those with barriers give,
    greedy and seeded."""
    monkeypatch.setenv("NANOFORGE_DECODE_LAYERS", "persistent")
    monkeypatch.setenv("NANOFORGE_KERNELS", "triton")
    model = make_model(tok, "tiny-qwen3").bfloat16()
    def check(sync, runner):
        tagged = runner.layer_kernel.layers.tagged
        if sync == "tagged":
            (_, _, counts), = tagged.values()
            assert counts[model.cfg.n_kv_heads].item() == 1 + 3 * 5  # the warm-up's, then one a decode step
        else:
            assert not tagged

    out = tokens_both_ways(monkeypatch, lambda: LLM(model, tok, num_gpu_blocks=40, block_size=4),
                           prompts(2, random.Random(5), 5, 20), 6, check, together=False)
    assert out["tagged"] == out["barrier"]


def tokens_both_ways(monkeypatch, make_llm, ps: list, max_tokens: int, check, *, together: bool) -> dict:
    """An engine's tokens with NANOFORGE_DECODE_SYNC=barrier and =tagged (a fresh engine each, `make_llm`): each
    prompt alone greedy, the first seeded, and (`together`) all at once greedy; `check(sync, runner)` after each."""
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    seeded = SamplingParams(temperature=0.8, max_tokens=max_tokens, seed=5, ignore_eos=True)
    out = {}
    for sync in ("barrier", "tagged"):
        monkeypatch.setenv("NANOFORGE_DECODE_SYNC", sync)
        llm = make_llm()
        out[sync] = [llm.generate([p], greedy)[0].outputs[0].token_ids for p in ps]
        out[sync].append(llm.generate([ps[0]], seeded)[0].outputs[0].token_ids)
        if together:
            out[sync].append([o.outputs[0].token_ids for o in llm.generate(ps, greedy)])
        check(sync, llm.engine.runner)
        del llm
    return out


def forced_timings(monkeypatch, winner: str | None, seen: list, captured: dict) -> None:
    """The engine's decode-layers choice (`replays_us` in model_runner) timed for real, then told `winner` won
    (None: as timed); `captured` maps each batch-1 decode graph's replay to the way it was captured with."""
    from nanoforge.serve import model_runner

    real, capture = model_runner.replays_us, model_runner.ModelRunner._capture

    def timed(runs, *a, **k):
        us = real(runs, *a, **k)
        seen.append(us)
        return us if winner is None else {name: (1.0 if name == winner else 2.0) for name in us}

    def recorded(self, layout, *, decode):
        replay = capture(self, layout, decode=decode)
        if decode and layout.t == 1:
            k = self.layer_kernel
            captured[replay] = ("kernels" if k is None else "persistent" if k.ring is None
                                else next(w for w, (_, r) in layer_kernel.WAYS.items() if r == k.ring))
        return replay

    monkeypatch.setattr(model_runner, "replays_us", timed)
    monkeypatch.setattr(model_runner.ModelRunner, "_capture", recorded)


@interpreter
@pytest.mark.parametrize("winner", list(layer_kernel.WAYS))
def test_auto_keeps_the_faster_way_of_a_decode_step_and_decodes_the_reference_tokens(tok, monkeypatch, winner):
    """NANOFORGE_DECODE_LAYERS=auto: the engine runs its one-token decode step each way once at its start (the
    kernel, the kernel with its weights through a ring, layer by layer; each timed, here told which won) and its
    decode steps take the winner's way: the kernel (with the ring or not) for every decode step of one
    sequence, or never; either way the reference generator's tokens, greedy and seeded."""
    monkeypatch.setenv("NANOFORGE_DECODE_LAYERS", "auto")
    model = make_model(tok, "tiny-qwen3")
    ps = prompts(2, random.Random(3), 5, 20)
    want = [generate(model, p, max_new_tokens=6) for p in ps] + \
        [generate(model, ps[0], max_new_tokens=6, temperature=0.8, seed=5)]
    monkeypatch.setenv("NANOFORGE_KERNELS", "triton")
    seen, calls, captured = [], [], {}
    forced_timings(monkeypatch, winner, seen, captured)
    real = layer_kernel.decode_layers
    rings = []
    monkeypatch.setattr(layer_kernel, "decode_layers",
                        lambda *a, **k: calls.append(1) or rings.append((k["ring"], k["ring_on"])) or real(*a, **k))
    llm = LLM(model, tok, num_gpu_blocks=40, block_size=4)
    runner = llm.engine.runner
    assert len(seen) == 1 and set(seen[0]) == set(layer_kernel.WAYS) and min(seen[0].values()) > 0
    assert runner.decode_layers == {"chosen": winner, **{f"{w}_us": 1.0 if w == winner else 2.0
                                                         for w in layer_kernel.WAYS}, "tagged": False}
    from nanoforge.serve.api.app import start_line  # what the server's first line says of it

    us = {w: 1 if w == winner else 2 for w in layer_kernel.WAYS}
    assert start_line(llm.engine).endswith(
        f"; batch-1 decode layers: {winner} (persistent kernel {us['persistent']} us, with a 3-stage weight ring "
        f"{us['persistent_ring3']} us, with it on gate-and-up alone {us['persistent_ring3_gate_up']} us, kernel by "
        f"kernel {us['kernels']} us)")
    assert (runner.layer_kernel is not None) == (winner != "kernels")
    assert sorted(captured.values()) == sorted(layer_kernel.WAYS)  # each way run at the start, once
    assert layer_kernel.describe({**runner.decode_layers, "tagged": True}).startswith(
        f"{winner} (persistent kernel with tagged vectors ")
    at_start = len(calls)
    assert at_start == 6  # each persistent way's capture (a warm-up), then their timed runs (the CPU's: eager)
    none, every, gate_up = (None, None), (3, "all"), (3, "gate_up")
    assert rings == [none, every, gate_up, none, every, gate_up]
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    got = [llm.generate([p], greedy)[0].outputs[0].token_ids for p in ps]
    got.append(llm.generate([ps[0]], SamplingParams(temperature=0.8, max_tokens=6, seed=5, ignore_eos=True))[0]
               .outputs[0].token_ids)
    assert got == want
    assert len(calls) - at_start == (3 * 5 if winner != "kernels" else 0)
    assert set(rings[at_start:]) <= {layer_kernel.WAYS[winner][1] or none}


def test_layer_kernel_is_only_taken_where_it_applies(tok, monkeypatch):
    """GPT-2 (LayerNorm, learned positions, biases) keeps its layers; the default leaves every model alone on
    the CPU and times the kernel on a GPU (`auto`); a bad setting is one line naming it."""
    monkeypatch.setenv("NANOFORGE_KERNELS", "triton")
    assert not layer_kernel.supported(make_model(tok, "tiny-gpt2"))
    assert layer_kernel.supported(make_model(tok, "tiny-qwen3")) == layer_kernel.use_fast(torch.zeros(1))
    monkeypatch.setenv("NANOFORGE_KERNELS", "torch")
    assert not layer_kernel.supported(make_model(tok, "tiny-llama"))  # the reference kernels: nothing to fuse
    monkeypatch.delenv("NANOFORGE_DECODE_LAYERS", raising=False)
    assert layer_kernel.mode() == "kernels" and layer_kernel.mode(torch.device("cpu")) == "kernels"
    assert layer_kernel.mode(torch.device("cuda")) == "auto"  # (a GPU's default)
    monkeypatch.setenv("NANOFORGE_DECODE_LAYERS", "fused")
    with pytest.raises(NanoforgeError,
                       match="NANOFORGE_DECODE_LAYERS must be kernels, persistent or auto, not 'fused'"):
        layer_kernel.mode()


def test_counts_a_capture_uses_are_made_eagerly_never_inside_it(monkeypatch):
    """The arrival counts (the persistent kernel's barriers, split-K's, split attention's) of a launch inside a
    CUDA graph capture are the device's buffer for graphs, made by an eager launch before: never made inside the
    capture, where they would come from the graph's memory pool and outlive it (session 26: the GPU engine test's
    second model decoded wrong tokens, its kernel counting inside memory its first model's graphs had freed).
    Captures are stood in for on the CPU; the GPU engine test runs the families one after another in one process."""
    from nanoforge.kernels import decode_layers as dl
    from nanoforge.kernels import dispatch

    cpu = torch.device("cpu")
    monkeypatch.setattr(dispatch, "_COUNTERS", {})
    monkeypatch.setattr(dispatch, "_KEPT", [])
    monkeypatch.setattr(dl, "_TIMEOUTS", {})
    for capture in (True, False):
        monkeypatch.setattr(dispatch, "capturing", lambda d, c=capture: c)
        monkeypatch.setattr(dl, "capturing", lambda d, c=capture: c)
        if capture:  # nothing made yet: a capture may not make it
            with pytest.raises(RuntimeError, match="first asked for inside a CUDA graph capture"):
                dispatch.arrival_counters(cpu, 8)
            with pytest.raises(RuntimeError, match="first launched inside a CUDA graph capture"):
                dl._timeouts(cpu)
    eager = dispatch.arrival_counters(cpu, 8)
    dl._timeouts(cpu)
    monkeypatch.setattr(dispatch, "capturing", lambda d: True)
    monkeypatch.setattr(dl, "capturing", lambda d: True)
    captured = dispatch.arrival_counters(cpu, 8)
    assert captured is not eager and not captured.any() and captured is dispatch.arrival_counters(cpu, 4096)
    assert dl._timeouts(cpu) is dl._TIMEOUTS["cpu"]
    with pytest.raises(RuntimeError, match="5000 counts"):  # more than any eager launch asked for
        dispatch.arrival_counters(cpu, 5000)
    monkeypatch.setattr(dispatch, "capturing", lambda d: False)
    dispatch.arrival_counters(cpu, 5000)  # an eager launch grows both
    monkeypatch.setattr(dispatch, "capturing", lambda d: True)
    assert dispatch.arrival_counters(cpu, 5000).numel() == 5000 and len(dispatch._KEPT) == 4


@pytest.mark.gpu
def test_gpu_counts_a_capture_uses_come_from_outside_its_pool(monkeypatch):
    """In a real capture: the counts a captured launch gets are the buffer an eager launch made for graphs."""
    from nanoforge.kernels import dispatch

    monkeypatch.setattr(dispatch, "_COUNTERS", {})
    dev = torch.zeros(1, device="cuda").device
    eager = dispatch.arrival_counters(dev, 8)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = dispatch.arrival_counters(dev, 8)
    assert captured is dispatch._COUNTERS[(str(dev), "graphs")] and captured.data_ptr() != eager.data_ptr()


# ------------------------------------------------------------------------------------------------------------
# GPU: one launch with grid-wide barriers
# ------------------------------------------------------------------------------------------------------------

GPU_SHAPES = {  # two layers at the real widths of the models issue 14 measures, and Qwen2's biases
    "llama3-1b": dict(n_layers=2), "qwen3-0.6b": dict(n_layers=2), "qwen2-0.5b": dict(n_layers=2),
}


@pytest.mark.gpu
@pytest.mark.parametrize("ctx", [1, 300, 3000])
@pytest.mark.parametrize("name", list(GPU_SHAPES))
def test_gpu_one_launch_equals_a_launch_per_phase_and_the_layer_by_layer_forward(name, ctx, monkeypatch):
    """bf16 at full width: the persistent launch (barriers between phases; cooperative, then plain; with one
    thread a program polling at the barriers, every thread, or thread 0 doing the whole barrier; with phase B's
    context asked of L2 ahead; its weights through a 4-stage ring in shared memory;
    traced) gives exactly the phase-at-a-time
    launches' result (the same code and order of sums: any difference is a barrier that did not hold), and both
    stay within bf16 rounding of the layer-by-layer forward (cuBLAS / the skinny matmul, paged attention). The
    traced launch's phase B parts add up to its work."""
    from nanoforge.kernels import decode_layers as dl

    monkeypatch.setenv("NANOFORGE_DECODE_SYNC", "barrier")  # (tagged launches are the default)

    torch.manual_seed(0)
    model = Transformer(preset(name, **GPU_SHAPES[name], max_seq_len=4096)).cuda().bfloat16().eval()
    case = decode_case(model, ctx)
    want_h, want_k, _ = run_step(model, case, None)
    kernel = layer_kernel.LayerKernel(model)
    got_h, got_k, _ = run_step(model, case, kernel)
    x = model.embed(case["ids"])[0]
    cs = case["rope"][0].reshape(-1), case["rope"][1].reshape(-1)
    outs = []
    programs = torch.cuda.get_device_properties(x.device).multi_processor_count
    trace = torch.zeros(dl.trace_rows(model.cfg.n_layers), programs, dtype=torch.int64, device=x.device)
    # (each switch set is one more kernel compiled for each shape, beside the default's six, the launches per phase
    # being five)
    launches = [(True, {}), (False, {}), (True, {"NANOFORGE_DECODE_COOPERATIVE": "0"}),  # the count starts again
                (True, {"NANOFORGE_DECODE_PREFETCH_KV": "2"}),
                (True, {"NANOFORGE_DECODE_RING": "4"}),
                (True, {"NANOFORGE_DECODE_PREFETCH_KV": "1", "trace": trace})]
    for persistent, env in launches:
        with monkeypatch.context() as m:
            for key, value in env.items():
                if key != "trace":
                    m.setenv(key, value)
            k, v = case["k"].clone(), case["v"].clone()
            outs.append(dl.decode_layers(kernel.layers, x, torch.stack(cs), k, v, case["table"][0], case["seq_lens"],
                                         case["slot"], persistent=persistent, trace=env.get("trace")) + (k,))
    for got in outs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(outs[0], got))
    assert dl.barrier_timeouts(x.device) == 0
    steps = dl.PHASES * model.cfg.n_layers  # each layer's phase B marks lie between its barriers A and B
    marks = trace[1 + 2 * steps:].view(model.cfg.n_layers, dl.B_MARKS, programs)
    for i in range(model.cfg.n_layers):
        left_a, reached_b = trace[2 + 2 * (dl.PHASES * i)], trace[1 + 2 * (dl.PHASES * i + 1)]
        got = marks[i][:, :min(programs, model.cfg.n_kv_heads * dl.CONTEXT_SPLITS)]  # the programs with an item
        assert bool((got >= left_a.min()).all() and (got <= reached_b.max()).all()), (i, got, left_a, reached_b)
    err = (got_h.float() - want_h.float()).abs().max().item()
    assert err < 0.05 * want_h.float().abs().max().item(), err
    assert (got_k.float() - want_k.float()).abs().max().item() < 0.1


@pytest.mark.gpu
@pytest.mark.parametrize("ctx", [1, 300, 3000])
@pytest.mark.parametrize("name", list(GPU_SHAPES))
def test_gpu_tagged_vectors_without_barriers_equal_a_launch_per_phase(name, ctx, monkeypatch):
    """NANOFORGE_DECODE_SYNC=tagged, bf16 at full width, a program an SM: the persistent launch with no barrier
    (cooperative, then plain, then without the polls' back-off, then the weights through a ring, on every
    projection and on gate-and-up alone, each with its first stages copied before the poll (the default) and
    not (NANOFORGE_DECODE_RING_AHEAD=0), then traced), three
    launches in a row and three replays of a CUDA graph of it (each its own tag, read from the launch count on
    the GPU), every one bit for bit the launches per phase (the same sums in the same order: any difference is a
    word read before it was written, or an old one taken for new), none stale. The traced launch's clocks run in
    each program's order: its start, then each phase's last store and the next one's poll, phase B's marks
    between its poll and its last store."""
    from nanoforge.kernels import decode_layers as dl

    torch.manual_seed(0)
    model = Transformer(preset(name, **GPU_SHAPES[name], max_seq_len=4096)).cuda().bfloat16().eval()
    case = decode_case(model, ctx)
    kernel = layer_kernel.LayerKernel(model)
    x = model.embed(case["ids"])[0]
    cs = torch.stack((case["rope"][0].reshape(-1), case["rope"][1].reshape(-1)))

    def launch(persistent=True, trace=None):
        k, v = case["k"].clone(), case["v"].clone()
        return dl.decode_layers(kernel.layers, x, cs, k, v, case["table"][0], case["seq_lens"], case["slot"],
                                persistent=persistent, trace=trace) + (k, v)

    n_layers = model.cfg.n_layers
    programs = torch.cuda.get_device_properties(x.device).multi_processor_count
    trace = torch.zeros(dl.trace_rows(n_layers), programs, dtype=torch.int64, device=x.device)

    with torch.inference_mode():
        want = launch(persistent=False)
        monkeypatch.setenv("NANOFORGE_DECODE_SYNC", "tagged")
        outs = [launch() for _ in range(3)]
        with monkeypatch.context() as m:
            m.setenv("NANOFORGE_DECODE_COOPERATIVE", "0")
            outs.append(launch())
        with monkeypatch.context() as m:  # no back-off (a runtime argument: the same kernel)
            m.setenv("NANOFORGE_DECODE_POLL_SLEEP_NS", "0")
            outs.append(launch())
        with monkeypatch.context() as m:  # the weights through a 4-stage ring, then gate-and-up's alone
            m.setenv("NANOFORGE_DECODE_RING", "4")
            outs.append(launch())
            m.setenv("NANOFORGE_DECODE_RING_ON", "gate_up")
            outs.append(launch())
            m.setenv("NANOFORGE_DECODE_RING_AHEAD", "0")  # the first tile in registers, the ring after the poll:
            outs.append(launch())
            m.setenv("NANOFORGE_DECODE_RING_ON", "all")  # gate-and-up's, then every projection's
            outs.append(launch())
        outs.append(launch(trace=trace))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = launch()
        for _ in range(3):
            graph.replay()
            outs.append(tuple(t.clone() for t in captured))
    for got in outs:
        assert all(torch.equal(a, b) for a, b in zip(want, got))
    assert dl.barrier_timeouts(x.device) == 0
    (_, _, counts), = kernel.layers.tagged.values()
    assert counts[model.cfg.n_kv_heads].item() == 13  # launches (a capture launches nothing)
    steps = dl.PHASES * n_layers
    clocks = trace[:1 + 2 * steps]  # start, then each step's last store ("arrival") and the next poll ("departure")
    assert bool((clocks > 0).all()) and bool((clocks[1:] >= clocks[:-1]).all())
    marks = trace[1 + 2 * steps:].view(n_layers, dl.B_MARKS, programs)
    busy = min(programs, model.cfg.n_kv_heads * dl.CONTEXT_SPLITS)  # the programs with an attention item
    for i in range(n_layers):
        polled, stored = trace[2 + 2 * dl.PHASES * i, :busy], trace[3 + 2 * dl.PHASES * i, :busy]
        assert bool(((marks[i, :, :busy] >= polled) & (marks[i, :, :busy] <= stored)).all()), i


@pytest.mark.gpu
@pytest.mark.parametrize("name", FAMILIES)
def test_gpu_engine_with_tagged_vectors_decodes_what_it_does_with_barriers(tok, monkeypatch, name):
    """NANOFORGE_DECODE_LAYERS=persistent in bf16 (tagged words hold 16-bit values): the engine's batch-1 decode
    graph replayed with NANOFORGE_DECODE_SYNC=tagged decodes exactly the tokens it decodes with barriers (the same
    sums in the same order), greedy and seeded, one sequence at a time and then several at once."""
    monkeypatch.setenv("NANOFORGE_DECODE_LAYERS", "persistent")
    model = make_model(tok, name).cuda().bfloat16()

    def check(sync, runner):
        assert runner.graph_replays.get((True, 1), 0) > 40  # the batch-1 graph decoded them
        assert bool(runner.layer_kernel.layers.tagged) == (sync == "tagged")  # (its buffers: tagged launches ran)

    out = tokens_both_ways(monkeypatch, lambda: LLM(model, tok, num_gpu_blocks=48, max_num_seqs=4),
                           prompts(4, random.Random(13), 3, 40), 24, check, together=True)
    assert out["tagged"] == out["barrier"]


@pytest.mark.gpu
@pytest.mark.parametrize("name", FAMILIES)
def test_gpu_engine_with_layers_in_one_kernel_decodes_the_reference_tokens(tok, monkeypatch, name):
    """NANOFORGE_DECODE_LAYERS=persistent on the GPU: one sequence at a time (its decode steps the one-launch
    kernel, replayed from the batch-1 CUDA graph), fp32, greedy and seeded: the reference generator's tokens;
    then several at once (steps of more rows take the layers one by one) with preemption and prefix hits."""
    monkeypatch.setenv("NANOFORGE_DECODE_LAYERS", "persistent")
    model = make_model(tok, name).cuda()
    rng = random.Random(7)
    shared = prompts(1, rng, 40, 40)[0]
    ps = [shared + p if i % 2 else p for i, p in enumerate(prompts(8, rng, 3, 50))]
    want = [generate(model, p, max_new_tokens=24) for p in ps]
    seeded = SamplingParams(temperature=0.8, max_tokens=24, seed=5, ignore_eos=True)
    want_seeded = generate(model, ps[0], max_new_tokens=24, temperature=0.8, seed=5)
    llm = LLM(model, tok, num_gpu_blocks=48, max_num_seqs=4)
    runner = llm.engine.runner
    assert runner.layer_kernel is not None
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    assert [llm.generate([p], greedy)[0].outputs[0].token_ids for p in ps[:3]] == want[:3]
    assert llm.generate([ps[0]], seeded)[0].outputs[0].token_ids == want_seeded
    assert runner.graph_replays.get((True, 1), 0) > 60  # the batch-1 decode graph ran the kernel
    assert [o.outputs[0].token_ids for o in llm.generate(ps, greedy)] == want


@pytest.mark.gpu
@pytest.mark.parametrize("name,winner", [(n, None) for n in FAMILIES] + [("tiny-qwen3", w) for w in layer_kernel.WAYS])
def test_gpu_auto_keeps_the_faster_graph_of_a_decode_step_and_decodes_the_reference_tokens(tok, monkeypatch, name,
                                                                                            winner):
    """NANOFORGE_DECODE_LAYERS=auto (unset: a GPU's default) on the GPU: the batch-1 decode graph captured each
    way (`layer_kernel.WAYS`) and timed (each time real and positive), the kept graph the one captured the
    winner's way (as timed; or told), and the engine then decodes the reference generator's tokens, greedy and
    seeded, one sequence and several."""
    monkeypatch.delenv("NANOFORGE_DECODE_LAYERS", raising=False)
    model = make_model(tok, name).cuda()
    ps = prompts(4, random.Random(11), 3, 40)
    want = [generate(model, p, max_new_tokens=16) for p in ps]
    want_seeded = generate(model, ps[0], max_new_tokens=16, temperature=0.8, seed=5)
    seen, captured = [], {}
    forced_timings(monkeypatch, winner, seen, captured)
    llm = LLM(model, tok, num_gpu_blocks=48, max_num_seqs=4)
    runner = llm.engine.runner
    assert len(seen) == 1 and all(0 < us < 1e5 for us in seen[0].values()), seen
    chosen = runner.decode_layers["chosen"]
    assert chosen == (winner or min(seen[0], key=seen[0].get))
    assert sorted(captured.values()) == sorted(layer_kernel.WAYS)
    assert captured[runner.graphs[(True, 1)]] == chosen
    assert (runner.layer_kernel is not None) == (chosen != "kernels")
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    assert [llm.generate([p], greedy)[0].outputs[0].token_ids for p in ps[:2]] == want[:2]
    seeded = SamplingParams(temperature=0.8, max_tokens=16, seed=5, ignore_eos=True)
    assert llm.generate([ps[0]], seeded)[0].outputs[0].token_ids == want_seeded
    assert runner.graph_replays.get((True, 1), 0) >= 40  # the kept batch-1 graph decoded them
    assert [o.outputs[0].token_ids for o in llm.generate(ps, greedy)] == want


@interpreter
def test_decode_layers_benchmark_smoke_runs_both_ways_to_the_same_state(tmp_path):
    """`benchmarks/decode_layers.py --smoke`: the CPU dry run of the benchmark, both ways on tiny presets, the
    JSON written with the two ways' final hidden states equal, at the kernel's split count, at others and under
    the switch variants (which the interpreter runs as the default: it runs no PTX); a variant it cannot read
    is one line, exit 2."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "decode_layers.py"
    subprocess.run([sys.executable, str(script), "--smoke", "--splits", "1,2", "--variants",
                    "prefetch_kv1+tagged,ring2+ring_ahead", "--out", str(tmp_path)], check=True, capture_output=True)
    rows = json.loads((tmp_path / "decode_layers.json").read_text())
    assert set(rows) == {"tiny-llama", "tiny-qwen3"}
    assert all(r["max_abs_difference"] < 1e-4 and r["bytes"] > 0 and r["barrier_timeouts"] == 0 for r in rows.values())
    assert all(set(r["splits"]) == {"1", "2"} and all(s["max_abs_difference"] < 1e-4 and "one_kernel_us" in s
                                                     for s in r["splits"].values()) for r in rows.values())
    assert all(list(r["variants"]) == ["prefetch_kv1+tagged", "ring2+ring_ahead"] and all(
        v["max_abs_difference"] < 1e-4 for v in r["variants"].values()) for r in rows.values())
    bad = subprocess.run([sys.executable, str(script), "--smoke", "--variants", "poll_two"], capture_output=True,
                         text=True)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "--variants: 'poll_two' is not tagged, barrier, ring_ahead, ring_behind, prefetch_kv1 .. prefetch_kv4, "
        "poll_sleep0 .. poll_sleep4096, poll_cap0 .. poll_cap16384, ring2 .. ring6, "
        "prefetch_tiles0 .. prefetch_tiles16 or on_ with qkv.o.gate_up.down or some of them"]


def test_the_benchmark_gives_each_phase_the_rate_it_read_its_bytes_at():
    """`decode_layers.py`'s phase line: each phase's bytes over all layers at Qwen3-0.6B's shape (bf16, written
    out from the config: W_qkv 4,096 x 1,024, W_o 1,024 x 2,048, W_gate and W_up 2 x 3,072 x 1,024, W_down
    1,024 x 3,072, K and V of 384 tokens x 8 heads x 128), and each phase's work with its rate, B's included; each
    wait's last program to leave, its own time and how often it arrived last."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks.decode_layers import handover_line, phase_bytes, phase_line, phase_rates

    with torch.device("meta"):
        model = Transformer(preset("qwen3-0.6b")).to(torch.bfloat16)
    got = phase_bytes(model, 384)
    per_layer = {"A": 4096 * 1024 * 2, "B": 2 * 384 * 8 * 128 * 2, "C": 1024 * 2048 * 2, "D": 2 * 3072 * 1024 * 2,
                 "E": 1024 * 3072 * 2}
    assert got == {k: 28 * v for k, v in per_layer.items()}
    ph = {f"{k} {w}": t for k, (work, wait) in zip("ABCDE", [(90.5, 35.5), (294.5, 39.8), (76.5, 51.5),
                                                            (211.8, 42.2), (116.5, 34.0)])
          for w, t in (("work", work), ("wait", wait))} | {"total": 992.8}
    line = phase_line(ph, phase_rates(ph, got))
    assert line.startswith("A work 90.5 (2.60 TB/s), B work 294.5 (0.15 TB/s), C work 76.5 (1.54 TB/s), ")
    assert "D work 211.8 (1.66 TB/s)" in line and "B wait 39.8" in line and line.endswith("total 992.8")
    tails = {f"{k} last {w}": v for k, t, share in zip("ABCDE", (20.5, 40.0, 30.25, 50.0, 10.0), (0.5, 1, 0, 0.25, 1))
             for w, v in (("tail", t), ("self", share))}
    assert handover_line(tails) == "A 20.5 (50%), B 40.0 (100%), C 30.2 (0%), D 50.0 (25%), E 10.0 (100%)"


def test_phase_times_reads_a_trace_as_the_slowest_program_sees_each_phase(monkeypatch):
    """`phase_times` on a made-up trace of 2 programs and one layer (clock in ns): each phase's work runs from
    the last departure before it to the last arrival after it, its barrier from that arrival to the last
    departure, and phase B's work is cut at its marks the same way (a program that never got to a mark, its
    clock 0, does not count); each barrier's last program to leave, its own time there and whether it was the
    last to arrive; phase B by context split; and the switches take their values only, in one line."""
    from nanoforge.kernels import decode_layers as dl

    start = [0, 1000]
    rows = [start]
    t = 1000
    for p in range(dl.PHASES):  # phase p: program 0 arrives after p + 1 us, program 1 1 us later, both leave by 0.5
        arrive = [t + 1000 * (p + 1), t + 1000 * (p + 2)]
        leave = [arrive[1] + 500, arrive[1] + 400]
        rows += [arrive, leave]
        t = max(leave)
    b0 = rows[2][0]  # the last departure before phase B (program 0's), 3 us of work before its last arrival
    marks = [[b0 + 100, b0 + 300], [b0 + 1200, 0], [b0 + 1500, b0 + 1400], [b0 + 2600, b0 + 1400]]
    trace = torch.tensor(rows + marks, dtype=torch.int64)
    assert trace.shape == (dl.trace_rows(1), 2)
    got = dl.phase_times(trace)
    assert [got[f"{n} work"] for n in "ABCDE"] == [2.0, 3.0, 4.0, 5.0, 6.0]
    assert all(got[f"{n} wait"] == 0.5 for n in "ABCDE")
    # the last to leave each barrier, program 0, arrived 1 us before program 1 (the last to arrive) and left 0.5
    # us after it: its own 1.5 us from arrival to departure, never the last to arrive
    assert all(got[f"{n} last tail"] == 1.5 and got[f"{n} last self"] == 0.0 for n in "ABCDE")
    swapped = trace.clone()
    swapped[6] = swapped[6].flip(0)  # phase C's barrier: program 1, the last to arrive, now also the last to leave
    got_c = dl.phase_times(swapped)
    assert got_c["C last tail"] == 0.5 and got_c["C last self"] == 1.0 and got_c["C wait"] == 0.5
    b_parts = [got[f"B {n}"] for n in ("query", "keys", "counted", "combined", "rest")]
    assert b_parts == pytest.approx([0.3, 0.9, 0.3, 1.1, 0.4]) and sum(b_parts) == pytest.approx(got["B work"])
    assert got["total"] == (t - 0) / 1e3 and got["layers"] == 1
    # by split, program p the item of split p: each one's own time from its poll's end (its departure from phase
    # A, 3.5 and 3.4 us) to each mark, none where it never got to the mark; program 0 the last to count
    by = dl.phase_times(trace, items=2, splits=2)
    assert by["B query by split"] == pytest.approx([0.1, 0.4]) and by["B keys by split"][1] is None
    assert by["B keys by split"][0] == pytest.approx(1.1) and by["B counted by split"] == pytest.approx([0.3, None])
    assert by["B combined by split"] == pytest.approx([1.1, 0.0]) and by["B last counted by split"] == [1.0, 0.0]
    assert "B keys by split" not in got
    monkeypatch.setenv("NANOFORGE_DECODE_PREFETCH_TILES", "0")
    assert dl.prefetch_tiles() == 0
    monkeypatch.setenv("NANOFORGE_DECODE_PREFETCH_TILES", "lots")
    with pytest.raises(NanoforgeError, match="NANOFORGE_DECODE_PREFETCH_TILES must be a whole number from 0 to 16"):
        dl.prefetch_tiles()
    assert dl.prefetch_kv_tiles() == 0  # off unless asked
    monkeypatch.setenv("NANOFORGE_DECODE_PREFETCH_KV", "2")
    assert dl.prefetch_kv_tiles() == 2
    monkeypatch.setenv("NANOFORGE_DECODE_PREFETCH_KV", "5")
    with pytest.raises(NanoforgeError, match="NANOFORGE_DECODE_PREFETCH_KV must be a whole number from 0 to 4"):
        dl.prefetch_kv_tiles()



