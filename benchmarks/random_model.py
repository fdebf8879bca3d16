"""A model directory for serving benchmarks: a preset's shape with random weights, and a byte-level BPE trained in
a second on this repository's sources (the model's vocabulary is the BPE's).

    python benchmarks/random_model.py OUT_DIR PRESET DEVICE      # e.g. /tmp/m qwen3-0.6b cuda

bf16 on a GPU, fp32 on the CPU. Run from the repository root.
"""

import sys
from pathlib import Path

import torch

from nanoforge.model.config import preset
from nanoforge.model.hf import save_model
from nanoforge.model.transformer import Transformer
from nanoforge.tokenizer import Tokenizer

out, name, device = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
texts = [p.read_text() for p in sorted(Path("nanoforge").rglob("*.py"))]
tok = Tokenizer.train_bpe(texts, vocab_size=8192)
cfg = preset(name, vocab_size=tok.vocab_size, eos_token_id=tok.eot_id, bos_token_id=tok.eos_id)
torch.manual_seed(0)
with torch.device(device):
    model = Transformer(cfg).to(torch.bfloat16 if device == "cuda" else torch.float32)
save_model(model, out)
tok.save(out)
print(f"model: {name} shape, vocab {tok.vocab_size}, {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M "
      f"parameters, in {out}")
