# Two commands for a fresh Debian 12 machine, as root:
#   make try    install everything, then a demo on a real PostgreSQL and a real systemd
#   make test   the whole test suite (unit, integration, system)

PYTHON      ?= /usr/bin/python3
VENV        := .venv
APT_PACKAGES := postgresql systemd-container libsystemd-dev pkg-config gcc python3-dev python3-venv dbus util-linux

.PHONY: try test deps venv lint clean

deps:
	@missing=$$(for p in $(APT_PACKAGES); do dpkg-query -W -f='$${Status}\n' $$p 2>/dev/null | grep -q '^install ok installed' || echo $$p; done); \
	if [ -n "$$missing" ]; then \
		echo "installing:" $$missing; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	fi

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e '.[dev]'
	touch $@

venv: deps $(VENV)/.installed

try: venv
	$(VENV)/bin/python -m tests.harness.demo

test: venv
	$(VENV)/bin/pytest

lint: venv
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
