# The two commands a newcomer needs; both create or refresh .venv first (scripts/bootstrap).
.PHONY: demo test venv

venv:
	@scripts/bootstrap

demo: venv
	.venv/bin/kvtrace demo

# Two workers, each module kept on one (its fixtures built once): much of the suite waits on
# engines and captures, so even on two cores two workers cut its time by a third or more
# (docs/development.md, Tests). TEST_WORKERS=0: one process. The 20 slowest tests are listed.
TEST_WORKERS ?= 2

test: venv
	.venv/bin/python -m pytest -n $(TEST_WORKERS) --dist loadscope --durations=20
