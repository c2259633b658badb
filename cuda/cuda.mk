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
# ld.so.cache.
comma := ,
CUDA_LDLIBS := $(addprefix -L,$(CUDA_LIBDIRS)) $(addprefix -Wl$(comma)-rpath$(comma),$(CUDA_LIBDIRS)) \
               -lcudart_static -lstdc++ -ldl -lrt

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

# The one-GPU validation kit (docs/CUDA_TESTING.md): exit 77 without a GPU.
test-gpu: $(CUDA_TEST_BINS)
	$(Q)sh cuda/test-gpu.sh $(BUILD)

# make gpu-bundle (docs/CUDA_TESTING.md, "Validating on a bare GPU machine"): the
# library and the CUDA backend as one shared object, lib/libtandem_bundle.so
# (compiled again with -fPIC, so six binaries share one copy and the folder
# stays under 64 MiB), tandem and the kit's test binaries linked against it
# without MPI, with a DT_RPATH to lib/ (DT_RPATH, not RUNPATH, also serves
# the libraries' own dependencies: libopenblas's libgfortran); then
# cuda/bundle.sh copies in every non-CUDA library they need and the scripts.
GPU_BUNDLE := $(BUILD)/gpu-bundle
GPU_BUNDLE_OBJ := $(BUILD)/gpu-bundle-obj
GPU_BUNDLE_TESTS := test_cuda test_cuda_train test_bench_cuda test_cuda_gpt test_fsdp_cli test_det_gpu \
                    test_cuda_xfer
GPU_BUNDLE_SO := $(GPU_BUNDLE)/lib/libtandem_bundle.so
GPU_BUNDLE_PIC := $(patsubst $(BUILD)/%,$(GPU_BUNDLE_OBJ)/%,$(LIB_OBJ) $(CUDA_C_OBJ))
GPU_BUNDLE_LINK := -L$(GPU_BUNDLE)/lib -ltandem_bundle -Wl,--disable-new-dtags,-rpath,'$$ORIGIN/lib:$$ORIGIN/../lib'
$(GPU_BUNDLE_OBJ)/%.o: %.c $(CONFIG_STAMP)
	@mkdir -p $(dir $@)
	@$(if $(Q),echo "  CC PIC  $<")
	$(Q)$(CC) $(CPPFLAGS) $(ALLCFLAGS) -fPIC -fno-semantic-interposition -MMD -MP -c $< -o $@
# the per-object flags of GNUmakefile and above, for the PIC copies
$(GPU_BUNDLE_OBJ)/core/device_host.o: ALLCFLAGS += -fno-trapping-math
$(filter $(GPU_BUNDLE_OBJ)/cuda/%,$(GPU_BUNDLE_PIC)): CPPFLAGS += $(CUDA_CPPFLAGS)
$(GPU_BUNDLE_SO): $(GPU_BUNDLE_PIC) $(CUDA_CU_OBJ)
	@mkdir -p $(dir $@)
	@$(if $(Q),echo "  LINK    $@")
	$(Q)$(CC) $(ALLCFLAGS) -shared -Wl,-soname,libtandem_bundle.so -o $@ $^ $(addprefix -L,$(CUDA_LIBDIRS)) \
	  -lcudart_static -lstdc++ -ldl -lrt $(LDLIBS)
$(GPU_BUNDLE)/tandem: $(TOOL_OBJ) $(GPU_BUNDLE_SO)
	@$(if $(Q),echo "  LINK    $@")
	$(Q)$(CC) $(ALLCFLAGS) -o $@ $(TOOL_OBJ) $(GPU_BUNDLE_LINK) $(LDLIBS)
$(GPU_BUNDLE)/tests/%: $(BUILD)/tests/%.o $(TEST_SUPPORT_OBJ) $(GPU_BUNDLE_SO)
	@mkdir -p $(dir $@)
	@$(if $(Q),echo "  LINK    $@")
	$(Q)$(CC) $(ALLCFLAGS) -o $@ $< $(TEST_SUPPORT_OBJ) $(TESTLIBS) $(GPU_BUNDLE_LINK) $(LDLIBS)
.PHONY: gpu-bundle
gpu-bundle: $(GPU_BUNDLE)/tandem $(GPU_BUNDLE_TESTS:%=$(GPU_BUNDLE)/tests/%)
	$(Q)sh cuda/bundle.sh $(GPU_BUNDLE) $(CUDA_HOME) "$(CUDA_ARCHS)" $(NVCC_VERSION)
# make test builds it too, for tests/test_gpu_bundle.c
GPU_BUNDLE_GOAL := gpu-bundle

-include $(CUDA_OBJ:.o=.d) $(GPU_BUNDLE_PIC:.o=.d)
