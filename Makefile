# The two commands of the README: `make demo` and `make test`. Both create .venv and
# install the core and every in-tree plugin first.
#
# torch==2.13.0 is installed first and alone: it is a CPU build on this machine's disk,
# and any requirement that admits a newer torch would pull a multi-GB CUDA build.

VENV    ?= .venv
PYTHON  := $(VENV)/bin/python
PIP     := $(PYTHON) -m pip
TORCH   ?= torch==2.13.0
PLUGINS := $(sort $(dir $(wildcard plugins/*/pyproject.toml)))
STAMP   := $(VENV)/.hookloop-installed
PYTEST_ARGS ?=

.PHONY: demo test bench install clean

install: $(STAMP)

$(STAMP): pyproject.toml $(wildcard plugins/*/pyproject.toml) $(wildcard plugins/*/build_*.sh) Makefile
	test -x $(PYTHON) || python3 -m venv $(VENV)
	$(PIP) install -q --disable-pip-version-check $(TORCH)
	@if [ -x plugins/horovod/build_horovod.sh ]; then PYTHON=$(PYTHON) plugins/horovod/build_horovod.sh; fi
	$(PIP) install -q --disable-pip-version-check -e . $(foreach p,$(PLUGINS),-e $(p)) pytest scikit-learn
	@# DeepSpeed's NVMe offload (async_io op) links libaio: install it where apt-get can.
	@if [ -d plugins/deepspeed ] && command -v apt-get >/dev/null && ! ldconfig -p | grep -q 'libaio\.so '; then \
		(apt-get update -qq && apt-get install -y -qq libaio-dev) || echo "hookloop-deepspeed: could not install libaio-dev; NVMe offload stays unavailable"; fi
	@# DeepSpeed compiles its CPU ops on first use (minutes): do it here, once.
	@if [ -d plugins/deepspeed ]; then DS_ACCELERATOR=cpu $(PYTHON) -m hookloop_deepspeed.build_ops; fi
	touch $@

demo: $(STAMP)
	$(VENV)/bin/hookloop plugins --load
	$(VENV)/bin/hookloop run $(if $(wildcard plugins/ddp),--plugins ddp --devices 2) \
		--default-root-dir .demo examples/digits.py

test: $(STAMP)
	$(PYTHON) -m pytest -q $(PYTEST_ARGS)

bench: $(STAMP)
	$(PIP) install -q --disable-pip-version-check pytorch-lightning==2.6.6 accelerate==1.15.0
	$(PYTHON) benchmarks/loop_overhead.py

clean:
	rm -rf $(VENV) .demo .pytest_cache
