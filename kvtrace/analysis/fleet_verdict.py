"""The fleet section of a report whose runs observed two engines or more: one row per engine
(the ``fleet`` query), each engine's top kvtrace doctor finding, what each pair of replayed
variants is worth summed over the engines it was replayed on, and those as sentences."""

from __future__ import annotations

from kvtrace.analysis.pricing import Pricing
from kvtrace.analysis.queries import Result, run_query, sql_command
from kvtrace.analysis.report_model import Fleet, FleetFix, ReportData, Table, Verdict
from kvtrace.analysis.verdict import advice, tokens_phrase

TOP_FLEET_ENGINES = 3  # engines the fleet verdict names as losing most


def fleet(connection, db: str, pricing: Pricing, verdicts: list[Verdict],
          diagnoses: list) -> Fleet | None:
    """The fleet section of a database whose runs observed two engines or more (else None):
    the ``fleet`` query's rows, each engine's top ``kvtrace doctor`` finding over its runs, and
    the verdicts' pairs summed per pair over the engines whose traffic they replayed."""
    priced = pricing.params()
    rows = pricing.name_given_model(run_query(connection, "fleet", priced))
    if len(rows.rows) < 2:
        return None
    engines = [dict(zip(rows.columns, row)) for row in rows.rows]
    engine_of = {source: row["engine"] for row in engines for source in row["sources"]}
    by_run = {diagnosis.run: diagnosis for diagnosis in diagnoses}
    fleet_tokens: dict[str, int] = {}
    tops: dict[str, list[str]] = {}
    for row in engines:
        tokens: dict[str, int] = {}
        for diagnosis in (by_run[run] for run in row["runs"] if run in by_run):
            for finding in diagnosis.findings:
                tokens[finding.id] = tokens.get(finding.id, 0) + finding.tokens
        for finding_id, count in tokens.items():
            fleet_tokens[finding_id] = fleet_tokens.get(finding_id, 0) + count
        top = min(tokens.items(), key=lambda item: (-item[1], item[0]), default=None)
        row["top_finding"] = top and (f"{top[0]} ({top[1] / row['missed_tokens']:.1%})"
                                      if row["missed_tokens"] else top[0])
        if top:
            tops.setdefault(top[0], []).append(row["engine"])
        row["fixes"] = {}
    pairs: dict[tuple, list[tuple[int, str, dict]]] = {}
    order = {row["engine"]: index for index, row in enumerate(engines)}
    for verdict in verdicts:
        engine = engine_of.get(verdict.row["source"])
        if engine is not None:
            key = tuple(verdict.row[k] for k in ("from_variant", "to_variant", "backend", "mode"))
            pairs.setdefault(key, []).append((order[engine], engine, verdict.row))
            engines[order[engine]]["fixes"][key] = verdict.row
    fixes = [_fleet_fix([member[1:] for member in sorted(members, key=lambda m: m[0])], pricing)
             for members in pairs.values()]
    finding = min(fleet_tokens.items(), key=lambda item: (-item[1], item[0]), default=None)
    return Fleet(
        Table("fleet", f"Fleet: {len(engines)} engines", _fleet_table(engines, list(pairs)),
              "One row per engine (a captured engine core by host:pid and data-parallel rank, "
              "else a trace file), over the runs that observed it: first admissions' hit "
              "rate, the prefill its admitted lookups recomputed, per hour of its traffic and "
              "in GPU-seconds, its share of the fleet's, kvtrace doctor's top finding, and what "
              "each pair of replayed variants saves on it per hour (tokens, GPU-seconds).",
              sql_command(db, "fleet", priced)),
        engines, fixes,
        finding and (finding[0], finding[1], tops.get(finding[0], [])))


def _fleet_fix(members: list[tuple[str, dict]], pricing: Pricing) -> FleetFix:
    """A pair's verdict rows summed over the engines it was replayed on."""
    rows = [row for _, row in members]
    first = rows[0]

    def total(column: str):
        values = [row[column] for row in rows]
        return None if any(value is None for value in values) else sum(values)

    models = sorted({row["cost_model"] for row in rows if row["cost_model"]})
    row = {**first, "source": None, "from_run": None, "to_run": None,
           **{column: total(column) for column in (
               "lookups", "traffic_hours", "from_prefill_tokens", "to_prefill_tokens",
               "prefill_tokens_saved_per_hour", "from_gpu_seconds", "to_gpu_seconds",
               "gpu_seconds_saved_per_hour")},
           "cost_model": ", ".join(models) or None}
    return FleetFix(row, [engine for engine, _ in members], advice(row, pricing))


def _fleet_table(engines: list[dict], pairs: list[tuple]) -> Result:
    columns = ["engine", "runs", "lookups", "hit_rate", "missed_tokens",
               "missed_tokens_per_hour", "gpu_seconds_per_hour", "share_of_fleet_missed",
               "top_finding"]
    names = [f"{old}->{new}" + (f" ({backend})" if len({p[2] for p in pairs}) > 1 else "")
             for old, new, backend, _ in pairs]
    header = columns + [f"{name} {what}" for name in names
                        for what in ("tokens_saved_per_hour", "gpu_seconds_saved_per_hour")]
    rows = []
    for row in engines:
        saved = []
        for pair in pairs:
            fix = row["fixes"].get(pair)
            saved += ([fix["prefill_tokens_saved_per_hour"], fix["gpu_seconds_saved_per_hour"]]
                      if fix else [None, None])
        rows.append((row["engine"], ", ".join(map(str, row["runs"])),
                     *(row[column] for column in columns[2:]), *saved))
    return Result(header, rows)


def fleet_lines(data: ReportData) -> list[str]:
    """The fleet verdict: the engines that lose most, what each fix is worth summed over the
    engines it was replayed on, and the finding that costs the fleet most."""
    fleet_data = data.fleet
    lines = []
    losing = []
    for row in fleet_data.engines[:TOP_FLEET_ENGINES]:
        rate = (f"{row['gpu_seconds_per_hour']:,.3g} GPU-seconds per hour"
                if row["gpu_seconds_per_hour"] is not None else
                f"{tokens_phrase(row['missed_tokens_per_hour'] or 0)} prefill tokens per hour"
                if row["missed_tokens_per_hour"] is not None else
                f"{row['missed_tokens']:,} prefill tokens")
        share = (f", {row['share_of_fleet_missed']:.0%} of the fleet's missed prefill"
                 if row["share_of_fleet_missed"] is not None else "")
        top = f"; top finding {row['top_finding']}" if row["top_finding"] else ""
        losing.append(f"{row['engine']} ({rate}{share}{top})")
    lines.append(f"The engines that lose most, of {len(fleet_data.engines)}: "
                 + "; ".join(losing) + ".")
    for fix in fleet_data.fixes:
        row = fix.row
        lines.append(f"{row['from_variant']} -> {row['to_variant']} ({row['backend']}, "
                     f"{row['mode']}) replayed on {len(fix.engines)} of "
                     f"{len(fleet_data.engines)} engines ({', '.join(fix.engines)}), summed: "
                     f"{fix.advice}")
    if not fleet_data.fixes:
        lines.append("No engine's traffic was replayed under two variants: replay each "
                     "engine's capture (kvtrace replay CAPTURE --variant unfixed --variant "
                     "fixed --db DB) to see what a fix is worth over the fleet.")
    if fleet_data.finding:
        finding_id, tokens, engines = fleet_data.finding
        from kvtrace.analysis.diagnosis import BY_ID

        where = f", the top finding on {', '.join(engines)}" if engines else ""
        lines.append(f"Across the fleet, kvtrace doctor's costliest finding is {finding_id} "
                     f"({tokens:,} prefill tokens{where}): {BY_ID[finding_id].action}")
    return lines
