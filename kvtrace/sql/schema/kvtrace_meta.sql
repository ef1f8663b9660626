-- Key/value pairs about the database itself, among them db_schema_version.
CREATE TABLE kvtrace_meta (key VARCHAR PRIMARY KEY, value VARCHAR)
