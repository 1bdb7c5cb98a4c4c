# The two commands a new user runs (see README.md).
.PHONY: serve test lint setup setup-test

serve: setup  ## set up, then start the gateway (tiny built-in demo model when no MODEL and no GPU)
	.venv/bin/voxgate serve $(if $(MODEL),--model $(MODEL)) --host $(or $(HOST),0.0.0.0) --port $(or $(PORT),8080)

test: setup-test  ## set up, then run the CPU test suite and the linter
	.venv/bin/ruff check .
	.venv/bin/python -m pytest -q $(PYTEST_ARGS)

setup:
	scripts/setup.sh

setup-test:
	scripts/setup.sh test
