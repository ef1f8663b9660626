"""The causes a lookup's missed tokens are attributed to, defined once: each with what it means,
whether it is part of the shortfall (``ideal - hit``) or beyond the ideal, its colour in the
HTML report and the kvtrace doctor finding that owns it (a cause without one is unexplained).
Everything else reads them by name: the attributor and its C core (which is handed the names at
start and finds its own codes among them), the miss_attribution table's enum, the reports. The
definitions in ``kvtrace/analysis/attributor.py``'s module docstring and
``docs/miss-attribution.md`` say how each is measured.

The shortfall causes, in the order they are defined here, are the waterfall: the order in which
the ideal cache's restrictions are applied (``SHORTFALL_CAUSES``). Where the causes beyond the
ideal sit among them changes no figure.
"""

from __future__ import annotations

from typing import NamedTuple


class Cause(NamedTuple):
    name: str  # also a value of the DuckDB enum of miss_attribution.cause
    in_shortfall: bool  # a restriction of the waterfall (else beyond the ideal)
    colour: str  # its bars in the HTML report
    mechanism: str | None  # the kvtrace doctor finding that owns it (diagnosis.MECHANISMS)
    description: str


DEFINITIONS = (
    # The last token is always recomputed: a hit stops below the query's last token.
    Cause("hit_cap", True, "#8064a2", 'hash-unit-exceeds-prompts',
          "the last token is always recomputed, so a hit stops at the hash boundary before it "
          "(vLLM caps a hit at num_tokens - 1)"),
    # use_eagle: the hit search drops its last matched unit (EAGLE/MTP).
    Cause("eagle_dropped_unit", True, "#5b3f80", 'eagle-dropped-unit',
          "the engine drops the last matched unit of every hit for EAGLE/MTP drafting (vLLM's "
          "use_eagle: one hash unit with fine-grained hits, else one attention block), so the "
          "drafter recomputes it"),
    # Hits land on blocks: no key at a depth inside an attention block. The causes from here
    # to `other` are carried by keys (the key classes).
    Cause("block_quantisation", True, "#4bacc6", 'hash-unit-exceeds-prompts',
          "hits land on block boundaries: full attention keeps a key only for a whole block or "
          "a prompt's own tail, and the prompt or shared prefix ends inside a block"),
    Cause("mamba_not_reserved", True, "#f79646", 'mamba-state-not-retained',
          "no Mamba state was ever computed at that depth (no chunk ended there and no "
          "checkpoint was reserved there)"),
    Cause("mamba_not_retained", True, "#fac090", 'mamba-state-not-retained',
          "a Mamba state was computed at that depth but the retention policy kept no key for it "
          "(retention 0 keeps states only at a prompt's end and the shared-prefix junction)"),
    Cause("mamba_suppressed", True, "#ffc000", 'prompt-end-keys-stripped',
          "the checkpoint at that depth was kept request-local by the variant (#56794's gate), "
          "or its stale key stripped"),
    Cause("rekeyed", True, "#b7dee8", None,
          "the block holding the key was re-keyed to a longer prefix (a partial block that "
          "filled up, or a checkpoint slot re-keyed to its checkpoint position)"),
    Cause("invalidated", True, "#7f7f7f", None,
          "the key was removed by a KV connector, a prefix-cache reset, or a source that does "
          "not say why"),
    Cause("checkpoint_pushout", True, "#c0504d", 'checkpoint-pushout',
          "evicted by LRU reuse while transient checkpoints sat cached in the free queue behind "
          "it"),
    Cause("evicted", True, "#e6b9b8", 'pool-pressure',
          "the full-attention block was evicted by LRU reuse"),
    Cause("mamba_evicted", True, "#ccc1da", 'pool-pressure',
          "the Mamba state was evicted by LRU reuse"),
    # What the model of vLLM's hit search does not explain: the waterfall's last.
    Cause("other", True, "#000000", None,
          "the recorded hit is below what the cache held (not explained by kvtrace's model of "
          "vLLM's hit search: e.g. a connector's hit cap)"),
    Cause("cold", False, "#d9d9d9", 'unique-prompts',
          "no earlier request had computed these hash units"),
    Cause("partial_unit", False, "#bfbfbf", 'hash-unit-exceeds-prompts',
          "the query ends inside a hash unit: no hash covers its last tokens"),
    Cause("short_prompt", False, "#a6a6a6", 'hash-unit-exceeds-prompts',
          "the query is shorter than one hash unit: no hash covers any of it"),
)

CAUSES = tuple(cause.name for cause in DEFINITIONS)
# The waterfall, in the order its restrictions are applied.
SHORTFALL_CAUSES = tuple(cause.name for cause in DEFINITIONS if cause.in_shortfall)
BEYOND_IDEAL_CAUSES = tuple(cause.name for cause in DEFINITIONS if not cause.in_shortfall)
DESCRIPTIONS = {cause.name: cause.description for cause in DEFINITIONS}
HIT_COLOUR = "#9bbb59"  # the hit itself, beside the causes in the report's bars
COLOURS = {cause.name: cause.colour for cause in DEFINITIONS}
CAUSE_MECHANISMS = {cause.name: cause.mechanism for cause in DEFINITIONS if cause.mechanism}
