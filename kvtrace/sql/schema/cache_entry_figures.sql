-- What a cache entry adds to its store (the relation named by the placeholder store): the
-- figures of the cache_entries view, its enums named (placeholders filled by database.py from
-- kvtrace.events' enums).
f.removed_seq, f.removed_step,
{removed_reason} AS removed_reason,
{position_class} AS position_class,
coalesce({store}.kind = 'CHECKPOINT' AND f.position_class_code = {transient_code}, false)
    AS transient,
f.hits, f.last_hit_seq, f.last_hit_step, f.transient_cached
