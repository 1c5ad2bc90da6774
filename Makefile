# Stovepipe — every command a newcomer needs. `make help` lists them.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# pytest processes to run the modules in (each module whole, in one of them); 0: pytest's
# own process. The tests mostly wait, so 4 on 2 cores finish first: 17.6 min on a fresh
# clone, 19.9 with 3 (README, Tests)
TEST_PROCESSES ?= 4

.DEFAULT_GOAL := help

.PHONY: help
help: ## List the targets
	@grep -hE '^[a-z][a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | \
	  awk 'BEGIN {FS = ":.*## "}; {printf "  \033[36m%-12s\033[0m %s\n", $$1, $$2}'

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	@touch $(STAMP)

.PHONY: venv
venv: $(STAMP) ## Create .venv and install Stovepipe with its dev tools

# The end of a recipe that listed the Debian packages it lacks in $$missing: installs
# them as root, else says the command and fails. $(1) names what was checked.
apt_install_missing = if [ -z "$$missing" ]; then echo "$(1): present"; \
  elif [ "$$(id -u)" = 0 ]; then \
    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $$missing; \
  else echo "missing:$$missing — run 'sudo apt-get update && sudo apt-get install -y$$missing'" >&2; exit 1; fi

.PHONY: system-deps
system-deps: ## Install PostgreSQL, git, Chromium and faketime from Debian's packages when missing (root)
	@missing=""; \
	ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || command -v initdb >/dev/null 2>&1 || missing="$$missing postgresql"; \
	command -v git >/dev/null || missing="$$missing git"; \
	command -v faketime >/dev/null || missing="$$missing faketime"; \
	command -v chromium >/dev/null || missing="$$missing chromium"; \
	[ -d /usr/share/fonts/truetype/liberation ] || missing="$$missing fonts-liberation"; \
	$(call apt_install_missing,system packages)
	@command -v java >/dev/null || { echo "java (17+) is missing: apt-get install -y openjdk-17-jre-headless" >&2; exit 1; }
	@command -v mvn >/dev/null || { echo "mvn is missing: apt-get install -y maven" >&2; exit 1; }

.PHONY: up
up: venv system-deps ## Start the local Kafka + PostgreSQL stack (idempotent)
	$(BIN)/stovepipe dev up

.PHONY: down
down: venv ## Stop the local stack
	$(BIN)/stovepipe dev down

.PHONY: status
status: venv ## Health of the local stack (non-zero when unhealthy)
	$(BIN)/stovepipe dev status

.PHONY: run
run: up ## Bring up the stack, migrate the database, create the topics
	$(BIN)/stovepipe db migrate
	$(BIN)/stovepipe topics create

.PHONY: demo
demo: venv system-deps ## The whole pipeline on a demo git repository, end to end
	$(BIN)/stovepipe demo

.PHONY: lint
lint: venv ## ruff, mypy and the import-linter contracts (the layers)
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/lint-imports

.PHONY: proto
proto: venv ## Regenerate contract/pb from the .proto files
	$(BIN)/python -m contract.generate

.PHONY: test
# helm (for tests/test_deploy_chart.py) is built beside the tests the first time, not
# before them: the test waits for that build (a lock) when it gets there first
test: venv system-deps lint ## Lint, start what the tests need, run every test (but the image's)
	@mkdir -p test-artifacts; deploy/tools/helm.sh >/dev/null 2>test-artifacts/helm-build.log & \
	$(BIN)/pytest -n $(TEST_PROCESSES) --dist loadfile -m "not image"; status=$$?; \
	wait; exit $$status

.PHONY: helm
helm: ## Build the pinned helm once from its Go module into ~/.cache/stovepipe (about 2 min)
	@deploy/tools/helm.sh >/dev/null

.PHONY: render-deploy
render-deploy: ## Print the Helm chart's manifests with the default values
	@"$$(deploy/tools/helm.sh)" template stovepipe deploy/helm/stovepipe

.PHONY: image-deps
image-deps: ## Install buildah and debootstrap from Debian's packages when missing (root)
	@missing=""; \
	command -v buildah >/dev/null || missing="$$missing buildah"; \
	command -v debootstrap >/dev/null || missing="$$missing debootstrap"; \
	$(call apt_install_missing,image tools)

.PHONY: image
image: image-deps ## Build the container image (buildah; a Debian base made once when no registry answers)
	deploy/image/build.sh

.PHONY: test-deploy
test-deploy: venv system-deps image ## Build the image, run its worker against the local stack
	$(BIN)/pytest -m image

.PHONY: bench
bench: up ## Run the benchmarks (prints figures; about 10 minutes)
	$(BIN)/python bench/runtime_bench.py
	$(BIN)/python bench/pipeline_bench.py
