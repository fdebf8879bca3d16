"""`LLM`: the offline API, shaped like vLLM's.

    from nanoforge import LLM, SamplingParams
    llm = LLM("path/to/model", max_num_seqs=64)
    outs = llm.generate(["Hello", "The capital of France is"], SamplingParams(temperature=0, max_tokens=32))
    print(outs[0].outputs[0].text)

All prompts go into one `LLMEngine`, which batches them continuously; the
results come back in the order of the prompts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from tqdm import tqdm

from nanoforge.errors import NanoforgeError
from nanoforge.model.transformer import Transformer
from nanoforge.serve.llm_engine import EngineConfig, LLMEngine, RequestOutput, frozen_heap
from nanoforge.serve.sampling_params import SamplingParams
from nanoforge.tokenizer import Tokenizer

__all__ = ["LLM", "SamplingParams"]


class LLM:
    def __init__(self, model: str | Transformer, tokenizer: Tokenizer | None = None, **engine_kwargs):
        config = EngineConfig(**engine_kwargs)
        if isinstance(model, Transformer):
            if tokenizer is None:
                raise NanoforgeError("LLM(model=Transformer) needs tokenizer=", param="tokenizer")
            self.engine = LLMEngine(model, tokenizer, config)
        else:
            self.engine = LLMEngine.from_pretrained(model, config)

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def generate(self, prompts: str | Sequence[str] | Sequence[Sequence[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise NanoforgeError(f"got {len(sampling_params)} sampling params for {len(prompts)} prompts",
                                 param="sampling_params")
        ids = []
        try:
            for prompt, params in zip(prompts, sampling_params):
                params = dataclasses.replace(params, output_kind="final_only")  # only the end is returned
                ids.append(self.engine.add_request(prompt if isinstance(prompt, str) else list(prompt), params))
        except NanoforgeError:
            for rid in ids:  # all or nothing: a bad prompt queues none of the batch
                self.engine.abort(rid)
            raise
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="generate", unit="req", disable=not use_tqdm)
        with frozen_heap():
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        bar.update(1)
        bar.close()
        return [results[rid] for rid in ids]
