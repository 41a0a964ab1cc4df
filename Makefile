# Each target does all set-up on a fresh machine: .venv, torch first (never a CUDA swap), then areal.
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
TORCH   := torch==2.13.0
STAMP   := $(VENV)/.installed
# The envs extra (pyproject.toml) beside the test extra: verifiers 0.4.0 pins openai<3 and the test
# extra's openai-agents needs openai>=3; areal uses verifiers' taskset and scoring layer, which
# runs on openai 3, so verifiers goes in with --no-deps after the rest of its requirements here.
ENVS_DEPS := reasoning-gym==0.1.25 openenv-core==0.3.0 'anthropic>=1.0.0' 'gepa>=0.0.6' \
	'h11>=0.16.0' 'httpx2>=2.12.0' 'loguru>=0.7.0' 'math-verify>=0.8.0' mcp==2.0.0 'msgpack>=1.1.2' \
	'prime-pydantic-config[toml]>=0.4.3' 'prime-runs>=0.1.4' 'prime-sandboxes>=0.4.2' \
	'prime-tunnel>=0.1.14' 'pyzmq>=27.1.0' 'renderers[multimodal]>=0.1.12' 'tenacity>=8.5.0' \
	'tomli-w>=1.0.0' 'uvicorn>=0.52.0'
# A machine whose python3 already has a CUDA torch keeps it: the venv sees the system packages and
# torch is not installed (areal asks torch>=2.6, so pip never replaces it). Elsewhere: torch 2.13.0.
CUDA_TORCH := $(shell $(PY) -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null)

.PHONY: demo test lint typecheck install clean vllm-env gpu-wheels gpu-check

$(VPY):
	$(PY) -m venv $(if $(filter 1,$(CUDA_TORCH)),--system-site-packages) $(VENV)

$(STAMP): $(VPY) pyproject.toml
	@# bubblewrap: the code sandbox's namespaces (areal/reward/sandbox.py, docs/sandbox.md)
	command -v bwrap >/dev/null || (test "$$(id -u)" = 0 && (apt-get install -y -q bubblewrap \
		|| (apt-get update -q && apt-get install -y -q bubblewrap))) \
		|| echo 'bubblewrap missing: run apt-get install bubblewrap as root, or set reward.sandbox.isolation=best_effort'
	@# etcd-server: the etcd tier of tests/utils/test_name_resolve.py starts its own etcd on free ports
	command -v etcd >/dev/null || (test "$$(id -u)" = 0 && (DEBIAN_FRONTEND=noninteractive apt-get install -y -q etcd-server \
		|| (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q etcd-server))) \
		|| echo 'etcd-server missing: run apt-get install etcd-server as root, or the etcd registry tests skip'
	@# slurmctld, slurmd, munge: the Slurm launcher's tests run a two-node cluster of their own (tests/launcher/slurm_cluster.py)
	test -x /usr/sbin/slurmctld -a -x /usr/sbin/slurmd -a -x /usr/sbin/munged -a -x /usr/bin/sbatch \
		|| (test "$$(id -u)" = 0 && (DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends slurmctld slurmd slurm-client munge \
		|| (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends slurmctld slurmd slurm-client munge))) \
		|| echo 'Slurm missing: run apt-get install slurmctld slurmd slurm-client munge as root, or the Slurm launcher tests skip'
	@# chromium, chromium-driver: the browser test of `areal view` (tests/examples/test_viewer.py)
	test -x /usr/bin/chromium -a -x /usr/bin/chromedriver || (test "$$(id -u)" = 0 && (DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium chromium-driver \
		|| (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium chromium-driver))) \
		|| echo 'chromium missing: run apt-get install chromium chromium-driver as root, or the viewer browser test skips'
	$(VPY) -m pip install -q --upgrade pip
ifeq ($(CUDA_TORCH),1)
	$(VPY) -m pip install -q -e '.[test]'
	$(VPY) -m pip install -q $(ENVS_DEPS) && $(VPY) -m pip install -q --no-deps verifiers==0.4.0
	$(VPY) -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'the CUDA torch was replaced: ' + torch.__version__)"
else
	$(VPY) -m pip install -q $(TORCH)
	$(VPY) -m pip install -q -e '.[test]'
	$(VPY) -m pip install -q $(ENVS_DEPS) && $(VPY) -m pip install -q --no-deps verifiers==0.4.0
	$(VPY) -c "import torch, sys; v = torch.__version__; sys.exit(0 if v.startswith('2.13.0') else 'torch was replaced: ' + v)"
endif
	touch $(STAMP)

install: $(STAMP)

# vLLM's CPU build in its own venv (.cache/venv-vllm) for the real-vLLM tests (`make test` runs
# it beside the tests); never fails:
# a failed build is recorded and those tests skip with its reason (tests/vllm_env.py, docs/vllm.md)
vllm-env: $(STAMP)
	$(VPY) tests/vllm_env.py

# Before the tests: the formatter, the linter and the type checker (config in pyproject.toml); a
# finding stops the run. pyright runs the node and pyright bundled in the test extra's wheels (no
# network; PYRIGHT_PYTHON_IGNORE_WARNINGS skips its PyPI version check), on areal/api, runtime,
# core, engine, launcher, rollout and serving (~60 s on 2 cores); `make typecheck` runs it alone.
LINT_PATHS := areal tests examples bench  # Python only: ruff would also format Markdown's code
lint: $(STAMP)
	$(VENV)/bin/ruff format --check $(LINT_PATHS)
	$(VENV)/bin/ruff check $(LINT_PATHS)
	PYRIGHT_PYTHON_IGNORE_WARNINGS=1 $(VENV)/bin/pyright

typecheck: $(STAMP)
	PYRIGHT_PYTHON_IGNORE_WARNINGS=1 $(VENV)/bin/pyright

# Two pytest-xdist workers: most tier-2 tests wait on processes they started, so two at a time
# halve the wall time on 2 cores; tests/conftest.py's scheduler keeps each module, and the modules
# sharing a Ray cluster, a session fixture, vLLM or the sandbox's uid, on one worker.
# The vLLM venv (vllm-env above, mostly a download: ~3 minutes) builds in its own session beside
# the lint and the tests; the vLLM tests wait for it (tests/vllm_env.py wait_built). When the run
# ends, however it ends, the build's process group (and the pid, had setsid not yet run) gets
# SIGTERM and its log is printed; a stopped build is rebuilt by the next run.
# compileall first: with PYTHONDONTWRITEBYTECODE set (as on this project's machines) every process
# a test starts would compile the areal modules it imports again (~0.1 s of CPU for a trainer;
# hundreds of processes); compileall writes the .pyc files once and the processes read them.
TEST_WORKERS ?= 2
test: $(STAMP)
	mkdir -p .cache
	setsid $(VPY) tests/vllm_env.py > .cache/vllm-env.log 2>&1 & builder=$$!; \
	trap 'kill -TERM -$$builder $$builder 2>/dev/null; wait $$builder; cat .cache/vllm-env.log' EXIT; \
	trap 'exit 130' INT TERM; \
	$(MAKE) --no-print-directory lint && \
	$(VPY) -m compileall -q areal examples bench tests > /dev/null && \
	$(VPY) -m pytest -q -ra --durations=15 -n $(TEST_WORKERS)

# Wheels (Python 3.12, manylinux x86_64, one version each) of what a bare GPU machine's image lacks,
# into .whl/ (ignored), for gpu-check there; run where pip reaches PyPI (bench/gpu_wheels.py).
gpu-wheels: $(STAMP)
	$(VPY) bench/gpu_wheels.py --out .whl

# On a GPU machine with no network: installs .whl/, then tier-3 tests, every entry point for a few
# steps on one GPU and bench/gpu.py; a table and runs/gpu-check/gpu_check.json (bench/gpu_check.sh).
gpu-check:
	bash bench/gpu_check.sh

demo: $(STAMP)
	$(VENV)/bin/areal quickstart --out runs/quickstart

clean:
	rm -rf $(VENV) runs
