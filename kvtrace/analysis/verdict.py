"""The verdict: per pair of variants replayed from one source, what moving from one to the
other does to hits, prefill and GPU time on this traffic, and what to do, in one sentence
(``advice``); its figures, title and top pushed-out prefixes as phrases every format shows;
and kvtrace doctor's findings per run, in a line each."""

from __future__ import annotations

from kvtrace.analysis.pricing import Pricing
from kvtrace.analysis.queries import Result
from kvtrace.analysis.report_model import Labels, ReportData, Verdict
from kvtrace.replay.variants import VARIANTS

TOP_VERDICT_PREFIXES = 3
# Below this share of the prefill the moved-from variant recomputes, a pair's difference is
# noise for a verdict.
MATERIAL_SHARE = 0.005


def _role(variant: str) -> str:
    """What ``variant`` stands for in a sentence (``Variant.role``; "" for one not in the table,
    such as a captured engine's own)."""
    return VARIANTS[variant].role if variant in VARIANTS else ""


def verdicts_of(rows: Result, pushouts: Result, labels: Labels,
                pricing: Pricing) -> list[Verdict]:
    """A ``Verdict`` per ``variant_verdict`` row, with its moved-from run's top pushed-out
    prefixes (``pushed_out_prefixes``)."""
    verdicts = []
    prefixes = [dict(zip(pushouts.columns, row)) for row in pushouts.rows]
    for row in map(lambda r: dict(zip(rows.columns, r)), rows.rows):
        top = [p for p in prefixes if p["run"] == row["from_run"]][:TOP_VERDICT_PREFIXES]
        verdicts.append(Verdict(row, labels.source(row["source"]), top, advice(row, pricing)))
    return verdicts


def tokens_phrase(count: float) -> str:
    count = abs(count)
    if count >= 1e6:
        return f"{count / 1e6:,.2f} M"
    return f"{count:,.0f}"


def advice(row: dict, pricing: Pricing) -> str:
    """One sentence: what to do about the pair ``row`` (a ``variant_verdict`` row)."""
    old, new = row["from_variant"], row["to_variant"]
    per_hour = row["prefill_tokens_saved_per_hour"]
    if per_hour is None:
        return (f"No verdict: the runs of {old} and {new} have no scheduler steps to measure "
                "their traffic by.")
    gpu = row["gpu_seconds_saved_per_hour"]
    model = row["cost_model"].removesuffix(" (--model)") if gpu is not None else ""
    cost = (f" ({abs(gpu):,.3g} GPU-seconds per hour of {model} on {pricing.gpu.title})"
            if gpu is not None else " (not priced: give --model)")
    changed = row["from_prefill_tokens"] - row["to_prefill_tokens"]
    if abs(changed) < MATERIAL_SHARE * max(row["from_prefill_tokens"], 1):
        return (f"No action: {new} and {old} recompute within {MATERIAL_SHARE:.1%} of each "
                f"other on this traffic ({per_hour:+,.0f} tokens per hour).")
    amount = f"{tokens_phrase(per_hour)} {'fewer' if per_hour > 0 else 'more'} prefill tokens"
    better, worse = (new, old) if per_hour > 0 else (old, new)
    if better == "naive":
        return (f"naive would recompute {tokens_phrase(per_hour)} "
                f"{'fewer' if better == new else 'more'} prefill tokens per hour{cost}, but "
                "it leaves stale keys that hand a hit the wrong state (`--query "
                "stale_key_hazards`): do not run it; compare the other variants.")
    if old == "unfixed" and new in VARIANTS and VARIANTS[new].gated:
        if per_hour > 0:
            return (f"Upgrade to a release with the #56794 gate ({new}: {_role(new)}): "
                    f"on this traffic it would recompute {amount} per hour{cost}.")
        return (f"The #56794 gate ({new}) would recompute {amount} per hour on this "
                f"traffic{cost}: the transient checkpoints {old} publishes served later hits "
                "here. Size the pool before relying on the gate (`kvtrace sweep` finds the "
                "pool size at which it pays).")
    return (f"Prefer {better} ({_role(better) or 'a variant'}) over {worse}: "
            f"{new} would recompute {amount} per hour than {old} on this traffic{cost}.")


def verdict_lines(verdict: Verdict) -> list[tuple[str, str, str]]:
    """(label, value, the variant_verdict columns behind it) of a verdict's figures."""
    row = verdict.row
    rate = (f"{row['from_hit_rate']:.2%} -> {row['to_hit_rate']:.2%} "
            f"({row['hit_rate_change'] * 100:+.2f} points)")
    hours = row["traffic_hours"]
    lines = [("hit rate", rate, "from_hit_rate, to_hit_rate, hit_rate_change")]
    if hours:
        per_hour = row["prefill_tokens_saved_per_hour"]
        lines.append(("prefill tokens saved per hour",
                      f"{per_hour:+,.0f} ({row['from_prefill_tokens']:,} -> "
                      f"{row['to_prefill_tokens']:,} tokens in {hours * 3600:,.1f} s of "
                      "traffic)",
                      "prefill_tokens_saved_per_hour, from_prefill_tokens, to_prefill_tokens, "
                      "traffic_hours"))
        gpu = row["gpu_seconds_saved_per_hour"]
        lines.append(("GPU-seconds saved per hour",
                      f"{gpu:+,.3g}, priced as {row['cost_model']}" if gpu is not None
                      else "not priced (give --model)",
                      "gpu_seconds_saved_per_hour, cost_model"))
    return lines


def prefix_phrase(prefix: dict) -> str:
    return (f"hash {prefix['hash_id']} ({prefix['depth_tokens']:,} tokens): "
            f"{prefix['evictions']} eviction{'s' if prefix['evictions'] != 1 else ''}, "
            f"{prefix['later_missed_lookups']} missed lookup"
            f"{'s' if prefix['later_missed_lookups'] != 1 else ''}, "
            f"{prefix['regret_tokens']:,} tokens of regret")


def verdict_title(verdict: Verdict) -> str:
    row = verdict.row
    return (f"{row['from_variant']} -> {row['to_variant']} on {verdict.source} "
            f"({row['backend']}, {row['mode']}; runs {row['from_run']} and {row['to_run']})")


def diagnosis_lines(data: ReportData) -> list[str]:
    """Per run, kvtrace doctor's findings (the same diagnosis, without predictions): the top
    ones with their share of the missed prefill and what to change."""
    lines = []
    for diagnosis in data.diagnoses:
        label = data.labels.runs.get(diagnosis.run, str(diagnosis.run))
        if not diagnosis.findings:
            lines.append(f"run {label}: no mechanism reaches {diagnosis.threshold:.0%} of the "
                         "missed prefill")
            continue
        findings = "; ".join(f"{f.id} ({f.share_of_missed:.1%} of the missed prefill)"
                             for f in diagnosis.findings[:TOP_VERDICT_PREFIXES])
        top = diagnosis.findings[0]
        lines.append(f"run {label}: why it misses (kvtrace doctor): {findings}. "
                     f"{top.mechanism.name}: {top.action}")
    return lines
