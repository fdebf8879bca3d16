"""Tuning decisions kept on disk (kernels/tuning_cache.py) and the skinny matmul's use of them (kernels/gemv.py)."""

import json
import math
import warnings

import pytest
import torch

import nanoforge.kernels.gemv as gv
from nanoforge.kernels import tuning_cache as tc


IDENT = {"gpu": "NVIDIA H200", "capability": "9.0", "torch": "2.11", "cuda": "13.0", "triton": "3.6",
         "salt": "abc", "switches": {}}


@pytest.fixture
def fake_gpu(monkeypatch, tmp_path):
    """decisions() on a 'cuda' device of a CPU machine: the GPU's name and capability stand in."""
    monkeypatch.setenv("NANOFORGE_TUNING_CACHE", "1")
    monkeypatch.setenv("NANOFORGE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(tc, "_OPEN", {})
    return tmp_path


def test_decisions_come_back_in_a_new_process_and_merge_with_anothers(tmp_path):
    path = tmp_path / "gemv-x.json"
    a, b = tc.Decisions(path, IDENT), tc.Decisions(path, IDENT)
    assert a.get("k1") is None and b.get("k2") is None  # both read the (missing) file before either writes
    a.put("k1", "ours")
    b.put("k2", [[[1, 2, True, "torch.bfloat16"], 3]])
    again = tc.Decisions(path, IDENT)  # what the next process reads
    assert again.get("k1") == "ours" and again.get("k2") == [[[1, 2, True, "torch.bfloat16"], 3]]
    assert json.loads(path.read_text())["identity"] == IDENT  # in words, for whoever opens it
    assert not list(tmp_path.glob("*.tmp"))  # written whole, then renamed


def test_a_foreign_or_corrupt_file_counts_as_empty(tmp_path):
    path = tmp_path / "gemv-x.json"
    tc.Decisions(path, IDENT).put("k", "ours")
    assert tc.Decisions(path, {**IDENT, "gpu": "NVIDIA H100 80GB HBM3"}).get("k") is None
    for text in ("{not json", "[]", json.dumps({"identity": IDENT, "decisions": []})):
        path.write_text(text)
        d = tc.Decisions(path, IDENT)
        assert d.get("k") is None
        d.put("k", "cublas")  # and is replaced by a good one
        assert tc.Decisions(path, IDENT).get("k") == "cublas"


def test_an_unwritable_directory_is_warned_about_once_and_tuning_goes_on(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    d = tc.Decisions(blocker / "sub" / "gemv-x.json", IDENT)  # its parent cannot be made: a file is in the way
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        d.put("k1", "ours")
        d.put("k2", "ours")
    assert len(seen) == 1 and "NANOFORGE_CACHE_DIR" in str(seen[0].message)
    assert d.get("k1") == "ours"  # kept in memory


def test_each_gpu_model_software_and_switch_setting_has_its_own_file(fake_gpu, monkeypatch):
    cuda = torch.device("cuda", 0)
    first = tc.decisions("gemv", cuda, lambda: "salt1")
    assert first is tc.decisions("gemv", torch.device("cuda", 0), lambda: "salt1")  # read once a process
    assert first.path.parent == fake_gpu and first.ident["gpu"] == "NVIDIA H200"
    paths = {first.path}
    paths.add(tc.decisions("gemv", cuda, lambda: "salt2").path)  # the tuner's source changed
    monkeypatch.setenv("NANOFORGE_PDL", "0")  # a lever set
    paths.add(tc.decisions("gemv", cuda, lambda: "salt1").path)
    monkeypatch.delenv("NANOFORGE_PDL")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    paths.add(tc.decisions("gemv", cuda, lambda: "salt1").path)
    assert len(paths) == 4
    monkeypatch.setenv("NANOFORGE_CACHE_DIR", str(fake_gpu / "elsewhere"))  # the cache's own settings: same name
    assert tc.decisions("gemv", cuda, lambda: "salt1").path.name in {p.name for p in paths}


def test_off_or_on_the_cpu_nothing_is_read_or_written(fake_gpu, monkeypatch):
    assert tc.decisions("gemv", torch.device("cpu"), lambda: "s") is None
    monkeypatch.setenv("NANOFORGE_TUNING_CACHE", "0")
    assert tc.decisions("gemv", torch.device("cuda", 0), lambda: "s") is None
    monkeypatch.setenv("NANOFORGE_TUNING_CACHE", "yes")
    with pytest.raises(Exception, match="NANOFORGE_TUNING_CACHE must be 1 or 0"):
        tc.decisions("gemv", torch.device("cuda", 0), lambda: "s")


def test_the_default_directory_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.delenv("NANOFORGE_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert tc.directory() == tmp_path / "nanoforge"


def test_the_way_chosen_per_shape_is_timed_once_per_gpu_model_not_once_per_process(monkeypatch, tmp_path):
    """gemv.choose: a shape timed in one process is read back in the next (here: the in-memory choices emptied)
    and not timed again; on another GPU model it is timed afresh."""
    path = {"gpu": tmp_path / "h200.json"}
    monkeypatch.setattr(gv, "_saved", lambda device: tc.Decisions(path["gpu"], IDENT))
    monkeypatch.setattr(gv, "_can_time", lambda x: True)
    monkeypatch.delenv("NANOFORGE_GEMV", raising=False)
    timed = []
    monkeypatch.setattr(gv, "_fastest", lambda *a: timed.append(a[1].shape) or "ours")
    x, w = torch.randn(2, 64), torch.randn(48, 64)
    for _ in range(2):  # two processes
        monkeypatch.setattr(gv, "_CHOICES", {})
        assert gv.choose(x, w, None, False, norm=True) == "ours"
        assert gv.choose(x, w, None, False, norm=True) == "ours"
    assert timed == [w.shape]
    monkeypatch.setattr(gv, "_fastest", lambda *a: timed.append(a[1].shape) or "cublas")
    monkeypatch.setattr(gv, "_CHOICES", {})
    assert gv.choose(x, w, None, False, norm=False) == "cublas"  # another shape (no norm): timed
    path["gpu"] = tmp_path / "h100.json"
    monkeypatch.setattr(gv, "_CHOICES", {})
    assert gv.choose(x, w, None, False, norm=True) == "cublas" and len(timed) == 3


class FakeAutotuner:
    """What gemv uses of Triton's autotuner: its candidates and its cache of picks per its own key."""

    def __init__(self, configs):
        self.configs, self.cache = configs, {}


def test_the_autotuners_picks_come_back_under_its_own_keys(monkeypatch, tmp_path):
    monkeypatch.setattr(gv, "_saved", lambda device: tc.Decisions(tmp_path / "g.json", IDENT))
    configs = [object() for _ in range(5)]
    kernel = FakeAutotuner(configs)
    kernel.cache[(1, 2)] = configs[0]  # another shape's, timed before
    ours = (torch.bfloat16, "default", 1024, 4096, 16, True, True, False)
    known = set(kernel.cache)
    tuned = (4096, 1024, 16, True, True, False, "torch.bfloat16", "torch.bfloat16")  # this Triton's key
    kernel.cache[tuned] = configs[3]
    gv._save_picks(kernel, ours, known, torch.device("cuda", 0))
    fresh = FakeAutotuner(configs)  # the next process
    assert gv._restore_picks(fresh, ours, torch.device("cuda", 0))
    assert fresh.cache == {tuned: configs[3]}
    assert not gv._restore_picks(FakeAutotuner(configs), (*ours[:2], 2048, *ours[3:]), torch.device("cuda", 0))
    shorter = FakeAutotuner(configs[:2])  # a pick past the candidates this process has: timed afresh
    assert not gv._restore_picks(shorter, ours, torch.device("cuda", 0))


@pytest.mark.gpu
def test_gpu_a_second_process_tunes_nothing_and_gets_the_same_answer(monkeypatch, tmp_path):
    """On the GPU, with the cache on: the skinny matmul's shapes tuned once (the autotuner's picks and the way
    against cuBLAS) are read back after every in-memory trace of them is dropped, as a new process would: no
    candidate compiled or timed, no way timed, the same output bit for bit, and right against float64."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (runs on the H200 machine)")
    monkeypatch.setenv("NANOFORGE_TUNING_CACHE", "1")
    monkeypatch.setenv("NANOFORGE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("NANOFORGE_GEMV", raising=False)
    monkeypatch.setattr(tc, "_OPEN", {})
    gen = torch.Generator(device="cuda").manual_seed(7)
    k, n = 1088, 3136  # shapes no other test uses
    w = (torch.randn(2 * n, k, generator=gen, device="cuda") / math.sqrt(k)).bfloat16()
    x = torch.randn(2, k, generator=gen, device="cuda").bfloat16()
    a, g = torch.randn_like(x), torch.rand(k, generator=gen, device="cuda").bfloat16() + 0.5

    def run():
        return (gv.norm_linear(a, x, g, 1e-6, w, swiglu=True)[0], gv.gemv(x, w[:n]))

    monkeypatch.setattr(gv, "_CHOICES", {})
    monkeypatch.setattr(gv, "_COMPILED", set())
    first = run()
    assert len(list(tmp_path.glob("gemv-*.json"))) == 1
    for kernel in gv._TUNED.values():  # a new process: nothing in memory
        monkeypatch.setattr(kernel, "cache", {})
    monkeypatch.setattr(gv, "_CHOICES", {})
    monkeypatch.setattr(gv, "_COMPILED", set())
    monkeypatch.setattr(tc, "_OPEN", {})
    monkeypatch.setattr(gv, "_fastest", lambda *a: pytest.fail("a way timed again"))
    monkeypatch.setattr(gv, "compile_in_parallel", lambda *a: pytest.fail("candidates compiled again"))
    kernel = gv._TUNED[gv.configs()]
    monkeypatch.setattr(kernel, "_bench", lambda *a, **kw: pytest.fail("a candidate timed again"))
    tuned = gv.tuning_s()
    second = run()
    assert gv.tuning_s() == tuned
    for got, want in zip(second, first):
        assert torch.equal(got, want)
    want = gv.norm_gemv_ref(a.double(), x.double(), g.double(), 1e-6, w.double(), swiglu=True)[0]
    assert ((first[0].double() - want).norm() / want.norm()).item() < 1e-2
