# Two commands for a newcomer: `make run` and `make test`. Both install what is missing.
PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
MODEL ?=
STAGES ?= 2
HTTP_PORT ?= 8000

.PHONY: install run test lint protos bench clean constraints wheel-check

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

# torch first, by exact version: 2.13.0 resolves to the CPU build kept on local disk here
# (a GPU host gets the CUDA build of the same version). Everything at the versions the suite passed with.
$(VENV)/.installed: pyproject.toml constraints.txt | $(BIN)/python
	$(BIN)/pip install --quiet -c constraints.txt torch==2.13.0
	$(BIN)/pip install --quiet -c constraints.txt -e '.[dev]'
	touch $@

install: $(VENV)/.installed

protos: install
	$(BIN)/python -m stagemesh.protos

lint: install
	$(BIN)/ruff check .

# Test files run side by side, one per core (at most 4 at once): most of the suite waits on processes it started.
# A file runs whole on one worker, so its module-scoped meshes are started once.
test: install
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -ra -n auto --maxprocesses 4 --dist loadfile

# The package as users get it: the wheel's contents, the wheel alone in a fresh venv serving a mesh, every extra
# beside the current openai, fastapi and numpy (scripts/dev/check_wheel.sh). CI runs it after the suite.
wheel-check: install
	PYTHON=$(PYTHON) scripts/dev/check_wheel.sh

run: install
	$(BIN)/stagemesh up --stages $(STAGES) $(if $(MODEL),--model $(MODEL),) $(if $(HTTP_PORT),--http-port $(HTTP_PORT),)

bench: install
	$(BIN)/python scripts/bench.py --quick

# After an upgrade, with the suite green: pin what is installed now.
constraints: install
	{ echo "# The versions the suite last passed with: CI and \`make install\` install with \`-c constraints.txt\`."; \
	  echo "# Regenerate after an upgrade with the suite green: make constraints."; \
	  $(BIN)/pip freeze --exclude-editable | sed -E 's/^torch==([0-9.]+)\+cpu/torch==\1/; s/^([a-z_-]+) @ .*\/[a-z_]+-([0-9][0-9.]*)-.*/\1==\2/' \
	  | sort -f; } > constraints.txt

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
