"""Synthetic hybrid-KDA workloads (``kvtrace synth``): shared system prompts, chats, agent loops.

The workload trace they become is described in ``kvtrace.workloads.workload``. The synthetic generator describes every token stream as content segments (a system prompt, a
user message, a model output...) and derives unit ids from which pieces of which segments a unit
holds and its parent unit (``UnitHasher``), so sharing comes from content, never from
bookkeeping: a chat turn shares exactly the units its history shares with the previous turn.

Lengths are lognormal: ``clamp(round(median * exp(sigma * N(0, 1))), 1, max_prompt_len // 2)``
(system prompts use sigma 0.5); arrivals are Poisson; turns per session are geometric.
Parameters per preset (``kvtrace synth --help`` prints the same, from the same source):

=================  =============  =========  ====  =====  ===============================================================================
parameter          shared-prompt  documents  chat  agent  meaning
=================  =============  =========  ====  =====  ===============================================================================
rate               4.0            1.0        4.0   4.0    mean request arrival rate, requests/s (Poisson; sessions start at rate / turns)
system_prompts     8              8          4     3      distinct system prompts, shared across requests / sessions
system_prompt_len  1024           4096       512   2048   median system-prompt tokens (agent: the tool schemas)
zipf               1.0            1.0        1.0   0.5    popularity skew of the system prompts (Zipf exponent; 0 = uniform)
prompt_len         192            16384      96    256    median tokens a request adds of its own: question / user message / task
output_len         128            256        192   256    median output tokens (agent: of the final answer)
length_sigma       0.8            0.5        0.8   0.8    lognormal shape (sigma of ln length) of per-request lengths
max_prompt_len     8192           65536      8192  8192   prompt cap: a session ends before a turn that would exceed it
turns              -              -          5.0   8.0    mean turns per session (chat) / steps per task (agent), geometric
max_turns          -              -          16    24     cap on turns (steps) per session
think_time         -              -          20.0  2.0    mean seconds from one turn's arrival to the next (half fixed, half exponential)
tool_call_len      -              -          -     48     median output tokens of a tool-calling step
tool_output_len    -              -          -     384    median tokens of a tool result appended to the history
=================  =============  =========  ====  =====  ===============================================================================
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
import random
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from kvtrace.engine_config import MAX_INT64, MAX_REQUEST_TOKENS
from kvtrace.errors import ConfigError
from kvtrace.workloads.workload import Workload, WorkloadRequest

SYSTEM_PROMPT_SIGMA = 0.5
# A bound on every length drawn (each is at most half of it), so that a request and its output
# stay within what a replay runs.
MAX_PROMPT_LEN = MAX_REQUEST_TOKENS // 2
# A workload is generated and held in memory whole: 4M requests is 180 times the Mooncake trace.
MAX_REQUESTS = 1 << 22
# Each request draws its system prompt over all of them: more than any deployment serves.
MAX_SYSTEM_PROMPTS = 1 << 16


# --- synthetic traffic ------------------------------------------------------------------------------

Segment = tuple[int, int]  # (content id, tokens): a stretch of text nobody else wrote


class UnitHasher:
    """Dense chained hash ids for token streams described as segments.

    A unit's id stands for its parent's id plus the (segment, offset, length) pieces it holds,
    exactly as vLLM chains a block hash to its parent and its tokens."""

    def __init__(self, hash_unit: int) -> None:
        self.hash_unit = hash_unit
        self._ids: dict[tuple, int] = {}

    def __len__(self) -> int:
        return len(self._ids)

    def unit_ids(self, segments: Iterable[Segment]) -> list[int]:
        """Ids of the stream's full units (a trailing partial unit has none)."""
        ids: list[int] = []
        parent, pieces, filled = -1, [], 0
        for content, length in segments:
            offset = 0
            while offset < length:
                take = min(length - offset, self.hash_unit - filled)
                pieces.append((content, offset, take))
                offset += take
                filled += take
                if filled == self.hash_unit:
                    parent = self._ids.setdefault((parent, tuple(pieces)), len(self._ids))
                    ids.append(parent)
                    pieces, filled = [], 0
        return ids


@dataclass(frozen=True)
class SharedPromptParams:
    """Single-turn requests, each one of a few shared system prompts plus its own question
    (SGLang's generated-shared-prefix): the system prompts are the hot prefixes."""

    rate: float = 4.0
    system_prompts: int = 8
    system_prompt_len: int = 1024
    zipf: float = 1.0
    prompt_len: int = 192
    output_len: int = 128
    length_sigma: float = 0.8
    max_prompt_len: int = 8192


@dataclass(frozen=True)
class DocumentParams(SharedPromptParams):
    """The seed scenario of vLLM #56794: hot shared system prompts in front of long unique
    documents, each prefilled in several chunks, so mid-prompt checkpoints are taken inside
    every document while the system prompts wait in the cache to be hit again."""

    rate: float = 1.0
    system_prompt_len: int = 4096
    prompt_len: int = 16384
    output_len: int = 256
    length_sigma: float = 0.5
    max_prompt_len: int = 65536


@dataclass(frozen=True)
class ChatParams(SharedPromptParams):
    """Multi-turn chats: turn k+1's prompt is turn k's prompt, its output and a new user
    message, so each session's history is a growing shared prefix."""

    system_prompts: int = 4
    system_prompt_len: int = 512
    prompt_len: int = 96
    output_len: int = 192
    turns: float = 5.0
    max_turns: int = 16
    think_time: float = 20.0


@dataclass(frozen=True)
class AgentParams(ChatParams):
    """Agent loops: a long tool-schema system prompt and a task, then steps whose prompt is the
    previous prompt plus the tool call it produced and the tool's (heavy-tailed) result."""

    system_prompts: int = 3
    system_prompt_len: int = 2048
    zipf: float = 0.5
    prompt_len: int = 256
    output_len: int = 256
    turns: float = 8.0
    max_turns: int = 24
    think_time: float = 2.0
    tool_call_len: int = 48
    tool_output_len: int = 384


PARAM_HELP = {
    "rate": "mean request arrival rate, requests/s (Poisson; sessions start at rate / turns)",
    "system_prompts": "distinct system prompts, shared across requests / sessions",
    "system_prompt_len": "median system-prompt tokens (agent: the tool schemas)",
    "zipf": "popularity skew of the system prompts (Zipf exponent; 0 = uniform)",
    "prompt_len": "median tokens a request adds of its own: question / user message / task",
    "output_len": "median output tokens (agent: of the final answer)",
    "length_sigma": "lognormal shape (sigma of ln length) of per-request lengths",
    "max_prompt_len": "prompt cap: a session ends before a turn that would exceed it",
    "turns": "mean turns per session (chat) / steps per task (agent), geometric",
    "max_turns": "cap on turns (steps) per session",
    "think_time": "mean seconds from one turn's arrival to the next (half fixed, half exponential)",
    "tool_call_len": "median output tokens of a tool-calling step",
    "tool_output_len": "median tokens of a tool result appended to the history",
}


@dataclass(frozen=True)
class _Draft:
    """A request before hashing: when it arrives, what its prompt and output are made of."""

    arrival_s: float
    prompt: tuple[Segment, ...]
    output: Segment
    request_id: str


class _Sampler:
    """The seeded randomness and content ids of one generation."""

    def __init__(self, seed: int, max_len: int) -> None:
        self.rng = random.Random(seed)
        self.max_len = max_len
        self._contents = itertools.count()

    def length(self, median: float, sigma: float) -> int:
        drawn = round(median * math.exp(sigma * self.rng.gauss(0.0, 1.0)))
        return min(max(drawn, 1), self.max_len)

    def segment(self, median: float, sigma: float) -> Segment:
        return next(self._contents), self.length(median, sigma)

    def popular(self, choices: Sequence[Segment], zipf: float) -> Segment:
        weights = [1.0 / (rank + 1) ** zipf for rank in range(len(choices))]
        return self.rng.choices(choices, weights)[0]

    def turns(self, mean: float, cap: int) -> int:
        count = 1
        while count < cap and self.rng.random() >= 1.0 / mean:
            count += 1
        return count

    def gap(self, mean: float) -> float:
        return mean / 2 + self.rng.expovariate(2 / mean) if mean > 0 else 0.0


def _tokens(segments: Iterable[Segment]) -> int:
    return sum(length for _, length in segments)


def _system_prompts(p: SharedPromptParams, sampler: _Sampler) -> list[Segment]:
    return [sampler.segment(p.system_prompt_len, SYSTEM_PROMPT_SIGMA) for _ in range(p.system_prompts)]


def _shared_prompt_sessions(p: SharedPromptParams, sampler: _Sampler) -> Iterator[list[_Draft]]:
    systems = _system_prompts(p, sampler)
    clock = 0.0
    for index in itertools.count():
        clock += sampler.rng.expovariate(p.rate)
        prompt = (sampler.popular(systems, p.zipf), sampler.segment(p.prompt_len, p.length_sigma))
        output = sampler.segment(p.output_len, p.length_sigma)
        yield [_Draft(clock, prompt, output, f"shared-{index}")]


def _chat_sessions(p: ChatParams, sampler: _Sampler) -> Iterator[list[_Draft]]:
    systems = _system_prompts(p, sampler)
    start = 0.0
    for session in itertools.count():
        start += sampler.rng.expovariate(p.rate / p.turns)
        history: tuple[Segment, ...] = (sampler.popular(systems, p.zipf),)
        clock, drafts = start, []
        for turn in range(sampler.turns(p.turns, p.max_turns)):
            prompt = history + (sampler.segment(p.prompt_len, p.length_sigma),)
            if drafts and _tokens(prompt) > p.max_prompt_len:
                break
            output = sampler.segment(p.output_len, p.length_sigma)
            drafts.append(_Draft(clock, prompt, output, f"chat-{session}-{turn}"))
            history = prompt + (output,)
            clock += sampler.gap(p.think_time)
        yield drafts


def _agent_sessions(p: AgentParams, sampler: _Sampler) -> Iterator[list[_Draft]]:
    systems = _system_prompts(p, sampler)
    start = 0.0
    for task in itertools.count():
        start += sampler.rng.expovariate(p.rate / p.turns)
        prompt = (sampler.popular(systems, p.zipf), sampler.segment(p.prompt_len, p.length_sigma))
        steps = sampler.turns(p.turns, p.max_turns)
        clock, drafts = start, []
        for step in range(steps):
            if drafts and _tokens(prompt) > p.max_prompt_len:
                break
            final = step == steps - 1
            output = sampler.segment(p.output_len if final else p.tool_call_len, p.length_sigma)
            drafts.append(_Draft(clock, prompt, output, f"agent-{task}-{step}"))
            prompt += (output, sampler.segment(p.tool_output_len, p.length_sigma))
            clock += sampler.gap(p.think_time)
        yield drafts


@dataclass(frozen=True)
class Preset:
    """A traffic shape. ``pool_fraction`` sizes the default pool so that reusable prefixes
    compete for it. Measured with ``kvtrace replay`` (vllm backend, fixed variant) on 500
    default requests, seed 0, default pool vs 40000 blocks: chat 52.8% vs 75.8% prefix hits,
    agent 80.4% vs 86.5%; shared-prompt 70.1% either way (its pool churns only cold blocks)."""

    params_type: type[SharedPromptParams]
    sessions: object  # (params, sampler) -> Iterator[list[_Draft]], sessions by start time
    pool_fraction: float


PRESETS: dict[str, Preset] = {
    "shared-prompt": Preset(SharedPromptParams, _shared_prompt_sessions, pool_fraction=0.25),
    "documents": Preset(DocumentParams, _shared_prompt_sessions, pool_fraction=0.25),
    "chat": Preset(ChatParams, _chat_sessions, pool_fraction=0.4),
    "agent": Preset(AgentParams, _agent_sessions, pool_fraction=0.15),
}


def preset_params(preset: str, overrides: Mapping[str, object] = {}) -> SharedPromptParams:
    """The preset's parameters with ``overrides`` applied, checked."""
    if preset not in PRESETS:
        raise ConfigError(f"unknown preset {preset!r}", "Presets: " + ", ".join(PRESETS))
    params_type = PRESETS[preset].params_type
    names = {f.name for f in dataclasses.fields(params_type)}
    for name in overrides:
        if name not in names:
            raise ConfigError(f"--{name.replace('_', '-')} does not apply to preset {preset}",
                              f"Preset {preset} takes: " + ", ".join(
                                  "--" + n.replace("_", "-") for n in sorted(names)))
    params = params_type(**overrides)
    for name in names:
        value = getattr(params, name)
        if name == "rate":
            bad, wanted = not 0 < value < math.inf, "positive and finite"
        elif name in ("zipf", "length_sigma", "think_time"):
            bad, wanted = not 0 <= value < math.inf, "at least 0 and finite"
        elif name == "max_prompt_len":
            bad, wanted = not 1 <= value <= MAX_PROMPT_LEN, f"from 1 to {MAX_PROMPT_LEN:,}"
        elif name == "system_prompts":
            bad, wanted = not 1 <= value <= MAX_SYSTEM_PROMPTS, f"from 1 to {MAX_SYSTEM_PROMPTS:,}"
        else:
            bad, wanted = not 1 <= value < math.inf, "at least 1"
        if bad:
            raise ConfigError(f"--{name.replace('_', '-')} must be {wanted}, not {value}",
                              "`kvtrace synth --help` lists each preset's parameters.")
    max_turns = getattr(params, "max_turns", 1)
    if max_turns > params.max_prompt_len:
        raise ConfigError(f"--max-turns {max_turns} is more turns than a session can have: "
                          f"each adds tokens to a prompt capped at {params.max_prompt_len}",
                          "Give --max-turns at most --max-prompt-len.")
    return params


def _first_arrivals(sessions: Iterator[list[_Draft]], count: int) -> list[_Draft]:
    """The ``count`` earliest requests of sessions that start in time order."""
    drafts: list[_Draft] = []
    latest_kept: list[float] = []  # max-heap (negated) of the `count` earliest arrivals so far
    for session in sessions:
        if len(latest_kept) == count and session and session[0].arrival_s > -latest_kept[0]:
            break
        for draft in session:
            drafts.append(draft)
            if len(latest_kept) < count:
                heapq.heappush(latest_kept, -draft.arrival_s)
            elif draft.arrival_s < -latest_kept[0]:
                heapq.heapreplace(latest_kept, -draft.arrival_s)
    order = sorted(range(len(drafts)), key=lambda i: (drafts[i].arrival_s, i))
    return [drafts[i] for i in order[:count]]


def synthesize(preset: str, num_requests: int, seed: int, hash_unit: int,
               overrides: Mapping[str, object] = {}) -> Workload:
    """A deterministic (per seed) hybrid-KDA workload of ``num_requests`` requests."""
    if not 1 <= num_requests <= MAX_REQUESTS:
        raise ConfigError(f"--requests must be from 1 to {MAX_REQUESTS:,}, not {num_requests:,}",
                          "A workload is held in memory whole; generate fewer requests.")
    params = preset_params(preset, overrides)
    sampler = _Sampler(seed, params.max_prompt_len // 2)
    drafts = _first_arrivals(PRESETS[preset].sessions(params, sampler), num_requests)
    hasher = UnitHasher(hash_unit)
    requests = []
    for draft in drafts:
        if not draft.arrival_s * 1e9 <= MAX_INT64:
            raise ConfigError(f"request {draft.request_id} would arrive {draft.arrival_s:.3g} s "
                              "in, beyond a trace's 64-bit clock (292 years)", "Raise --rate.")
        prompt_len = _tokens(draft.prompt)
        units = hasher.unit_ids(draft.prompt + (draft.output,))
        split = prompt_len // hash_unit
        requests.append(WorkloadRequest(
            arrival_ns=round(draft.arrival_s * 1e9), prompt_len=prompt_len, hash_ids=units[:split],
            max_tokens=draft.output[1], output_hash_ids=units[split:], request_id=draft.request_id))
    provenance = {"generator": "kvtrace synth", "preset": preset, "seed": str(seed),
                  "requests": str(num_requests), "hash_unit": str(hash_unit)}
    provenance.update((f.name, str(getattr(params, f.name))) for f in dataclasses.fields(params))
    return Workload("synth", requests, hash_unit, provenance, PRESETS[preset].pool_fraction)


def parameter_table() -> str:
    """The preset parameter table of this module's docstring, rendered from the dataclasses."""
    columns = list(PRESETS)
    defaults = {name: {f.name: f.default for f in dataclasses.fields(PRESETS[name].params_type)}
                for name in columns}
    rows = [["parameter", *columns, "meaning"]]
    for name, meaning in PARAM_HELP.items():
        rows.append([name, *(str(defaults[c].get(name, "-")) for c in columns), meaning])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    rule = "  ".join("=" * w for w in widths)
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    return "\n".join([rule, lines[0], rule, *lines[1:], rule])
