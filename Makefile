# One task runner for people and CI. `make up` and `make test` work on a fresh clone:
# both install what they need first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
BUF := .tools/node_modules/.bin/buf
STAMP := $(VENV)/.installed

.PHONY: install up test test-fast lint format protos check-protos bench clean

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

$(BUF):
	npm install --silent --no-audit --no-fund --prefix .tools @bufbuild/buf@1.75.0

up: $(STAMP)
	$(BIN)/python -m services.launcher

test: $(STAMP)
	$(BIN)/pytest -q

# The unit tests: no services started as processes, no sshd, SQLite only.
test-fast: $(STAMP)
	MJ_TEST_DATABASES=sqlite $(BIN)/pytest -q -m "not e2e and not sshd" --ignore=tests/system

lint: $(STAMP) $(BUF)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/shellcheck services/backends/ssh/*.sh
	cd protos && ../$(BUF) lint
	$(BIN)/python scripts/gen_protos.py --check

format: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

protos: $(STAMP)
	$(BIN)/python scripts/gen_protos.py

bench: $(STAMP)
	@for b in bench/*.py; do $(BIN)/python $$b; done

clean:
	rm -rf .mj .pytest_cache .mypy_cache .ruff_cache
