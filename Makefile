# Two commands for a fresh Debian 12 machine, as root:
#   make try    install everything, then a demo on a real PostgreSQL and a real systemd
#   make test   the whole test suite (unit, integration, system, package, vm): unit and integration
#               three times, with the newest dependencies from PyPI (.venv), with Debian 12 bookworm's
#               own packages (.venv-debian) and with Debian 13 trixie's (test-trixie, in a chroot);
#               package and vm with the first, system with the second; in six passes at once
#               (below, and README, Tests)

PYTHON      ?= /usr/bin/python3
VENV        := .venv
APT_PACKAGES := postgresql systemd-container libsystemd-dev pkg-config gcc python3-dev python3-venv dbus util-linux
# The fleet protocol's model (model/fleet.pml) is checked by spin: `make model`, tests/unit/test_model.py.
APT_PACKAGES += spin
# The manual page is rendered by man as lintian renders it (tests/unit/test_manpage.py).
APT_PACKAGES += man-db
# The package tests (tests/package): the .deb's build dependencies (debian/control), lintian, and
# debootstrap for the clean-room install.
APT_PACKAGES += build-essential dpkg-dev debhelper dh-python pybuild-plugin-pyproject python3-all python3-setuptools \
	python3-click python3-psycopg python3-pystemd python3-sdnotify python3-pytest python3-pytest-mock \
	lintian debootstrap python3-prometheus-client
# piuparts installs, removes and purges the .deb in a minimal bookworm and trixie (tests/package/test_piuparts.py).
APT_PACKAGES += piuparts
# The metrics tests run a real Prometheus and promtool (tests/system/test_metrics.py). Installed without
# its Recommends (prometheus-node-exporter, one more daemon nobody asked for); the prometheus.service
# the package enables is never used by the tests, which start their own, and is masked in test beds.
APT_NO_RECOMMENDS := prometheus
# The VM tier (tests/vm): a Debian 13 guest under qemu's software emulation, its image built with
# debootstrap (above) and qemu-img. Without recommends: qemu's are display, audio and firmware for
# guests with devices this one does not have.
APT_NO_RECOMMENDS += qemu-system-x86 qemu-utils
# bookworm's python3-psycopg 3.1.7, python3-pystemd 0.11.0, python3-sdnotify 0.3.1, python3-click 8.1.3,
# python3-prometheus-client 0.16.0
DEBIAN_PY_PACKAGES := python3-psycopg python3-pystemd python3-sdnotify python3-click python3-pytest python3-pytest-mock \
	python3-prometheus-client

.PHONY: try test test-debian test-trixie deps venv venv-debian lint clean model

deps:
	@missing=$$(for p in $(APT_PACKAGES) $(DEBIAN_PY_PACKAGES); do dpkg-query -W -f='$${Status}\n' $$p 2>/dev/null | grep -q '^install ok installed' || echo $$p; done); \
	if [ -n "$$missing" ]; then \
		echo "installing:" $$missing; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	fi
	@missing=$$(for p in $(APT_NO_RECOMMENDS); do dpkg-query -W -f='$${Status}\n' $$p 2>/dev/null | grep -q '^install ok installed' || echo $$p; done); \
	if [ -n "$$missing" ]; then \
		echo "installing (without recommends):" $$missing; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing; \
	fi

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e '.[dev]'
	touch $@

venv: deps $(VENV)/.installed

# Debian's python3-* packages through --system-site-packages; only the project itself is installed.
.venv-debian/.installed: pyproject.toml
	$(PYTHON) -m venv --system-site-packages .venv-debian
	.venv-debian/bin/pip install -q --no-deps --no-build-isolation -e .
	touch $@

venv-debian: deps .venv-debian/.installed

try: venv
	$(VENV)/bin/python -m tests.harness.demo

# Each level runs once where a second pass adds nothing: the unit and integration tests with each set
# of libraries (the newest from PyPI, and Debian's, which the .deb runs on: bookworm's in
# test-pass-debian and trixie's in test-trixie, the same selection in both), the package and VM tests
# with the newest (the .deb itself runs on Debian's, bookworm's or trixie's, inside its clean room or
# guest; the two share one build of it, in build/deb: tests/package/conftest.py), and the system tests with Debian's
# own, the versions a real host runs the daemon with. Running the system tests a second time with
# PyPI's versions cost about ten minutes of CI for a daemon whose library calls the unit and
# integration tests already cover on both.
# The two-million-run migration (tests/integration/test_migrate_big.py, a minute or more of PostgreSQL)
# runs once too: it tests SQL and the migration runner's session settings, not a library's version;
# and so does the protocol's model (tests/unit/test_model.py, spin: about 2 minutes).
#
# The passes run at once (tests/run-passes), each a make target of its own with its output in
# build/test-logs/<target>.log, printed in full when it ends; `make test` fails if any pass fails, and
# ends with each pass's wall-clock and CPU time. One after the other they took 53 minutes of the 2-core
# machine; the system tests spend most of theirs waiting (containers booting, daemons' timeouts, gates)
# while the other passes compute (PostgreSQL, qemu's emulation, spin), so at once they take about as
# long as the longest pass: in the measured run of 0.7.0 the PyPI pass, 32 minutes, with the VM tier
# in it; the VM tier is now a pass of its own (test-vm), which takes the VM tier's 8 minutes or so
# off that longest pass and adds no CPU (one .deb build for both, no second boot): expected 24 to 27
# minutes in all, not yet measured as a whole (README, Tests, has the figures). test-vm yields too:
# its qemu would otherwise take both cores from the system tests. The passes in TEST_YIELDING get
# a quarter of the CPU weight of the system tests when both want it: those are proven beside one
# core's load (`make test-system-stress`), not beside two.
# One more pass (as test-trixie was) is one more target: add it to TEST_PASSES, and to TEST_YIELDING
# unless it waits on timeouts as the system tests do. Each target also runs alone: `make test-pass-pypi`.
# 0.9.0: the package tests are a pass of their own (test-pass-package). In the fresh-clone run of 0.9.0
# before the split, test-pass-pypi ran them after its integration tests, one after the other, and was the
# long pole of the whole run by most of a quarter of an hour (README, Tests).
TEST_PASSES   := test-pass-system test-pass-debian test-pass-pypi test-pass-package test-vm test-trixie
TEST_YIELDING := test-pass-debian test-pass-pypi test-pass-package test-vm test-trixie
PYTEST_REPORT := --durations=30
.PHONY: test test-pass-pypi test-pass-package test-pass-debian test-pass-system
test: venv venv-debian
	MAKE="$(MAKE)" tests/run-passes $(addprefix --yield ,$(TEST_YIELDING)) $(TEST_PASSES)

# The newest libraries (.venv): unit, integration (the big migration included) and model.
test-pass-pypi: venv
	$(VENV)/bin/pytest $(PYTEST_REPORT) -m "not system and not vm and not package"

# The Debian package (tests/package): its build, lintian and piuparts for both releases, the clean room,
# the upgrade from the previous release and the README carried out on two hosts; the .venv outside the
# containers. Mostly apt and dpkg in containers, beside the computing passes.
test-pass-package: venv
	$(VENV)/bin/pytest $(PYTEST_REPORT) -m package

# Debian's own versions, bookworm's (.venv-debian) here and trixie's in test-trixie: unit and integration,
# the same selection for both (DEBIAN_SELECTION), so that a test that passes with one release's packages
# is run with the other's too.
DEBIAN_SELECTION := -m "not system and not package and not vm and not model" \
	--deselect tests/integration/test_migrate_big.py
test-pass-debian: venv-debian
	.venv-debian/bin/python -m pytest -p no:cacheprovider $(PYTEST_REPORT) $(DEBIAN_SELECTION)

# Debian's libraries (.venv-debian): the system tests (test beds, fleets, the nemesis's short schedule).
test-pass-system: venv-debian
	.venv-debian/bin/python -m pytest -p no:cacheprovider $(PYTEST_REPORT) -m system

# Debian 13's own versions (trixie's python3 3.13, its python3-* packages and PostgreSQL 17): what
# test-pass-debian runs with bookworm's, the same DEBIAN_SELECTION (unit and integration; the
# two-million-run migration once, in test-pass-pypi), in a trixie chroot (tests/harness/trixie.py,
# cached in /var/cache/unitvisor-tests, built when missing) entered with systemd-nspawn, the checkout
# bound in read-only; the integration tests' PostgreSQL runs in there, and the CLI as trixie's
# `python3 -m supervisor`. The two passes select the same tests: compare
# `make test-pass-debian PYTEST_REPORT=--collect-only` with `make test-trixie PYTEST_REPORT=--collect-only`.
# TRIXIE_TESTS narrows it (`make test TRIXIE_TESTS=tests/unit` for a quick run); `make test` and so CI run
# the whole selection. 0.9.0's fresh-clone run with it took 24.6 minutes for this pass and pushed the
# others past CI's 45; since the .deb's builds no longer run spin (0.10.0) it fits: 0.11.0's fresh-clone
# run took 23.4 minutes for this pass beside the others and 30.2 for .ci/run. README, Tests.
TRIXIE_TESTS ?=
test-trixie: venv
	$(VENV)/bin/python -m tests.harness.trixie $(PYTEST_REPORT) $(DEBIAN_SELECTION) $(TRIXIE_TESTS)

# The VM tier, a pass of `make test` of its own: the .deb in a real cgroup-v2 Debian 13 guest (tests/vm),
# with the newest libraries (.venv) outside the guest. It starts at once with the others and is the
# first to want the .deb, so it usually builds it while the PyPI pass runs its unit and integration
# tests; the package tests then take that build (build/deb, under flock) instead of building it again.
.PHONY: test-vm
test-vm: venv
	$(VENV)/bin/pytest $(PYTEST_REPORT) -m vm

test-debian: venv-debian
	.venv-debian/bin/python -m pytest -p no:cacheprovider -m "not package and not vm"

# The Debian package, from this checkout: build/deb/unitvisor_<version>_all.deb
.PHONY: deb
deb:
	packaging/build-deb

# The claim / epoch / heartbeat / takeover / self-fence protocol, checked by spin: the model verifies,
# and each mutant fails (docs/fleet.md, The model).
model: deps
	model/verify

lint: venv
	$(VENV)/bin/ruff check .

# Benchmarks against systemd's own limit (never part of `make test`): docs/benchmarks.md.
# About 40 minutes in all on a loaded machine (docs/benchmarks.md): 24 for the single-host figures
# (9 before the run sandbox, on the machine alone; the peers of (8) add a few), then about 2 for the
# fleet's, 6 to 10 for history's and about 6 for the simulated fleet's; `.venv/bin/python -m bench.run
# --tiny` runs every figure in seconds.
# `make bench` reproduces every figure of docs/benchmarks.md: the single-host figures, what each part
# of a run's unit costs systemd (bench.unit_cost, 2 minutes), then the fleet's, then history's, then the
# simulated fleet's (one after the other: all load this machine's cores).
# `make bench-fleet` re-measures only the fleet's (about 2 minutes), e.g. after a change to claims or
# dead-host timing; `make bench-history` only a million finished runs and their pruning (6 to 10 minutes,
# PostgreSQL only); `make bench-scale` only the simulated hosts (100, 300 and 1,000, beside a baseline);
# `--tiny` in seconds.
# The peers of (8), pgqueuer workers (bench/peers.py), run from a virtualenv of their own,
# .venv-bench-peers (bench/peers-requirements.txt): never unitvisor's, nor in pyproject or debian/control.
# bench.run makes it itself when it is missing or older than the requirements (so `--tiny` and the
# smoke test work on a fresh checkout); `make bench-peers-venv` does only that.
.PHONY: bench bench-fleet bench-history bench-scale bench-peers-venv
bench: venv bench-peers-venv
	$(VENV)/bin/python -m bench.run
	$(VENV)/bin/python -m bench.unit_cost
	$(VENV)/bin/python -m bench.fleet
	$(VENV)/bin/python -m bench.history
	$(VENV)/bin/python -m bench.scale

bench-peers-venv: venv
	$(VENV)/bin/python -m bench.peers_env

bench-fleet: venv
	$(VENV)/bin/python -m bench.fleet

bench-history: venv
	$(VENV)/bin/python -m bench.history

# Real daemons against one PostgreSQL, systemd faked at its adapter (PostgreSQL only): what an idle fleet
# costs the database, what a submit wakes, a burst, and runs that cannot start (docs/benchmarks.md, Fleet
# at scale (simulated)). Each size twice in the one run: first the daemons and migrations of
# SCALE_BASELINE (a commit, unpacked with git archive into build/scale-baseline), then this checkout's.
# The baseline is measured at SCALE_BASELINE_FLEETS only: its burst at 300 hosts already held a 2-core
# machine at load 323 for six minutes and declared 231 live hosts dead (docs/benchmarks.md, 0.8.0
# measured); at 1,000 it would take most of an hour to show the same failure larger. 1,000 daemons need
# max_connections 2,020 (two a host, the bench sets it).
SCALE_BASELINE ?= d60b583
SCALE_FLEETS   ?= 100,300,1000
SCALE_BASELINE_FLEETS ?= 100,300
SCALE_BURST    ?= 10000
bench-scale: venv
	rm -rf build/scale-baseline && mkdir -p build/scale-baseline
	git archive $(SCALE_BASELINE) | tar -x -C build/scale-baseline
	$(VENV)/bin/python -m bench.scale --fleets $(SCALE_FLEETS) --burst $(SCALE_BURST) --baseline build/scale-baseline \
		--baseline-fleets $(SCALE_BASELINE_FLEETS)

# The system tests three times in a row beside a CPU load (stress-ng on one of the two cores): the
# proof that no system test depends on catching a short moment on a quiet machine. Not part of
# `make test` (about half an hour).
.PHONY: test-system-stress
test-system-stress: venv
	@command -v stress-ng >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq stress-ng)
	stress-ng --cpu 1 --timeout 3h --quiet & stress=$$!; \
	for round in 1 2 3; do echo "round $$round"; $(VENV)/bin/pytest -q -p no:cacheprovider -m system || { kill $$stress; exit 1; }; done; \
	kill $$stress

# The nemesis (docs/fleet.md, "Nemesis"): three test bed hosts on one PostgreSQL under a random, seeded
# schedule of faults and operator actions while runs flow, then an audit of the whole history. Not part
# of `make test` (CI runs a short schedule, tests/system/test_nemesis.py). NEMESIS_MINUTES (default 30),
# NEMESIS_SEED (default: a new one, printed); the report and the history go to build/nemesis/seed-N/.
# The hosts run the real .deb (build/deb, built by packaging/build-deb when the checkout changed), so
# that apt_upgrade and apt_remove are real dpkg runs; CI's short schedule keeps stand-ins for them.
# Exits 1 when the checker found a violation.
NEMESIS_MINUTES ?= 30
NEMESIS_SEED    ?=
.PHONY: nemesis
nemesis: venv
	$(VENV)/bin/python -m tests.harness.nemesis --minutes $(NEMESIS_MINUTES) $(if $(NEMESIS_SEED),--seed $(NEMESIS_SEED))

clean:
	rm -rf $(VENV) .venv-debian .venv-bench-peers build *.egg-info .pytest_cache .ruff_cache
