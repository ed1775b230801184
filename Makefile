# flashd: the two set-up commands of the README, plus a few helpers.
#   make run    install what is missing, build (Release), start the daemon on config/flashd.yaml
#   make test   install what is missing, build, run every test through ctest

BUILD_DIR ?= build
BUILD_TYPE ?= Release
JOBS ?= $(shell nproc)
CONFIG ?= config/flashd.yaml

.PHONY: all deps configure build run test format clean

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

format:
	clang-format -i $$(git ls-files --cached --others --exclude-standard '*.h' '*.cc' '*.cu')

clean:
	rm -rf $(BUILD_DIR)
