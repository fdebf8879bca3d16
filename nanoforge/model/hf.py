"""Hugging Face checkpoints in and out: config.json + (sharded) safetensors.

`load_model(dir)` reads a `transformers` model directory of a GPT-2, Llama,
Qwen2 or Qwen3 model; `save_model(model, dir)` writes one that
`transformers.AutoModelForCausalLM.from_pretrained` loads unchanged. nanoforge
checkpoints *are* Hugging Face checkpoints, so there is one format to know.

The name maps below are the whole conversion. Two details:
- GPT-2 stores its linear layers as `Conv1D` (weight shape in x out): transposed here.
- nanoforge fuses q/k/v into `wqkv` and gate/up into `w_in`; they are
  concatenated on load and split on save.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from nanoforge.errors import NanoforgeError
from nanoforge.model.config import ARCHS, ModelConfig
from nanoforge.model.transformer import Transformer

SUPPORTED = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
             "qwen3": "Qwen3ForCausalLM"}


# --- config.json <-> ModelConfig ---------------------------------------------------------------

def config_from_hf(hf: dict, where: str = "config.json") -> ModelConfig:
    arch = hf.get("model_type")
    if arch not in ARCHS:
        raise NanoforgeError(f"{where}: model_type {arch!r} is not supported; nanoforge runs {', '.join(ARCHS)}",
                             param="model_type")
    try:
        if arch == "gpt2":
            act = hf.get("activation_function", "gelu_new")
            if act not in ("gelu_new", "gelu_pytorch_tanh"):
                raise NanoforgeError(f"{where}: GPT-2 activation {act!r} is not supported (gelu_new only)")
            d = hf["n_embd"]
            return ModelConfig(arch="gpt2", vocab_size=hf["vocab_size"], d_model=d, n_layers=hf["n_layer"],
                               n_heads=hf["n_head"], d_ff=hf.get("n_inner") or 4 * d, max_seq_len=hf["n_positions"],
                               norm_eps=hf.get("layer_norm_epsilon", 1e-5),
                               tie_embeddings=hf.get("tie_word_embeddings", True),
                               bos_token_id=hf.get("bos_token_id"), eos_token_id=hf.get("eos_token_id"))
        if hf.get("hidden_act", "silu") != "silu":
            raise NanoforgeError(f"{where}: hidden_act {hf['hidden_act']!r} is not supported (silu only)")
        if hf.get("use_sliding_window"):
            raise NanoforgeError(f"{where}: sliding-window attention is not supported")
        # transformers >= 5 nests rope_theta inside rope_parameters; older files keep rope_theta + rope_scaling.
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", hf.get("rope_theta", 10000.0))
        if rope.get("rope_type", rope.get("type", "default")) == "default":
            rope = None
        attention_bias = hf.get("attention_bias", False)
        return ModelConfig(
            arch=arch, vocab_size=hf["vocab_size"], d_model=hf["hidden_size"], n_layers=hf["num_hidden_layers"],
            n_heads=hf["num_attention_heads"], n_kv_heads=hf.get("num_key_value_heads"), head_dim=hf.get("head_dim"),
            d_ff=hf["intermediate_size"], max_seq_len=hf.get("max_position_embeddings", 2048),
            norm_eps=hf.get("rms_norm_eps", 1e-6), rope_theta=float(theta), rope_scaling=rope,
            tie_embeddings=hf.get("tie_word_embeddings", False),
            qkv_bias=True if arch == "qwen2" else attention_bias,
            out_bias=attention_bias if arch == "llama" else False, mlp_bias=hf.get("mlp_bias", False),
            bos_token_id=hf.get("bos_token_id"), eos_token_id=hf.get("eos_token_id"))
    except KeyError as e:
        raise NanoforgeError(f"{where}: missing field {e.args[0]!r}") from None


def config_to_hf(cfg: ModelConfig, dtype: torch.dtype) -> dict:
    common = {"architectures": [SUPPORTED[cfg.arch]], "model_type": cfg.arch, "vocab_size": cfg.vocab_size,
              "tie_word_embeddings": cfg.tie_embeddings, "bos_token_id": cfg.bos_token_id,
              "eos_token_id": cfg.eos_token_id, "torch_dtype": str(dtype).removeprefix("torch."),
              "use_cache": True}
    if cfg.is_gpt2:
        return common | {"n_embd": cfg.d_model, "n_layer": cfg.n_layers, "n_head": cfg.n_heads, "n_inner": cfg.d_ff,
                         "n_positions": cfg.max_seq_len, "n_ctx": cfg.max_seq_len,
                         "layer_norm_epsilon": cfg.norm_eps, "activation_function": "gelu_new"}
    out = common | {"hidden_size": cfg.d_model, "num_hidden_layers": cfg.n_layers,
                    "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
                    "head_dim": cfg.head_dim, "intermediate_size": cfg.d_ff,
                    "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps, "hidden_act": "silu",
                    "rope_theta": cfg.rope_theta, "rope_scaling": cfg.rope_scaling, "mlp_bias": cfg.mlp_bias}
    if cfg.arch == "llama":
        if cfg.qkv_bias != cfg.out_bias:
            raise NanoforgeError("a Llama checkpoint has one attention_bias flag: qkv_bias and out_bias must agree")
        out["attention_bias"] = cfg.qkv_bias
    elif cfg.arch == "qwen3":
        out["attention_bias"] = cfg.qkv_bias
    return out


# --- tensor names ------------------------------------------------------------------------------

def _layer_map(cfg: ModelConfig, i: int) -> dict[str, list[str]]:
    """nanoforge name -> the HF names concatenated (dim 0, torch layout) to make it."""
    if cfg.is_gpt2:
        p = f"transformer.h.{i}."
        m = {"attn_norm.weight": [p + "ln_1.weight"], "attn_norm.bias": [p + "ln_1.bias"],
             "attn.wqkv.weight": [p + "attn.c_attn.weight"], "attn.wqkv.bias": [p + "attn.c_attn.bias"],
             "attn.wo.weight": [p + "attn.c_proj.weight"], "attn.wo.bias": [p + "attn.c_proj.bias"],
             "mlp_norm.weight": [p + "ln_2.weight"], "mlp_norm.bias": [p + "ln_2.bias"],
             "mlp.w_in.weight": [p + "mlp.c_fc.weight"], "mlp.w_in.bias": [p + "mlp.c_fc.bias"],
             "mlp.w_out.weight": [p + "mlp.c_proj.weight"], "mlp.w_out.bias": [p + "mlp.c_proj.bias"]}
    else:
        p = f"model.layers.{i}."
        a = p + "self_attn."
        m = {"attn_norm.weight": [p + "input_layernorm.weight"],
             "attn.wqkv.weight": [a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"],
             "attn.wo.weight": [a + "o_proj.weight"],
             "mlp_norm.weight": [p + "post_attention_layernorm.weight"],
             "mlp.w_in.weight": [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"],
             "mlp.w_out.weight": [p + "mlp.down_proj.weight"]}
        if cfg.qkv_bias:
            m["attn.wqkv.bias"] = [a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"]
        if cfg.out_bias:
            m["attn.wo.bias"] = [a + "o_proj.bias"]
        if cfg.mlp_bias:
            m["mlp.w_in.bias"] = [p + "mlp.gate_proj.bias", p + "mlp.up_proj.bias"]
            m["mlp.w_out.bias"] = [p + "mlp.down_proj.bias"]
        if cfg.qk_norm:
            m["attn.q_norm.weight"] = [a + "q_norm.weight"]
            m["attn.k_norm.weight"] = [a + "k_norm.weight"]
    return {f"layers.{i}.{k}": v for k, v in m.items()}


def name_map(cfg: ModelConfig) -> dict[str, list[str]]:
    if cfg.is_gpt2:
        m = {"embed.weight": ["transformer.wte.weight"], "pos_embed.weight": ["transformer.wpe.weight"],
             "norm.weight": ["transformer.ln_f.weight"], "norm.bias": ["transformer.ln_f.bias"]}
    else:
        m = {"embed.weight": ["model.embed_tokens.weight"], "norm.weight": ["model.norm.weight"]}
    if not cfg.tie_embeddings:
        m["lm_head.weight"] = ["lm_head.weight"]
    for i in range(cfg.n_layers):
        m |= _layer_map(cfg, i)
    return m


def _part_sizes(cfg: ModelConfig, nf_name: str) -> list[int]:
    """How a fused nanoforge tensor splits (dim 0) into its HF parts."""
    if cfg.is_gpt2:  # GPT-2 keeps c_attn fused, and its MLP has no gate
        return []
    module = nf_name.split(".", 2)[-1].rsplit(".", 1)[0]  # "layers.3.attn.wqkv.weight" -> "attn.wqkv"
    return [rows for _, rows in cfg.fused_parts().get(module, [])]


def _is_conv1d(cfg: ModelConfig, hf_name: str) -> bool:
    return cfg.is_gpt2 and hf_name.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight"))


# --- reading ---------------------------------------------------------------------------------------

def _safetensors_files(d: Path) -> list[Path]:
    index = d / "model.safetensors.index.json"
    if index.exists():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError) as e:
            raise NanoforgeError(f"{index}: not a valid safetensors index ({e})") from None
        return [d / n for n in names]
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise NanoforgeError(f"{d}: no *.safetensors weights found")
    return files


def read_config(model_dir: str | os.PathLike) -> ModelConfig:
    d = Path(model_dir)
    if not d.is_dir():
        raise NanoforgeError(f"{d}: model directory not found")
    path = d / "config.json"
    try:
        hf = json.loads(path.read_text())
    except FileNotFoundError:
        raise NanoforgeError(f"{path}: not found (is {d} a Hugging Face model directory?)") from None
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise NanoforgeError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(hf, dict):
        raise NanoforgeError(f"{path}: expected a JSON object")
    return config_from_hf(hf, str(path))


def load_model(model_dir: str | os.PathLike, *, device: str | torch.device = "cpu",
               dtype: torch.dtype = torch.float32) -> Transformer:
    """Build a Transformer from a Hugging Face model directory (weights cast to `dtype` on `device`)."""
    d = Path(model_dir)
    cfg = read_config(d)
    handles = {}
    where = {}  # HF tensor name -> file
    try:
        for f in _safetensors_files(d):
            h = safe_open(str(f), framework="pt", device="cpu")
            handles[f] = h
            for k in h.keys():
                where[k] = f
    except FileNotFoundError as e:
        raise NanoforgeError(f"{e.filename}: weight file listed in the index is missing") from None
    except (SafetensorError, OSError) as e:
        raise NanoforgeError(f"{f}: not a valid safetensors file ({e})") from None

    with torch.device("meta"):
        model = Transformer(cfg)
    expected = model.state_dict()
    state = {}
    for nf_name, hf_names in name_map(cfg).items():
        want = expected[nf_name].shape
        sizes = _part_sizes(cfg, nf_name) or [want[0]]
        parts = []
        for hf_name, size in zip(hf_names, sizes):
            if hf_name not in where:
                raise NanoforgeError(f"{d}: tensor {hf_name!r} is missing from the checkpoint")
            try:
                t = handles[where[hf_name]].get_tensor(hf_name)
            except SafetensorError as e:
                raise NanoforgeError(f"{where[hf_name]}: cannot read tensor {hf_name!r} ({e})") from None
            if _is_conv1d(cfg, hf_name):
                t = t.t()
            part_shape = (size, *want[1:])
            if tuple(t.shape) != part_shape:
                shown = t.t() if _is_conv1d(cfg, hf_name) else t
                expect = part_shape[::-1] if _is_conv1d(cfg, hf_name) else part_shape
                raise NanoforgeError(f"{where[hf_name]}: tensor {hf_name!r} has shape {list(shown.shape)}, "
                                     f"expected {list(expect)} from config.json")
            parts.append(t)
        t = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        state[nf_name] = t.to(device=device, dtype=dtype).contiguous()
    if cfg.tie_embeddings:
        state["lm_head.weight"] = state["embed.weight"]
    model.load_state_dict(state, assign=True, strict=True)
    if cfg.tie_embeddings:
        model.lm_head.weight = model.embed.weight
    model.reset_buffers(device)
    return model.eval()


# --- writing ---------------------------------------------------------------------------------------

def save_model(model: Transformer, out_dir: str | os.PathLike, *, dtype: torch.dtype | None = None) -> Path:
    """Write config.json + model.safetensors that `transformers` loads unchanged.

    Files are written under temporary names and renamed at the end, so an
    interrupted save never leaves a half-written checkpoint that looks good.
    """
    cfg = model.cfg
    if cfg.is_gpt2 and not (cfg.qkv_bias and cfg.out_bias and cfg.mlp_bias):
        raise NanoforgeError("a GPT-2 checkpoint has biases on every linear layer; this model lacks some, "
                             "so it cannot be saved in the GPT-2 format", param="bias")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sd = model.state_dict()
    dtype = dtype or model.embed.weight.dtype
    tensors = {}
    for nf_name, hf_names in name_map(cfg).items():
        t = sd[nf_name].detach().to("cpu", dtype)
        sizes = _part_sizes(cfg, nf_name)
        pieces = list(t.split(sizes, dim=0)) if sizes else [t]
        for hf_name, piece in zip(hf_names, pieces):
            tensors[hf_name] = (piece.t() if _is_conv1d(cfg, hf_name) else piece).contiguous()
    tmp_weights, tmp_config = out / "model.safetensors.tmp", out / "config.json.tmp"
    save_file(tensors, str(tmp_weights), metadata={"format": "pt"})
    tmp_config.write_text(json.dumps(config_to_hf(cfg, dtype), indent=2) + "\n")
    os.replace(tmp_weights, out / "model.safetensors")
    os.replace(tmp_config, out / "config.json")
    return out
