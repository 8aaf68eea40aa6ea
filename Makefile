# SPDX-License-Identifier: Apache-2.0
# ReusePortLB / udp-fanout. `make demo` and `make test` are the two quick-start commands.
PREFIX ?= /usr/local
DESTDIR ?=
# The version: Sources/ReusePortLB/ProjectVersion.swift is the one place it is written.
VERSION ?= $(shell sed -n 's/.*static let string = "\(.*\)"/\1/p' Sources/ReusePortLB/ProjectVersion.swift)
BUILD_DIR = $(shell PATH=/opt/swift/usr/bin:$$PATH swift build -c release --static-swift-stdlib --show-bin-path 2>/dev/null)

.PHONY: all setup build demo test reliability docs bench bench-compare install install-files uninstall dist dist-check container deb deb-check systemd-check clean print-version

all: build

setup:
	@scripts/setup.sh

# Release binaries and libreuseportlb.so with the Swift runtime linked in (scripts/build-release.sh).
build: setup
	@scripts/build-release.sh

demo: setup
	@scripts/demo.sh

test: setup
	@scripts/test.sh

# The full reliability suite (make test runs its short form); figures in docs/reliability.md.
reliability: setup
	@RELIABILITY=full scripts/test.sh --filter 'Reliability|HTTPEndpoint|TCPacketFuzz'

# The libraries' DocC documentation (Sources/ReusePortLB/Docs.docc, Sources/FanoutCore/Docs.docc),
# built by swift-docc-plugin with DocC's --warnings-as-errors: a broken ``Symbol`` link, in an
# article or a doc comment, fails it (docs/api-documentation.md). It reuses the debug build that
# make test made (.build); DOCS_SCRATCH=DIR builds in a folder of its own instead.
DOCS_SCRATCH ?= .build
DOCS_OUTPUT = $(DOCS_SCRATCH)/plugins/Swift-DocC/outputs
DOCS_BUILD = swift package --scratch-path $(DOCS_SCRATCH) --disable-sandbox generate-documentation

docs:
	@export PATH=/opt/swift/usr/bin:$$PATH; \
	echo "docs: $(DOCS_BUILD) --target ReusePortLB --target FanoutCore --warnings-as-errors"; \
	$(DOCS_BUILD) --target ReusePortLB --target FanoutCore --warnings-as-errors || { \
	  echo "docs: FAILED: the documentation has DocC warnings, shown above as errors (a broken \`\`Symbol\`\` link names the file and line)" >&2; exit 1; }
	@echo "docs: ReusePortLB and FanoutCore documented: $(DOCS_OUTPUT)/ReusePortLB.doccarchive and $(DOCS_OUTPUT)/FanoutCore.doccarchive"
	@echo "docs: to read them: python3 -m http.server -d $(DOCS_OUTPUT)/ReusePortLB.doccarchive, then /documentation/reuseportlb (docs/api-documentation.md)"

bench:
	@WITH_BENCH_PEERS=1 scripts/setup.sh
	@scripts/bench.sh $(BENCH)

# The userspace, tc_ebpf, xdp and af_xdp rows of a change: this tree against BEFORE=<git rev>,
# alternated in one run (scripts/bench_compare.py).
bench-compare:
	@WITH_BENCH_PEERS=1 scripts/setup.sh
	@BEFORE=$(BEFORE) scripts/bench.sh compare

# Builds (release) and installs the C library, its header and reuseportlb.pc.
install: build
	@$(MAKE) --no-print-directory install-files

# Installs what the last build made, without building (the C API test uses it).
install-files:
	install -d $(DESTDIR)$(PREFIX)/lib/pkgconfig $(DESTDIR)$(PREFIX)/include $(DESTDIR)$(PREFIX)/bin
	install -m 0755 $(BUILD_DIR)/libreuseportlb.so $(DESTDIR)$(PREFIX)/lib/libreuseportlb.so.$(VERSION)
	ln -sf libreuseportlb.so.$(VERSION) $(DESTDIR)$(PREFIX)/lib/libreuseportlb.so.0
	ln -sf libreuseportlb.so.0 $(DESTDIR)$(PREFIX)/lib/libreuseportlb.so
	install -m 0644 include/reuseportlb.h $(DESTDIR)$(PREFIX)/include/reuseportlb.h
	install -m 0755 $(BUILD_DIR)/collector $(BUILD_DIR)/publisher $(BUILD_DIR)/udp-fanout $(DESTDIR)$(PREFIX)/bin/
	sed -e 's|@PREFIX@|$(PREFIX)|' -e 's|@VERSION@|$(VERSION)|' pkgconfig/reuseportlb.pc.in \
		> $(DESTDIR)$(PREFIX)/lib/pkgconfig/reuseportlb.pc

uninstall:
	rm -f $(DESTDIR)$(PREFIX)/lib/libreuseportlb.so $(DESTDIR)$(PREFIX)/lib/libreuseportlb.so.0 \
		$(DESTDIR)$(PREFIX)/lib/libreuseportlb.so.$(VERSION) \
		$(DESTDIR)$(PREFIX)/include/reuseportlb.h \
		$(DESTDIR)$(PREFIX)/lib/pkgconfig/reuseportlb.pc \
		$(DESTDIR)$(PREFIX)/bin/collector $(DESTDIR)$(PREFIX)/bin/publisher $(DESTDIR)$(PREFIX)/bin/udp-fanout

# dist/udp-fanout-VERSION-linux-ARCH.tar.gz: binaries, library, header, .pc, units, manifests, docs.
dist: setup
	@VERSION=$(VERSION) scripts/dist.sh

# Runs the tarball's programs and the C API sample with /opt/swift hidden (docs/packaging.md).
dist-check: dist
	@VERSION=$(VERSION) scripts/dist-check.sh

# Builds the container image with buildah on a debootstrap base and runs it (.ci/run runs this too).
container: dist-check
	@VERSION=$(VERSION) scripts/container.sh

# Debian packages from the release build: udp-fanout, libreuseportlb0, libreuseportlb-dev (docs/packaging.md).
deb: setup
	@VERSION=$(VERSION) scripts/deb.sh

# lintian, then install, start as the unit does, and purge in a clean Debian root (.ci/run runs this too).
deb-check: deb
	@VERSION=$(VERSION) scripts/deb-check.sh
	@VERSION=$(VERSION) scripts/systemd-check.sh

# The package under systemd itself, booted by systemd-nspawn: restart and kill -9 under traffic,
# then stop (docs/restarts.md). Uses the packages make deb left in dist/ (deb-check runs it too).
systemd-check: setup
	@VERSION=$(VERSION) scripts/systemd-check.sh

clean:
	swift package clean

# The version every tool and artifact carries (Sources/ReusePortLB/ProjectVersion.swift).
print-version:
	@echo $(VERSION)
