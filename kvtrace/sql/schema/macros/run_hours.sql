-- Each run's span of traffic in hours: its first arrival to its last step (what figures per
-- hour divide by: diagnosis, variant_verdict, fleet).
CREATE OR REPLACE TEMP MACRO run_hours() AS TABLE
SELECT a.run, (max(s.ts_ns) - min(a.first_arrival)) / 3.6e12 AS hours
FROM (SELECT run, min(arrival_ns) AS first_arrival FROM request_arrived GROUP BY run) a
JOIN step_started s ON s.run = a.run
GROUP BY a.run
