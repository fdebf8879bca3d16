"""Time models: what one engine step and one KV transfer cost, read from a profile of the real engine.

A profile is a JSON file (`profiles/NAME.json`, or any path) holding small fitted forms:

    prefill step   a + per_token * T + per_pair * P + per_prefix_pair * Q + per_prefix * X + decode.per_context * C_d
                   T: tokens computed in the step (every chunk, decodes included); P: the query-key pairs that
                   the prompt chunks attend, sum of n * (start + (n + 1) / 2) over chunks of n tokens after `start`
                   cached or computed ones (a cached prefix costs attention, not compute); Q: of those, the pairs
                   whose key is in the prefix, sum of n * start, at what such a pair costs beyond one within the
                   chunk (optional, 0 in older profiles: on the H200 a pair over the prefix costs ~1.7x one inside
                   a chunk, and one price for both, fitted mostly to short chunks over long prefixes, put an
                   uncached 8,192-token prompt 16% over its measured step); X: the chunks' prefixes,
                   sum of `start` (the context each chunk's attention walks however few its queries: a short
                   chunk after a long cached prefix is bound by that walk, not by its pairs; optional, 0 in
                   older profiles); C_d: the context of the decodes batched with them
    decode step    a + per_seq * B + per_context * C      (a step of B one-token decodes over C context tokens)
                   or, where the section holds `batch_s` ([[B_i, s_i], ...], B_i increasing), s(B) + per_context * C:
                   s_i measured at each B_i, linear between them, the last segment's slope past the last (the first
                   value below the first). A step's cost is not linear in B on a GPU: batch 1 runs the skinny
                   matmul at the weights' read, batch 8 already pays the rows (H200, Qwen3-0.6B: 1.03 ms at
                   batch 1, 1.42 at 8, 1.85 at 32). `a` and `per_seq` are then the line through the s_i, a summary
                   (profiles before session 14 hold the line alone)
    KV transfer    latency + per_block * n                 (one batched pool call moving n blocks)
    local put      local_latency + local_per_block * n     (a batched put into the caller's own segment)

The transfer's remote form is what `measure_transfer` times between a client and a segment in another process
(a decode instance's gets, and the saves a prefill instance's full segment sends elsewhere); the local one, a put
by a client that holds a segment into that segment (Mooncake's `preferred_segment`: a local copy, as a prefill
instance's saves are while its segment has room). The local fields are optional: older profiles lack them and
take the remote ones for them (`local_latency_s` = `latency_s`, `local_per_block_s` = `per_block_s`), so a put
costs what it did before.

A step that holds any chunk other than a plain decode (`ScheduledSeq.is_decode`) is a prefill step: the engine
runs those eagerly, while plain decode batches replay CUDA graphs.

`frontend` holds what serving adds around the engine: `request_s` + `per_prompt_token_s` x prompt tokens, the
latency between the client and the server (HTTP, queueing into the engine thread, the server's work on the
prompt, the first SSE chunk; the per-token part is optional, 0 in older profiles); `handover_s`, one conductor hop in a
disaggregated cluster; and `per_token_s`, the server's own work per streamed token (the output, the
detokenizer, the event loop, SSE or NDJSON), which runs in the engine's process, under the same GIL, and so
lengthens every step by `per_token_s` for each chunk that samples a token. A small model on a fast GPU spends
more of its step there than in the forward pass. A disaggregated decode instance streams each step's tokens to
the conductor as hand-over events (`serve/disagg/handover.py`'s `OutputEncoder`); each event costs
`stream_per_output_token_s` per output token the request holds (optional, 0 in older profiles): ~0 since
session 12, 1.7 us on the 2-core box before, when the encoder compared the whole text character by character
(the runs before then carry it; `docs/results/issue15/session12/h200-qwen3-0.6b-stream-cpu.json`).

A request also costs the server host work that the steps already running pay for: its HTTP request, the
prompt's parsing and checks, its block hashes, its queueing into the engine thread, all in the engine's process
under the same GIL. `request_host_s` + `request_host_per_token_s` x prompt tokens (optional, 0 in profiles before
session 14) is that work, measured as what requests arriving among running decodes add to their TPOT beyond
their prompt's share of the steps (`measure.py`'s `_arrivals`); an instance adds it to the host part of the next
step it launches after its server takes the request, which for a colocated instance is when the request
arrives (its server is the front door: the work is done while the request is there, stretching the others'
steps, not its own prompt's) and for a disaggregated one when the hand-over reaches it (H200, Qwen3-0.6B:
~5.8 ms for a 2,000-token prompt, against ~1.4 ms decode steps).

A step is split into its device part (the forms above: what instances on one GPU share) and its host part (the
server's work per token: the GIL's, not the GPU's; `step_parts`).

`nanoforge simulate profile` measures a profile on the real engine (`measure.py`). A profile whose `status` is
"derived" was computed from other measurements, not measured: it says how in `source`.
"""

from __future__ import annotations

import json
import math
from bisect import bisect_left
from dataclasses import dataclass, field
from pathlib import Path

from nanoforge.errors import NanoforgeError
from nanoforge.serve.scheduler import SchedulerOutput

PROFILE_DIR = Path(__file__).parent / "profiles"
DEFAULT_PROFILE = "h200-qwen3-0.6b"

# what each section must hold (seconds, or counts for `engine`)
_FIELDS = {
    "prefill": ("a_s", "per_token_s", "per_pair_s", "per_prefix_s", "per_prefix_pair_s"),
    "decode": ("a_s", "per_seq_s", "per_context_s"),
    "transfer": ("latency_s", "per_block_s", "block_bytes"),
    "engine": ("num_gpu_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens"),
    "frontend": ("request_s", "per_prompt_token_s", "handover_s", "per_token_s", "stream_per_output_token_s",
                 "request_host_s", "request_host_per_token_s"),
}
# fields a profile may lack (older ones; the frontend, wholly), and their value then
_OPTIONAL = {"prefill": {"per_prefix_s": 0.0, "per_prefix_pair_s": 0.0},
             "frontend": {"request_s": 0.0, "per_prompt_token_s": 0.0, "handover_s": 0.0, "per_token_s": 0.0,
                          "stream_per_output_token_s": 0.0, "request_host_s": 0.0, "request_host_per_token_s": 0.0}}
# optional fields whose value, where a profile lacks them, is another field's: kept as read (a profile without
# them is written back without them)
_DEFAULTS_TO = {"transfer": {"local_latency_s": "latency_s", "local_per_block_s": "per_block_s"}}


@dataclass
class Profile:
    name: str
    status: str  # "measured" or "derived"
    prefill: dict
    decode: dict
    transfer: dict
    engine: dict
    frontend: dict = field(default_factory=dict)
    meta: dict = field(default_factory=dict)  # model, device, source, samples and fit residuals: kept as read

    def __post_init__(self):
        # the step-time coefficients as plain floats, for the hot path
        self.prefill = {**_OPTIONAL["prefill"], **self.prefill}
        self.frontend = {**_OPTIONAL["frontend"], **self.frontend}
        p, d, t = self.prefill, self.decode, self.transfer
        self._p = (p["a_s"], p["per_token_s"], p["per_pair_s"], p["per_prefix_s"], p["per_prefix_pair_s"])
        self._d = (d["a_s"], d["per_seq_s"], d["per_context_s"])
        points = d.get("batch_s") or []
        self._batches = [float(b) for b, _ in points]
        self._levels = [float(v) for _, v in points]
        self._t = (t["latency_s"], t["per_block_s"])
        self._t_local = tuple(t.get(name, t[other]) for name, other in _DEFAULTS_TO["transfer"].items())
        self._per_output = self.frontend["per_token_s"]
        self._per_held = self.frontend["stream_per_output_token_s"]

    # --- the models ------------------------------------------------------------------------------------

    def step_time(self, out: SchedulerOutput, *, stream: bool = False) -> float:
        """Seconds the serving engine takes to run `out`: the model, plus the server's work per sampled token
        (`stream`: a decode instance's hand-over events; block copies and swaps are not modelled)."""
        return sum(self.step_parts(out, stream=stream))

    def step_parts(self, out: SchedulerOutput, *, stream: bool = False) -> tuple[float, float]:
        """(device seconds, host seconds) of `out`: the model's step, and the server's work for the tokens it
        samples, which runs in the engine's process under the GIL and holds no GPU. With `stream` (a decode
        instance) each sampled chunk's event also pays `stream_per_output_token_s` per output token its request
        holds (the tokens before this step's: the text the encoder compares)."""
        tokens = pairs = prefix_pairs = prefix = batch = context = samples = held = 0
        prefill = False
        for s in out.scheduled:
            n = s.num_tokens
            if n == 1 and s.num_samples == 1:  # ScheduledSeq.is_decode, inlined: this runs for every token
                batch += 1
                context += s.start + 1
            else:
                prefill = True
                tokens += n
                prefix_pairs += n * s.start
                pairs += n * s.start + n * (n + 1) // 2
                prefix += s.start
                samples += s.num_samples
            if stream and s.num_samples:
                held += max(0, s.start + n - s.seq.num_prompt_tokens)
        host = self._per_output * (batch + samples) + self._per_held * held
        if prefill:
            a, per_token, per_pair, per_prefix, per_prefix_pair = self._p
            return (a + per_token * (tokens + batch) + per_pair * pairs + per_prefix_pair * prefix_pairs
                    + per_prefix * prefix + self._d[2] * context, host)
        return self._decode_base(batch) + self._d[2] * context, host

    def prefill_time(self, tokens: int, cached: int = 0) -> float:
        """One prompt chunk of `tokens` tokens after `cached` ones, alone in its step (and sampling at its end)."""
        a, per_token, per_pair, per_prefix, per_prefix_pair = self._p
        return (a + per_token * tokens + per_pair * (tokens * cached + tokens * (tokens + 1) // 2)
                + per_prefix_pair * tokens * cached + per_prefix * cached + self._per_output)

    def decode_time(self, batch: int, context: int) -> float:
        """One step of `batch` decodes over `context` tokens in all (with the server's work per token)."""
        return self._decode_base(batch) + self._per_output * batch + self._d[2] * context

    def _decode_base(self, batch: int) -> float:
        """A decode step's cost of `batch` sequences at no context: the `batch_s` points, or the line."""
        b, v = self._batches, self._levels
        if not b:
            return self._d[0] + self._d[1] * batch
        i = bisect_left(b, batch)
        if i < len(b) and b[i] == batch:
            return v[i]
        if i == 0:
            return v[0]
        j = min(i, len(b) - 1)  # past the last point: the last segment, extended
        return v[j - 1] + (v[j] - v[j - 1]) * (batch - b[j - 1]) / (b[j] - b[j - 1])

    def request_time(self, prompt_tokens: int) -> float:
        """From the client to the engine's queue, for a prompt of `prompt_tokens` tokens."""
        return self.frontend["request_s"] + self.frontend["per_prompt_token_s"] * prompt_tokens

    def request_host_time(self, prompt_tokens: int) -> float:
        """The server's host work for a request of `prompt_tokens` tokens, paid by the steps running beside it."""
        return self.frontend["request_host_s"] + self.frontend["request_host_per_token_s"] * prompt_tokens

    def chunk_extra(self, tokens: int, batch: int, context: int) -> float:
        """What one prompt chunk of `tokens` tokens (nothing cached) adds to a step of `batch` decodes over `context`
        tokens: the prefill form's step less the decode form's (device seconds)."""
        a, per_token, per_pair, *_ = self._p
        mixed = a + per_token * (tokens + batch) + per_pair * tokens * (tokens + 1) // 2 + self._d[2] * context
        return max(0.0, mixed - self._decode_base(batch) - self._d[2] * context)

    def transfer_time(self, blocks: int, *, local: bool = False) -> float:
        """One pool call moving `blocks` KV blocks (to or from the pool); `local`: a put into the caller's own
        segment."""
        latency, per_block = self._t_local if local else self._t
        return latency + per_block * blocks

    @property
    def local_share(self) -> float:
        """A put into the caller's own segment, per block, as a share of a remote call's (1 without a local rate)."""
        return self._t_local[1] / self._t[1] if self._t[1] > 0 else 1.0

    # --- files -------------------------------------------------------------------------------------------

    def to_dict(self) -> dict:
        return {"name": self.name, "status": self.status, "prefill": self.prefill, "decode": self.decode,
                "transfer": self.transfer, "engine": self.engine, "frontend": self.frontend, **self.meta}

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def from_dict(cls, d: dict, where: str = "profile") -> Profile:
        if not isinstance(d, dict):
            raise NanoforgeError(f"{where}: a profile is a JSON object", param="profile")
        for section, names in _FIELDS.items():
            values = d.get(section)
            if section == "frontend" and values is None:  # optional as a whole
                values = {}
            if section in _OPTIONAL and isinstance(values, dict):
                values = {**_OPTIONAL[section], **values}
            if not isinstance(values, dict):
                raise NanoforgeError(f"{where}: needs a {section!r} object with {', '.join(names)}", param="profile")
            for name in (*names, *(n for n in _DEFAULTS_TO.get(section, ()) if n in values)):
                v = values.get(name)
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                    raise NanoforgeError(f"{where}: {section}.{name} must be a number >= 0, got {v!r}",
                                         param="profile")
            if section == "decode" and values.get("batch_s") is not None:
                _check_batch_points(values["batch_s"], where)
            if section == "engine" and min(values[n] for n in names) < 1:
                raise NanoforgeError(f"{where}: engine.{', engine.'.join(names)} must be >= 1", param="profile")
        status = d.get("status", "measured")
        if status not in ("measured", "derived"):
            raise NanoforgeError(f"{where}: status must be 'measured' or 'derived', got {status!r}", param="profile")
        meta = {k: v for k, v in d.items() if k not in (*_FIELDS, "name", "status")}
        return cls(name=str(d.get("name", where)), status=status, prefill=dict(d["prefill"]),
                   decode=dict(d["decode"]), transfer=dict(d["transfer"]), engine=dict(d["engine"]),
                   frontend=dict(d.get("frontend") or {}), meta=meta)

    @classmethod
    def load(cls, name_or_path: str | Path | None = None) -> Profile:
        """A profile by name (a file under `profiles/`) or path; None: the default (`DEFAULT_PROFILE`)."""
        ref = str(name_or_path or DEFAULT_PROFILE)
        path = Path(ref)
        if not path.is_file():
            path = PROFILE_DIR / f"{ref}.json"
        if not path.is_file():
            known = ", ".join(sorted(p.stem for p in PROFILE_DIR.glob("*.json")))
            raise NanoforgeError(f"no profile {ref!r}: give a JSON file's path or one of {known}", param="profile")
        try:
            d = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise NanoforgeError(f"{path}: not JSON: {e}", param="profile") from None
        return cls.from_dict(d, str(path))


def _check_batch_points(points, where: str) -> None:
    ok = isinstance(points, list) and len(points) >= 2 and all(
        isinstance(p, list) and len(p) == 2 and all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                                    and math.isfinite(x) and x >= 0 for x in p) for p in points)
    if not ok or any(points[i][0] >= points[i + 1][0] for i in range(len(points) - 1)) or points[0][0] < 1:
        raise NanoforgeError(f"{where}: decode.batch_s must be a list of at least 2 [batch, seconds] pairs, batches "
                             f"increasing from >= 1, seconds >= 0", param="profile")


def pool_block_bytes(kv_bytes: int, block_size: int) -> int:
    """Bytes of one block in the KV pool: its K and V, plus the KV connector's header (magic, parent key and the
    block's token ids, 64-byte aligned), as `serve/kv_connector.py` lays a pool object out."""
    return kv_bytes + -(-(24 + 8 * block_size) // 64) * 64


def profiles() -> list[str]:
    """The names of the profiles shipped with nanoforge."""
    return sorted(p.stem for p in PROFILE_DIR.glob("*.json"))
