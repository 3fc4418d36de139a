# The two commands of the README, `make demo` and `make test`, and the steps under them.
#
#   make demo      .venv with torch, the core (+ plot extra), ddp, amp and scikit-learn only;
#                  trains examples/digits.py on 2 processes, then plots its metrics
#   make backends  builds Horovod from source and compiles DeepSpeed's CPU ops (minutes)
#   make check     ruff and mypy over the contract (make lint), then the quick tier
#                  (in-process tests, one launched job per strategy family)
#   make test      every in-tree plugin and the backends, then the suite CI runs
#   make test-full the long matrices too; make oracle stores Lightning's reference numbers
#   make docs      the documentation site: mkdocs build --strict into site/
#
# Each step leaves a stamp in .venv, so `make test` after `make demo` goes on from there.
# torch==2.13.0 is installed first and alone: it is a CPU build on this machine's disk,
# and any requirement that admits a newer torch would pull a multi-GB CUDA build.

VENV    ?= .venv
PYTHON  := $(VENV)/bin/python
# --no-compile: pip compiles every file of every wheel on one core (a minute for torch
# alone on 2 cores); COMPILE does it afterwards on every core (20 s for everything, seconds
# when up to date). It matters: where PYTHONDONTWRITEBYTECODE=1 nothing is cached at
# import, and each of the test suite's hundreds of processes would compile torch again
# (measured: `import torch` 5.8 s instead of 2.2 s).
PIP     := $(PYTHON) -m pip --disable-pip-version-check install -q --no-compile
COMPILE  = $(PYTHON) -m compileall -q -j 0 "$$($(PYTHON) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" >/dev/null 2>&1 || true
# The repository's own sources too (editable installs import them from here): compiled
# again whenever they change, which COMPILE in the stamps above would miss.
COMPILE_SRC = $(PYTHON) -m compileall -q -j 0 core plugins tests examples benchmarks >/dev/null 2>&1 || true
TORCH   ?= torch==2.13.0
# The reference for Lightning semantics (tests/oracle): a test dependency only, installed
# with torch pinned beside it so that it cannot pull another torch. hookloop never imports it.
ORACLE  ?= pytorch-lightning==2.6.6
# torchao: the float8 plugin's equality test runs on the CPU (its wheel declares no torch requirement)
TORCHAO ?= torchao==0.18.0
# transformers: tp's Hugging Face plans are checked on a LlamaForCausalLM built from a config
# (tests/test_tp_plan.py; no download), installed with torch pinned beside it
TRANSFORMERS ?= transformers==5.23.0
# torchft: hookloop-ft's fault-tolerant replica groups (tests/test_ft.py runs a real Lighthouse
# and Manager on gloo), installed with torch pinned beside it
TORCHFT ?= torchft==0.2.0
# Ray: hookloop-ray's launcher (tests/test_ray.py runs a real 2-node ray.cluster_utils.Cluster),
# installed with torch pinned beside it
RAY ?= ray==2.60.0
# Streaming and stateful data (tests/test_streaming_data.py resumes each exactly under ddp and
# fsdp): torchdata's StatefulDataLoader, Hugging Face datasets in streaming mode, LitData's
# StreamingDataset. LitData is installed without its dependencies, which name torchvision: PyPI's
# torchvision does not import beside this machine's CPU torch ('operator torchvision::nms does
# not exist') and LitData's streaming dataset does not use it; LITDATA_DEPS are the others.
DATA ?= torchdata==0.11.0 datasets==5.2.0
LITDATA ?= litdata==0.2.76
LITDATA_DEPS ?= lightning-utilities filelock numpy boto3 requests 'urllib3>=1.26' tifffile obstore
# Object storage (tests/test_object_storage.py): fsspec's S3 client against a real S3-compatible
# server, moto in server mode, started by the tests on 127.0.0.1
STORAGE ?= 's3fs==2026.9.0' 'moto[server]==5.2.5'
# The documentation site (mkdocs.yml) and its browser test (tests/test_docs_site.py, which
# drives Debian's chromium through chromium-driver). selenium 4.51.0: 4.52.0 requires a
# certifi newer than the package index has.
DOCS_TOOLS ?= mkdocs==1.6.1 mkdocs-material==9.8.1 pymdown-extensions==13.1
SELENIUM ?= selenium==4.51.0
PLUGINS := $(sort $(dir $(wildcard plugins/*/pyproject.toml)))
DEMO_PLUGINS := $(sort $(dir $(wildcard plugins/ddp/pyproject.toml plugins/amp/pyproject.toml)))
PYTEST_ARGS ?=
# The linters `make check` runs first (make lint), pinned: a newer release's new rules must
# not fail a commit that did not change. LINT_FILES: the contract a plugin author reads, the
# loop (engine/) and its fast path (dispatch.py), clean under ruff and mypy (pyproject.toml).
LINTERS    := ruff==0.17.5 mypy==2.4.1
LINT_FILES := core/hookloop/contract core/hookloop/engine core/hookloop/dispatch.py

TORCH_STAMP    := $(VENV)/.hookloop-torch
DEMO_STAMP     := $(VENV)/.hookloop-demo
BACKENDS_STAMP := $(VENV)/.hookloop-backends
STAMP          := $(VENV)/.hookloop-installed
DOCS_STAMP     := $(VENV)/.hookloop-docs

.PHONY: demo backends lint check test test-full oracle bench install docs clean

$(TORCH_STAMP):
	test -x $(PYTHON) || python3 -m venv $(VENV)
	$(PIP) $(TORCH)
	touch $@

# What the demo needs: the observers (progress bar, CSV log) are in the core.
$(DEMO_STAMP): $(TORCH_STAMP) pyproject.toml $(addsuffix pyproject.toml,$(DEMO_PLUGINS)) Makefile
	$(PIP) -e '.[plot]' $(foreach p,$(DEMO_PLUGINS),-e $(p)) scikit-learn
	$(COMPILE)
	touch $@

backends: $(BACKENDS_STAMP)

# Horovod first: hookloop-horovod requires horovod==0.28.1, which only installs built
# from source (cached in ~/.cache/hookloop/wheels). Then DeepSpeed's CPU ops, which it
# would otherwise compile inside the first run (`hookloop plugins` says when they are not).
$(BACKENDS_STAMP): $(DEMO_STAMP) $(wildcard plugins/*/build_*.sh plugins/deepspeed/pyproject.toml)
	@if [ -x plugins/horovod/build_horovod.sh ]; then PYTHON=$(PYTHON) plugins/horovod/build_horovod.sh; fi
	@# DeepSpeed's NVMe offload (async_io op) links libaio: install it where apt-get can.
	@if [ -d plugins/deepspeed ] && command -v apt-get >/dev/null && ! ldconfig -p | grep -q 'libaio\.so '; then \
		(apt-get update -qq && apt-get install -y -qq libaio-dev) || echo "hookloop-deepspeed: could not install libaio-dev; NVMe offload stays unavailable"; fi
	@if [ -d plugins/deepspeed ]; then \
		$(PIP) -e plugins/deepspeed && DS_ACCELERATOR=cpu $(PYTHON) -m hookloop_deepspeed.build_ops; fi
	touch $@

# Every other in-tree plugin (the demo's and the backends' are already in).
install: $(STAMP)
$(STAMP): $(BACKENDS_STAMP) $(DOCS_STAMP) pyproject.toml $(wildcard plugins/*/pyproject.toml) Makefile
	$(PIP) -e '.[plot,cli,rich]' $(foreach p,$(filter-out $(DEMO_PLUGINS),$(PLUGINS)),-e $(p)) pytest scikit-learn $(ORACLE) $(TORCHAO) $(TRANSFORMERS) $(TORCHFT) $(RAY) $(DATA) $(STORAGE) $(LITDATA_DEPS) $(LINTERS) $(TORCH)
	$(PIP) --no-deps $(LITDATA)
	@# The browser test's Chromium and its driver: Debian's packages, where apt-get can.
	@if command -v apt-get >/dev/null && ! { [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; }; then \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null) \
		|| echo "hookloop: could not install chromium and chromium-driver; tests/test_docs_site.py will fail"; fi
	@# mpirun for the real mpirun run of tests/test_cluster_environments.py: Debian's OpenMPI.
	@if command -v apt-get >/dev/null && ! command -v mpirun >/dev/null; then \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openmpi-bin >/dev/null) \
		|| echo "hookloop: could not install openmpi-bin (mpirun); tests/test_cluster_environments.py's mpirun test will fail"; fi
	$(PIP) $(SELENIUM)
	$(COMPILE)
	touch $@

# The site's tools (the core too: the hook and CLI reference pages are generated from it).
$(DOCS_STAMP): $(DEMO_STAMP) Makefile
	$(PIP) $(DOCS_TOOLS)
	touch $@

demo: $(DEMO_STAMP)
	$(COMPILE_SRC)
	$(VENV)/bin/hookloop plugins
	$(VENV)/bin/hookloop run $(if $(wildcard plugins/ddp),--plugins ddp --devices 2) \
		--default-root-dir .demo examples/digits.py
	@printf 'metrics report: '
	@$(VENV)/bin/hookloop plot .demo

# ruff and mypy over LINT_FILES (their settings: pyproject.toml); make check runs it first.
lint: $(STAMP)
	$(VENV)/bin/ruff check $(LINT_FILES)
	$(VENV)/bin/mypy $(LINT_FILES)

# The tiers are pytest markers (tests/tiers.py, docs/testing.md). make check: the lint,
# every in-process test and one launched job per strategy family, for between two commits.
check: $(STAMP) lint
	$(COMPILE_SRC)
	$(PYTHON) -m pytest -q --tier=check --durations=20 $(PYTEST_ARGS)

# What CI runs (.ci/run): check + every launched job marked slow. Its log ends with the
# slowest tests and the launches and seconds of every test file.
test: $(STAMP)
	$(COMPILE_SRC)
	$(PYTHON) -m pytest -q --tier=test --durations=80 $(PYTEST_ARGS)

# The long matrices, run before resolving an issue: Lightning's own scripts under ddp
# and its slow examples, every strategy x every kill point of the resume certificate, and
# pytorch-lightning run again to check the stored reference numbers.
test-full: $(STAMP)
	$(COMPILE_SRC)
	$(PYTHON) -m pytest -q --tier=full --durations=80 $(PYTEST_ARGS)

# pytorch-lightning's reference numbers, stored beside the cases (tests/stored.py): run
# after changing an oracle case or a Lightning script case, and commit what it writes.
oracle: $(STAMP)
	$(PYTHON) tests/store_references.py $(ORACLE_ARGS)

bench: $(STAMP)
	$(PIP) $(ORACLE) accelerate==1.15.0 $(TORCH)
	$(PYTHON) benchmarks/loop_overhead.py

# The documentation site: docs/*.md and the pages generated from the hook specifications
# and the CLI (docs/site_hooks.py), built strictly (any warning fails) into site/.
docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

clean:
	rm -rf $(VENV) .demo .pytest_cache site
