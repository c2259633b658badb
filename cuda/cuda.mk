# cuda/cuda.mk: the CUDA backend's part of the build, included by
# GNUmakefile when nvcc was found. Defines CUDA_OBJ (linked into the CLI
# and every test binary directly, not through libtandem.a, so that the
# backend's registration constructor is always kept) and CUDA_LDLIBS.
#
#   CUDA_HOME    toolkit root (default: the directory above nvcc's bin/)
#   NCCL_HOME    NCCL root when it is not inside CUDA_HOME
#   CUDA_ARCHS   SASS targets (default 80 90: A100 and H100; sm_86/89 run
#                the sm_80 code); PTX for the last one is embedded too, so
#                newer GPUs JIT-compile it.
#   make V=1     full commands

CUDA_NVCC_REAL := $(realpath $(shell command -v $(NVCC) 2>/dev/null))
CUDA_HOME  ?= $(if $(CUDA_NVCC_REAL),$(patsubst %/bin/nvcc,%,$(CUDA_NVCC_REAL)),/usr/local/cuda)
NCCL_HOME  ?= $(CUDA_HOME)
CUDA_ARCHS ?= 80 90
CUDA_PTX   := $(lastword $(CUDA_ARCHS))

CUDA_INC := $(sort $(CUDA_HOME)/include $(NCCL_HOME)/include)
CUDA_LIBDIRS := $(sort $(wildcard $(CUDA_HOME)/lib64 $(CUDA_HOME)/lib $(NCCL_HOME)/lib64 $(NCCL_HOME)/lib))

# -isystem: nccl.h declares `ncclGroupStart()` without a prototype, which
# -Wstrict-prototypes would otherwise report in our C files.
CUDA_CPPFLAGS := $(addprefix -isystem ,$(CUDA_INC))
NVCCFLAGS ?= -O3 -lineinfo
CUDA_GENCODE := $(foreach a,$(CUDA_ARCHS),-gencode arch=compute_$(a),code=sm_$(a)) \
                -gencode arch=compute_$(CUDA_PTX),code=compute_$(CUDA_PTX)
CUDA_NVCC_ALL := -std=c++17 $(NVCCFLAGS) $(CUDA_GENCODE) \
                 -Xcompiler -Wall,-Wextra,-Wshadow,-fPIC

# The CUDA runtime is linked statically (nvcc's own default): it loads the
# driver (libcuda.so.1) when CUDA is first used, so these binaries start on
# machines without a driver. cuBLAS and NCCL are not linked: cuda/cuda_libs.c
# dlopens them when a GPU or communicator needs them (a host-only process
# maps none of the ~220 MB), found through this rpath, LD_LIBRARY_PATH or
# ld.so.cache. CUDA_BUNDLE=1 (make gpu-bundle) replaces the toolkit's rpath
# with lib/ beside the binary or one level up, as DT_RPATH so that it also
# holds for the libraries' own dependencies (libopenblas's libgfortran).
comma := ,
CUDA_RPATH := $(if $(filter 1,$(CUDA_BUNDLE)),-Wl$(comma)--disable-new-dtags$(comma)-rpath$(comma)'$$ORIGIN/lib:$$ORIGIN/../lib',$(addprefix -Wl$(comma)-rpath$(comma),$(CUDA_LIBDIRS)))
CUDA_LDLIBS := $(addprefix -L,$(CUDA_LIBDIRS)) $(CUDA_RPATH) -lcudart_static -lstdc++ -ldl -lrt

CUDA_CU_SRC := $(wildcard cuda/*.cu)
CUDA_C_SRC  := $(wildcard cuda/*.c)
CUDA_CU_OBJ := $(CUDA_CU_SRC:%.cu=$(BUILD)/%.cu.o)
CUDA_C_OBJ  := $(CUDA_C_SRC:%.c=$(BUILD)/%.o)
CUDA_OBJ    := $(CUDA_C_OBJ) $(CUDA_CU_OBJ)

# cuda/*.c use GNUmakefile's generic C rule; they only need the headers.
$(CUDA_C_OBJ): CPPFLAGS += $(CUDA_CPPFLAGS)

$(BUILD)/cuda/%.cu.o: cuda/%.cu
	@mkdir -p $(dir $@)
	@$(if $(Q),echo "  NVCC    $<")
	$(Q)$(NVCC) $(CPPFLAGS) $(CUDA_NVCC_ALL) -MMD -MP -c $< -o $@

CUDA_TEST_BINS := $(BUILD)/tests/test_cuda $(BUILD)/tests/test_cuda_train \
                  $(BUILD)/tests/test_bench_cuda $(BUILD)/tandem

.PHONY: test-cuda test-gpu
test-cuda: $(CUDA_TEST_BINS)
	$(Q)sh cuda/test-cuda.sh $(BUILD)

# The one-GPU validation kit (docs/CUDA.md): exit 77 without a GPU.
test-gpu: $(CUDA_TEST_BINS)
	$(Q)sh cuda/test-gpu.sh $(BUILD)

-include $(CUDA_OBJ:.o=.d)
