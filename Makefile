# The two commands a newcomer needs; both create or refresh .venv first (scripts/bootstrap).
.PHONY: demo test venv

venv:
	@scripts/bootstrap

demo: venv
	.venv/bin/kvtrace demo

test: venv
	.venv/bin/python -m pytest
