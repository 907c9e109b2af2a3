# sdm.c build. `make` builds the programs, `make test` runs every CPU test and compiles every CUDA source,
# `make test-gpu` runs the GPU tests, `make bench` runs the benchmarks, `make fuzz` (clang, optional, not part of
# `make test`) runs the libFuzzer harnesses of tests/fuzz/ for FUZZ_SECONDS each.
# Overrides: GPU_ARCH (default sm_90a: H100, H200; sm_90 or older leaves out the Hopper-only kernels), CUDA_HOME,
# NCCL_HOME, NCCL (1: require it, 0: leave it out).

CUDA_HOME ?= /usr/local/cuda
NCCL_HOME ?= $(CUDA_HOME)
GPU_ARCH  ?= sm_90a

CC       ?= gcc
NVCC     := $(CUDA_HOME)/bin/nvcc
BUILD    := build

CFLAGS    := -std=c11 -D_POSIX_C_SOURCE=200809L -O2 -Wall -Wextra -I.
SANITIZE  := -O1 -g -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined
NVCCFLAGS := -O3 -std=c++17 -arch=$(GPU_ARCH) -I. -Xcompiler -Wall,-Wextra \
             --expt-relaxed-constexpr -lineinfo
GPU_LIBS  := -lcublas -lcublasLt -lm
# sm_90a (H100, H200): the Hopper-only instructions (wgmma) too; the host code learns it from SDM_SM90A
ifeq ($(GPU_ARCH),sm_90a)
  NVCCFLAGS += -DSDM_SM90A=1
endif
DEPS       = -MMD -MP -MF $(BUILD)/$(notdir $@).d # dependency files go to build/, never the repository root

# NCCL: NCCL=1 requires it, NCCL=0 leaves it out, unset uses it when core/nccl_probe.c compiles and links against
# nccl.h and libnccl under NCCL_HOME (or CUDA_HOME, or the compiler's default paths). One line says which.
NCCL_FLAGS := -I$(NCCL_HOME)/include -I$(CUDA_HOME)/include
NCCL_LINK  := -L$(NCCL_HOME)/lib64 -L$(NCCL_HOME)/lib -L$(CUDA_HOME)/lib64 -lnccl
ifneq ($(NCCL),0)
  NCCL_VERSION := $(shell $(CC) $(NCCL_FLAGS) core/nccl_probe.c -o /dev/null $(NCCL_LINK) 2>/dev/null && \
      $(CC) -E -DSDM_NCCL_VERSION $(NCCL_FLAGS) core/nccl_probe.c 2>/dev/null | \
      sed -n 's/^sdm_nccl_version \([0-9]*\) \([0-9]*\) \([0-9]*\).*/\1.\2.\3/p')
endif
ifneq ($(NCCL_VERSION),)
  NVCCFLAGS += -DSDM_HAVE_NCCL=1 -I$(NCCL_HOME)/include
  GPU_LIBS  += $(NCCL_LINK)
  NCCL_MODE := NCCL $(NCCL_VERSION): multi-GPU
else ifeq ($(NCCL),1)
  $(error NCCL=1 but nccl.h and libnccl were not found under NCCL_HOME=$(NCCL_HOME) or CUDA_HOME=$(CUDA_HOME); set NCCL_HOME, or build with NCCL=0)
else ifeq ($(NCCL),0)
  NCCL_MODE := NCCL=0: single-GPU build
else
  NCCL_MODE := NCCL not found: single-GPU build
endif
ifeq ($(MAKELEVEL),0)
  $(info $(NCCL_MODE))
endif

PROGRAMS   := train_sdm infer_sdm prepare_data svgplot
CPU_TESTS  := $(patsubst tests/%.c,$(BUILD)/%,$(wildcard tests/test_*.c))
CPU_SCRIPTS := $(wildcard tests/test_*.sh)
GPU_TESTS  := $(patsubst tests/%.cu,$(BUILD)/%,$(wildcard tests/gpu_test_*.cu))
BENCHES    := $(patsubst tests/%.cu,$(BUILD)/%,$(wildcard tests/bench_*.cu))

.PHONY: all test test-cpu test-gpu bench compile-cuda variant clean fuzz fuzz-build
all: $(PROGRAMS)

train_sdm: train_sdm.cu | $(BUILD)
	$(NVCC) $(NVCCFLAGS) $(DEPS) $< -o $@ $(GPU_LIBS)

infer_sdm: infer_sdm.cu | $(BUILD)
	$(NVCC) $(NVCCFLAGS) $(DEPS) $< -o $@ $(GPU_LIBS)

prepare_data: data/prepare_data.c | $(BUILD)
	$(CC) $(CFLAGS) $(DEPS) $< -o $@ -lm

svgplot: tools/svgplot.c
	$(CC) $(CFLAGS) $< -o $@ -lm

# The embedded default dataset (associative recall, data/README.md) in data/generated (git-ignored, ~35 MB,
# under a second). train_sdm also generates it on first use through dataset_ensure_default().
.PHONY: dataset
dataset: data/generated/recall_dataset.txt
data/generated/recall_dataset.txt: prepare_data
	./prepare_data --recall -o data/generated

$(BUILD)/test_%: tests/test_%.c | $(BUILD)
	$(CC) $(CFLAGS) $(DEPS) $(SANITIZE) -pthread $< -o $@ -lm

$(BUILD)/%: tests/%.cu | $(BUILD)
	$(NVCC) $(NVCCFLAGS) $(DEPS) $< -o $@ $(GPU_LIBS)

$(BUILD):
	mkdir -p $(BUILD)

# Every CUDA source must compile, also on a machine without a GPU (CI).
compile-cuda: $(PROGRAMS) $(GPU_TESTS) $(BENCHES)

# An A/B build of a program with other compile-time knobs, e.g.
#   make variant NAME=stages2 FLAGS=-DMATMUL_GEMV_STAGES=2 [SRC=infer_sdm]
# -> build/variants/stages2, which scripts/gpu_pack.sh packs and scripts/gpu_check.sh decode-ab / step-ab time against
# the default build on the same machine.
SRC ?= infer_sdm
variant: | $(BUILD)
	@test -n "$(NAME)" || { echo "make variant: give NAME= (and FLAGS=)"; exit 1; }
	mkdir -p $(BUILD)/variants
	$(NVCC) $(NVCCFLAGS) $(FLAGS) $(SRC).cu -o $(BUILD)/variants/$(NAME) $(GPU_LIBS)
	echo "$$(scripts/gpu_check.sh --source-digest) $(GPU_ARCH) $(SRC) $(FLAGS)" > $(BUILD)/variants/$(NAME).id

test-cpu: $(CPU_TESTS)
	tests/run_all.sh $(CPU_TESTS) $(CPU_SCRIPTS)

test: compile-cuda
	$(MAKE) --no-print-directory test-cpu

test-gpu: $(GPU_TESTS) train_sdm infer_sdm prepare_data  # gpu_test_infer and gpu_test_train run the programs
	tests/run_all.sh $(GPU_TESTS)

bench: $(BENCHES)
	@for b in $(BENCHES); do echo "== $$b"; $$b || exit 1; done

# Coverage-guided fuzzing (docs/TESTING.md#coverage-guided-fuzzing): every harness tests/fuzz/fuzz_*.c built with
# clang's libFuzzer, ASan and UBSan, seeded by tests/fuzz/seeds.sh from the repository's own inputs, then run for
# FUZZ_SECONDS each, one process. `make fuzz FUZZ=fuzz_config FUZZ_SECONDS=600` runs one; the corpus grows in
# build/fuzz/corpus/, a crash, hang or broken promise stops with its input in build/fuzz/crashes/. FUZZ_ARGS adds
# libFuzzer flags. The longest input tried is a little above the largest seed (state.bin of the test model: 123 KB).
FUZZ_CC      ?= clang
FUZZ_SECONDS ?= 60
FUZZ_CFLAGS  := -std=c11 -D_POSIX_C_SOURCE=200809L -O1 -g -I. -fsanitize=fuzzer,address,undefined \
                -fno-sanitize-recover=undefined -fno-omit-frame-pointer -pthread
FUZZ_ALL     := $(patsubst tests/fuzz/%.c,%,$(wildcard tests/fuzz/fuzz_*.c))
FUZZ         ?= $(FUZZ_ALL)
FUZZ_ARGS    ?=
FUZZ_HEADERS := $(wildcard core/*.h data/*.h model/*.h) tools/svgplot.c tests/fuzz/fuzz.h

$(BUILD)/fuzz/%: tests/fuzz/%.c $(FUZZ_HEADERS)
	@mkdir -p $(BUILD)/fuzz
	$(FUZZ_CC) $(FUZZ_CFLAGS) $< -o $@ -lm

fuzz-build:
	@command -v $(FUZZ_CC) > /dev/null || { echo "make fuzz needs clang with libFuzzer (FUZZ_CC=$(FUZZ_CC) not found)"; exit 1; }
	@$(MAKE) --no-print-directory $(addprefix $(BUILD)/fuzz/,$(FUZZ_ALL))

fuzz: fuzz-build $(BUILD)/test_checkpoint prepare_data
	tests/fuzz/seeds.sh $(BUILD)/fuzz/corpus
	@mkdir -p $(BUILD)/fuzz/crashes
	@for h in $(FUZZ); do \
	    case $$h in fuzz_checkpoint) len=131072;; fuzz_config|fuzz_shard) len=8192;; *) len=4096;; esac; \
	    echo "== $$h: $(FUZZ_SECONDS) s"; mkdir -p $(BUILD)/fuzz/corpus/$$h; \
	    $(BUILD)/fuzz/$$h -max_total_time=$(FUZZ_SECONDS) -timeout=10 -max_len=$$len \
	        -print_final_stats=1 -artifact_prefix=$(BUILD)/fuzz/crashes/$$h- $(FUZZ_ARGS) \
	        $(BUILD)/fuzz/corpus/$$h 2> $(BUILD)/fuzz/$$h.log || { tail -40 $(BUILD)/fuzz/$$h.log; exit 1; }; \
	    grep -E '^(#[0-9]+.*DONE|stat::number_of_executed_units|Done )' $(BUILD)/fuzz/$$h.log | tail -2; \
	done

clean:
	rm -rf $(BUILD) $(PROGRAMS)

-include $(wildcard $(BUILD)/*.d)
