SHELL := /bin/bash

# ngx_http_llama_session_module
#
#   make            build objs/ngx_http_llama_session_module.so against the
#                   distro nginx (Debian nginx-dev, /usr/share/nginx/src)
#   make nodebug    the same against that nginx without --with-debug, as
#                   nginx.org builds its nginx (make test builds it too)
#   make deps       install what the build and the tests need (apt-get);
#                   with NGINX_VERSION=... or ASAN=1 also the apt sources
#                   of the nginx source package to build (make deps-src)
#   make rig        build llama-server and the test model (cached)
#   make test       build + rig + prove (NGINX_VERSION=1.26.3: against
#                   that nginx, built from Debian's source; 1.30.4, 1.31.4:
#                   nginx.org's, from ../shared/nginx/), then the tests that
#                   matter against the next llama.cpp and nginx.org's stable
#   make demo       run llama-server + nginx with the module and show it
#   make bench      the benchmarks (docs/benchmarks.md)
#   make soak       t/40-soak.t with SOAK_REQUESTS (10000) requests
#   make asan       nginx 1.22.1 from Debian's source with AddressSanitizer
#   make test-asan  the suite under that nginx
#   make test-valgrind  the suite with nginx under valgrind
#   make deb        the Debian package, in build/deb/ (DEBIAN=trixie:
#                   Debian 13's, built in a Debian 13 root)
#   make clean

NGINX_SRC   ?= /usr/share/nginx/src
NGINX       ?= /usr/sbin/nginx
MODULE      := objs/ngx_http_llama_session_module.so
SOURCES     := config $(wildcard ngx_http_llama_session_module/*.[ch])
CFLAGS_EXTRA := -Wall -Wextra -Wno-unused-parameter -Werror
DEB_PACKAGES := nginx nginx-dev libcjson-dev libssl-dev openssl python3-numpy perl prometheus \
                debhelper lintian debootstrap \
                dpkg-dev python3-fusepy fuse3 libfuse2
# command:package, installed when the command is missing (npm may come
# with a nodejs of another origin)
DEB_COMMANDS := cmake:cmake git:git npm:npm curl:curl cc:build-essential \
                g++:g++ make:make valgrind:valgrind prove:perl \
                systemd-analyze:systemd
PROVE_FLAGS ?= -v

.PHONY: all deps deps-packages deps-src nodebug rig rig-next rig-stable \
        test test-next test-stable demo \
        bench soak asan \
        test-asan test-valgrind deb clean

all: $(MODULE)

# objs/: the distro nginx's configuration; objs-nodebug/: the same without
# --with-debug, as nginx.org builds its nginx binary: there ngx_log_debug*
# expands to nothing, and what only the debug log uses must not be left
# unused (-Werror).  make test builds both, so it stays so; the second is
# never loaded.
MODULE_NODEBUG := objs-nodebug/ngx_http_llama_session_module.so

objs/Makefile objs-nodebug/Makefile: config
	@test -f $(NGINX_SRC)/conf_flags || { \
	    echo "$(NGINX_SRC) is missing: run 'make deps' (Debian nginx-dev)"; \
	    exit 1; }
	cd $(NGINX_SRC) && . ./conf_flags && flags=() && \
	    for f in "$${NGX_CONF_FLAGS[@]}"; do \
	        [ "$(@D)" = objs-nodebug ] && [ "$$f" = --with-debug ] \
	            || flags+=("$$f"); \
	    done && ./configure \
	    --with-cc-opt="$$(dpkg-buildflags --get CFLAGS) -fPIC $(CFLAGS_EXTRA)" \
	    --with-ld-opt="$$(dpkg-buildflags --get LDFLAGS) -fPIC" \
	    "$${flags[@]}" \
	    --add-dynamic-module="$(CURDIR)" --builddir="$(CURDIR)/$(@D)" \
	    > "$(CURDIR)/$(@D).configure.log" 2>&1 \
	    || { tail -n 30 "$(CURDIR)/$(@D).configure.log"; exit 1; }
	@[ "$(@D)" = objs ] || ! grep -q "define NGX_DEBUG  1" $(@D)/ngx_auto_config.h

$(MODULE) $(MODULE_NODEBUG): %/ngx_http_llama_session_module.so: %/Makefile $(SOURCES)
	$(MAKE) -f "$(CURDIR)/$*/Makefile" -C $(NGINX_SRC) modules

nodebug: $(MODULE_NODEBUG)

deps: deps-packages deps-src

deps-packages:
	@missing=""; \
	for p in $(DEB_PACKAGES); do \
	    dpkg-query -W -f='$${Status}' $$p 2>/dev/null \
	        | grep -q "ok installed" || missing="$$missing $$p"; \
	done; \
	for c in $(DEB_COMMANDS); do \
	    command -v $${c%%:*} >/dev/null || missing="$$missing $${c##*:}"; \
	done; \
	if [ -n "$$missing" ]; then \
	    echo "installing:$$missing"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
	        apt-get install -y -qq --no-install-recommends $$missing; \
	fi

# the apt sources of the Debian nginx source packages that
# rig/build-nginx.sh (NGINX_VERSION) and rig/build-asan-nginx.sh (ASAN=1,
# make asan, make test-asan) fetch, and the apt-get update
# (rig/deb-src.sh): here, before the tests, never in those scripts, which
# only download and build into the cache.  Nothing when the cache has the
# source already.
DEB_SRC := $(NGINX_VERSION) \
           $(if $(ASAN)$(filter asan test-asan,$(MAKECMDGOALS)),asan)

deps-src: deps-packages
	@$(if $(strip $(DEB_SRC)),rig/deb-src.sh $(DEB_SRC),:)

rig: deps
	rig/build-llama-server.sh
	rig/make-model.sh
	rig/make-model.sh 4
	rig/make-model.sh 12
	rig/make-model.sh gemma3
	rig/make-model.sh lfm2
	rig/make-model.sh mmproj
	rig/npm-clients.sh

# the next llama.cpp: node-llama-cpp's newer release (llama.cpp v0.5.0),
# built beside the pinned one into the same cache; LLAMA_NEXT= skips it
LLAMA_NEXT ?= 3.22.1
# the real-backend tests that matter, run against it too by make test:
# sessions, re-prime and templates, warm starts, router, clients, stop,
# images, draft models, the RAM tier and its temperature-0 equality
NEXT_TESTS ?= t/10-sessions.t t/92-reprime.t t/39-templates.t t/50-warm.t \
              t/73-router-real.t t/85-clients.t t/101-stop.t t/38-media.t \
              t/29-draft.t t/01-proxy.t t/22-reboot.t t/33-real-faults.t \
              t/86-miss.t t/96-anthropic.t t/99-bases.t t/102-ram-tier.t \
              t/103-ram-equal.t

# nginx.org's newest stable line (rig/build-nginx.sh, from ../shared/nginx/,
# cached): built by make rig-stable, the real-backend tests that matter run
# against it by make test (test-stable; NGINX_STABLE= skips both): sessions,
# the store, re-prime, warm starts, Anthropic, the RAM tier, a hung store,
# the configuration's checks
NGINX_STABLE ?= 1.30.4
STABLE_TESTS ?= t/00-config.t t/01-proxy.t t/10-sessions.t t/20-store.t \
                t/50-warm.t t/92-reprime.t t/96-anthropic.t \
                t/102-ram-tier.t t/105-store-hang.t

NGINX_SOURCES ?= $(abspath $(CURDIR)/../shared/nginx)
export NGINX_SOURCES
STABLE_SOURCE = $(NGINX_SOURCES)/nginx-$(NGINX_STABLE).tar.gz

rig-stable: deps
	@if [ -z "$(NGINX_STABLE)" ]; then :; \
	elif [ ! -f "$(STABLE_SOURCE)" ]; then \
	    echo "rig-stable: no $(STABLE_SOURCE): nginx $(NGINX_STABLE)" \
	         "not built, its tests are skipped (NGINX_SOURCES=)"; \
	else rig/build-nginx.sh $(NGINX_STABLE) >/dev/null; fi

rig-next: deps
	@$(if $(strip $(LLAMA_NEXT)),NODE_LLAMA_CPP=$(LLAMA_NEXT) \
	    rig/build-llama-server.sh,:)

# NGINX_VERSION=1.26.3: the suite against that nginx, built from Debian's
# source package with the module (rig/build-nginx.sh, cached)
test: deps $(MODULE) $(MODULE_NODEBUG) rig rig-next rig-stable
	@if [ -n "$(NGINX_VERSION)" ]; then \
	    eval "$$(rig/build-nginx.sh $(NGINX_VERSION))"; \
	    export NGINX_BINARY NGINX_MODULE; \
	    echo "testing against $$NGINX_BINARY"; \
	fi; \
	prove $(PROVE_FLAGS) t/ && $(MAKE) --no-print-directory test-next \
	    && $(MAKE) --no-print-directory test-stable

# the tests of STABLE_TESTS against nginx.org's stable NGINX_STABLE
test-stable: deps rig rig-stable
	@if [ -n "$(NGINX_STABLE)" ] && [ -f "$(STABLE_SOURCE)" ]; then \
	    eval "$$(rig/build-nginx.sh $(NGINX_STABLE))" \
	    && export NGINX_BINARY NGINX_MODULE \
	    && echo "testing against nginx $(NGINX_STABLE): $$NGINX_BINARY" \
	    && prove $(PROVE_FLAGS) $(STABLE_TESTS); \
	fi

# the tests of NEXT_TESTS against llama.cpp of node-llama-cpp LLAMA_NEXT
test-next: deps $(MODULE) rig rig-next
	@$(if $(strip $(LLAMA_NEXT)),echo "testing against llama-server of \
	    node-llama-cpp $(LLAMA_NEXT)" && NODE_LLAMA_CPP=$(LLAMA_NEXT) \
	    prove $(PROVE_FLAGS) $(NEXT_TESTS),:)

demo: deps $(MODULE) rig
	examples/demo.sh

# benchmarks (not tests): a table on stdout, JSON in bench/results/
bench: deps $(MODULE) rig
	@command -v wrk >/dev/null || { apt-get update -qq && \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq wrk; }
	/usr/bin/python3 bench/bench.py $(BENCH_FLAGS)

# the soak (not in make test): docs/reliability.md reports its figures
SOAK_REQUESTS ?= 10000
soak: deps $(MODULE) rig
	SOAK_REQUESTS=$(SOAK_REQUESTS) SOAK_REPORT=$(CURDIR)/objs/soak.json \
	    prove -v t/40-soak.t

asan: deps
	rig/build-asan-nginx.sh

# the suite with nginx under AddressSanitizer (after make asan)
test-asan: asan rig
	eval "$$(rig/build-asan-nginx.sh)"; \
	export NGINX_BINARY NGINX_MODULE; \
	ASAN_OPTIONS=detect_odr_violation=0:detect_leaks=0 prove $(PROVE_FLAGS) t/

# the suite with nginx under valgrind
test-valgrind: deps $(MODULE) rig
	TEST_NGINX_VALGRIND=1 prove $(PROVE_FLAGS) t/

# the Debian package libnginx-mod-http-llama-session (debian/, dh_nginx),
# built from a copy of the tree into build/deb/, then lintian's report.
# DEBIAN=trixie: for Debian 13's nginx, built and linted in a Debian 13
# root (rig/debian-root.sh, cached) into build/deb-trixie/
DEB_DIR := build/deb$(if $(DEBIAN),-$(DEBIAN))

deb: deps
	rm -rf $(DEB_DIR) && mkdir -p $(DEB_DIR)/src
	tar -cf - --exclude=./objs --exclude=./objs.configure.log \
	    --exclude=./objs-nodebug --exclude=./objs-nodebug.configure.log \
	    --exclude=./build --exclude=./.git --exclude=./bench/results . \
	    | tar -xf - -C $(DEB_DIR)/src
ifeq ($(DEBIAN),)
	cd $(DEB_DIR)/src && dpkg-buildpackage -us -uc -b > ../build.log 2>&1 \
	    || { tail -n 40 ../build.log; exit 1; }
	lintian --info $(DEB_DIR)/*.changes | tee $(DEB_DIR)/lintian.log
else
	root=$$(rig/debian-root.sh $(DEBIAN)) && rm -rf "$$root/build" \
	    && mkdir "$$root/build" && cp -a $(DEB_DIR)/src "$$root/build/src" \
	    && { chroot "$$root" sh -c 'cd /build/src && dpkg-buildpackage \
	             -us -uc -b' > $(DEB_DIR)/build.log 2>&1 \
	         || { tail -n 40 $(DEB_DIR)/build.log; exit 1; }; } \
	    && cp "$$root"/build/*.deb "$$root"/build/*.changes $(DEB_DIR)/ \
	    && chroot "$$root" sh -c 'lintian --info /build/*.changes' \
	       | tee $(DEB_DIR)/lintian.log
endif
	@ls $(DEB_DIR)/*.deb

clean:
	rm -rf objs objs.configure.log objs-nodebug objs-nodebug.configure.log build
