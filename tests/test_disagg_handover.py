"""The hand-over stream's events (serve/disagg/handover.py): what a decode instance sends the conductor for each
output, and what the conductor rebuilds from them."""

from __future__ import annotations

import os
import random

from nanoforge.serve.disagg.handover import (
    OutputDecoder, OutputEncoder, _common_prefix, handover_body, parse_handover,
)
from nanoforge.serve.llm_engine import CompletionOutput, RequestOutput
from nanoforge.serve.sampling_params import SamplingParams


def test_the_common_prefix_is_the_naive_ones():
    rng = random.Random(0)
    for _ in range(5000):
        a, b = ("".join(rng.choice("ab\ufffd") for _ in range(rng.randint(0, 9))) for _ in range(2))
        assert _common_prefix(a, b) == len(os.path.commonprefix([a, b])), (a, b)


def test_events_rebuild_every_output_as_it_grows_and_when_it_is_cut():
    """Each event carries only what changed: the text past what was sent (the whole rest where a held-back
    character resolved or a stop string cut the text), the new token ids; the decoder's output equals the
    engine's at every step."""
    texts = ["He", "Hel", "Hel\ufffd", "Hello", "Hello, wor", "Hello, world STOP", "Hello, world"]
    enc, dec = OutputEncoder(), OutputDecoder("r", [1, 2])
    froms = []
    for i, text in enumerate(texts):
        out = RequestOutput("r", None, [1, 2], [CompletionOutput(0, text, list(range(i + 1)))], i == len(texts) - 1)
        event = enc.event(out)
        froms.append(event["outputs"][0]["text_from"])
        got = dec.apply(event)
        assert got.outputs[0].text == text and got.outputs[0].token_ids == list(range(i + 1))
    assert froms == [0, 2, 3, 3, 5, 10, 12]  # all that was sent, except where the text changed behind it


def test_a_hand_over_asks_the_instance_for_every_steps_output_whatever_the_client_asked():
    """A non-streaming client's request is "final_only" at the conductor's front; the instances it hands the
    request to must still report every step (the conductor learns decode instances' pace from them)."""
    params = SamplingParams(max_tokens=5, seed=3, output_kind="final_only")
    body = handover_body("r", [1, 2, 3], params)
    rid, prompt, sent, _ = parse_handover(body, resume=False)
    assert sent.output_kind == "cumulative" and sent.seed == 3 and sent.max_tokens == 5
    assert params.output_kind == "final_only"  # the caller's params are left alone
