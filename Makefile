# Two commands set everything up on a fresh machine:  make demo  and  make test.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch is a test/dev dependency only, pinned to the CPU build that lies on local disk.
TORCH_SPEC ?= torch==2.13.0
# The demo's prompt; backslash escapes (\n) are expanded (printf %b).
PROMPT ?= def fibonacci(n):\n    """Return the n-th Fibonacci number."""

.PHONY: demo test test-exhaustive install dev bench clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(VENV)/.installed: $(VENV)/bin/python pyproject.toml
	$(PY) -m pip install -q -e .
	touch $@

$(VENV)/.dev-installed: $(VENV)/.installed
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

install: $(VENV)/.installed
dev: $(VENV)/.dev-installed

demo: $(VENV)/.installed
	$(VENV)/bin/jaxdecode generate --model demo --prompt "$$(printf '%b' '$(PROMPT)')" --max-tokens 160 \
		--temperature 0.8 --top-p 0.95 --repetition-penalty 1.1 --seed 0

# pytest exits 5 when it collects no test; that must not pass silently, nor crash make's logic.
# Two workers (pytest-xdist), whole files each: module fixtures compile once per file.
PYTEST_WORKERS ?= 2
test: $(VENV)/.dev-installed
	$(PY) -m pytest -q -p no:cacheprovider -n $(PYTEST_WORKERS) --dist loadfile -m "not exhaustive"; \
	rc=$$?; if [ $$rc -eq 5 ]; then echo "pytest collected no tests (exit 5)"; fi; exit $$rc

# The exhaustive variants (every family at every batch size, slot count and row count); CI runs
# them after `make test`.
test-exhaustive: $(VENV)/.dev-installed
	$(PY) -m pytest -q -p no:cacheprovider -n $(PYTEST_WORKERS) --dist load -m exhaustive; \
	rc=$$?; if [ $$rc -eq 5 ]; then echo "pytest collected no tests (exit 5)"; fi; exit $$rc

bench: $(VENV)/.dev-installed
	$(VENV)/bin/jaxdecode bench --compare-hf --batch 1 --batch 16 --json bench-out/bench.json

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .hypothesis
