"""nanoforge: pretrain, fine-tune and serve GPTs; one readable package.

`from nanoforge import LLM, SamplingParams` gives the offline inference API;
the imports are lazy so that `import nanoforge` stays cheap.
"""

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "ModelConfig", "Transformer", "NanoforgeError"]


def __getattr__(name):
    if name in ("LLM", "SamplingParams"):
        from nanoforge.serve import llm

        return getattr(llm, name)
    if name in ("ModelConfig",):
        from nanoforge.model.config import ModelConfig

        return ModelConfig
    if name == "Transformer":
        from nanoforge.model.transformer import Transformer

        return Transformer
    if name == "NanoforgeError":
        from nanoforge.errors import NanoforgeError

        return NanoforgeError
    raise AttributeError(name)
