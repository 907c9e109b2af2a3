# sdm.c build. `make` builds the programs, `make test` runs every CPU test and compiles every CUDA source,
# `make test-gpu` runs the GPU tests, `make bench` runs the benchmarks.
# Overrides: GPU_ARCH (default sm_90), CUDA_HOME, NCCL_HOME.

CUDA_HOME ?= /usr/local/cuda
NCCL_HOME ?= $(CUDA_HOME)
GPU_ARCH  ?= sm_90

CC       ?= gcc
NVCC     := $(CUDA_HOME)/bin/nvcc
BUILD    := build

CFLAGS    := -std=c11 -D_POSIX_C_SOURCE=200809L -O2 -Wall -Wextra -I. -MMD -MP
SANITIZE  := -O1 -g -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined
NVCCFLAGS := -O3 -std=c++17 -arch=$(GPU_ARCH) -I. -MMD -MP -Xcompiler -Wall,-Wextra \
             -I$(NCCL_HOME)/include --expt-relaxed-constexpr -lineinfo
GPU_LIBS  := -lcublas -lcublasLt -lm

# NCCL is found by compiling and linking a probe; without it the programs build single-GPU only.
NCCL_LIBDIR := $(firstword $(wildcard $(NCCL_HOME)/lib64/libnccl.so $(NCCL_HOME)/lib/libnccl.so))
HAVE_NCCL := $(shell printf '\#include <nccl.h>\nint main(void){int v;return ncclGetVersion(&v);}\n' | \
    $(CC) -x c - -o /dev/null -I$(CUDA_HOME)/include -I$(NCCL_HOME)/include \
    -L$(CUDA_HOME)/lib64 -L$(NCCL_HOME)/lib64 -L$(NCCL_HOME)/lib -lnccl -lcudart 2>/dev/null && echo 1)
ifeq ($(HAVE_NCCL),1)
  NVCCFLAGS += -DSDM_HAVE_NCCL=1
  GPU_LIBS  += -L$(NCCL_HOME)/lib64 -L$(NCCL_HOME)/lib -lnccl
endif

PROGRAMS   := train_sdm infer_sdm prepare_data svgplot
CPU_TESTS  := $(patsubst tests/%.c,$(BUILD)/%,$(wildcard tests/test_*.c))
CPU_SCRIPTS := $(wildcard tests/test_*.sh)
GPU_TESTS  := $(patsubst tests/%.cu,$(BUILD)/%,$(wildcard tests/gpu_test_*.cu))
BENCHES    := $(patsubst tests/%.cu,$(BUILD)/%,$(wildcard tests/bench_*.cu))

.PHONY: all test test-cpu test-gpu bench compile-cuda clean
all: $(PROGRAMS)

train_sdm: train_sdm.cu
	$(NVCC) $(NVCCFLAGS) $< -o $@ $(GPU_LIBS)

infer_sdm: infer_sdm.cu
	$(NVCC) $(NVCCFLAGS) $< -o $@ $(GPU_LIBS)

prepare_data: data/prepare_data.c
	$(CC) $(CFLAGS) $< -o $@ -lm

svgplot: tools/svgplot.c
	$(CC) $(CFLAGS) $< -o $@ -lm

# The embedded default dataset (associative recall, data/README.md) in data/generated (git-ignored, ~35 MB,
# under a second). train_sdm also generates it on first use through dataset_ensure_default().
.PHONY: dataset
dataset: data/generated/recall_dataset.txt
data/generated/recall_dataset.txt: prepare_data
	./prepare_data --recall -o data/generated

$(BUILD)/test_%: tests/test_%.c | $(BUILD)
	$(CC) $(CFLAGS) $(SANITIZE) $< -o $@ -lm

$(BUILD)/gpu_test_% $(BUILD)/bench_%: tests/%.cu
$(BUILD)/%: tests/%.cu | $(BUILD)
	$(NVCC) $(NVCCFLAGS) $< -o $@ $(GPU_LIBS)

$(BUILD):
	mkdir -p $(BUILD)

# Every CUDA source must compile, also on a machine without a GPU (CI).
compile-cuda: $(PROGRAMS) $(GPU_TESTS) $(BENCHES)

test-cpu: $(CPU_TESTS)
	tests/run_all.sh $(CPU_TESTS) $(CPU_SCRIPTS)

test: compile-cuda
	$(MAKE) --no-print-directory test-cpu

test-gpu: $(GPU_TESTS)
	tests/run_all.sh $(GPU_TESTS)

bench: $(BENCHES)
	@for b in $(BENCHES); do echo "== $$b"; $$b || exit 1; done

clean:
	rm -rf $(BUILD) $(PROGRAMS)

-include $(wildcard $(BUILD)/*.d) $(wildcard *.d)
