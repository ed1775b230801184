# flashd: the two set-up commands of the README, plus a few helpers.
#   make run    install what is missing, build (Release), start the daemon on config/flashd.yaml
#   make test   install what is missing, build, run every test through ctest

BUILD_DIR ?= build
BUILD_TYPE ?= Release
JOBS ?= $(shell nproc)
CONFIG ?= config/flashd.yaml

FUZZ_DIR ?= build-fuzz
FUZZ_SECONDS ?= 60
SANITIZE_DIR ?= build-sanitize

.PHONY: all deps configure build run test format clean fuzz test-sanitize package

all: build

deps:
	packaging/install-deps.sh

configure: deps
	cmake -S . -B $(BUILD_DIR) -DCMAKE_BUILD_TYPE=$(BUILD_TYPE)

build: configure
	cmake --build $(BUILD_DIR) -j $(JOBS)
	packaging/fetch-tokenizer.sh $(BUILD_DIR)/tokenizer/deepseek-v4

run: build
	$(BUILD_DIR)/bin/flashd serve --config $(CONFIG)

test: build
	ctest --test-dir $(BUILD_DIR) --output-on-failure -j $(JOBS)

# The Debian package (CPack), in $(BUILD_DIR): flashd_VERSION_ARCH.deb.
package: build
	cd $(BUILD_DIR) && cpack -G DEB

# Every libFuzzer target (tests/fuzz) for FUZZ_SECONDS each, with ASan and UBSan (clang).
fuzz: deps
	packaging/install-deps.sh --with-fuzz
	CC=clang-14 CXX=clang++-14 cmake -S . -B $(FUZZ_DIR) -DCMAKE_BUILD_TYPE=RelWithDebInfo \
	  -DFLASHD_FUZZ=ON -DFLASHD_WERROR=OFF -DBUILD_TESTING=OFF -DFLASHD_CUDA=OFF -DFLASHD_HIP=OFF
	cmake --build $(FUZZ_DIR) -j $(JOBS) --target fuzzers
	tests/fuzz/run.sh $(FUZZ_DIR) $(FUZZ_SECONDS)

# The whole test suite built with AddressSanitizer and UndefinedBehaviorSanitizer (but the
# package install test: a sanitized binary needs the sanitizer runtime, which a fresh Debian root
# does not have).
test-sanitize: deps
	cmake -S . -B $(SANITIZE_DIR) -DCMAKE_BUILD_TYPE=RelWithDebInfo -DFLASHD_SANITIZE=ON \
	  -DFLASHD_CUDA=OFF -DFLASHD_HIP=OFF
	cmake --build $(SANITIZE_DIR) -j $(JOBS)
	packaging/fetch-tokenizer.sh $(SANITIZE_DIR)/tokenizer/deepseek-v4
	ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
	  ctest --test-dir $(SANITIZE_DIR) --output-on-failure -j $(JOBS) --timeout 1800 \
	  -E package_install_test

format:
	clang-format -i $$(git ls-files --cached --others --exclude-standard '*.h' '*.cc' '*.cu')

clean:
	rm -rf $(BUILD_DIR)
