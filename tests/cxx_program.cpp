// tests/cxx_program.cpp: a C++ program using tandem's C API, built by
// tests/test_install.c with g++ against the installed headers and
// libraries (pkg-config), as a C++ user would: the public headers' extern
// "C" guards are what let it link. It trains an MLP on one device for a
// few steps, then the same global batches with DDP over 2 forked ranks,
// and checks that DDP's parameters match the single device's (within
// float32 rounding: the gradient sums are added in another order),
// printing "cxx: ... ok" lines that the test reads.
// Not built by the GNUmakefile (tests/*.cpp are not test programs).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <vector>

#include "core/data.h"
#include "core/device.h"
#include "core/status.h"
#include "ddp/ddp.h"
#include "dist/spawn.h"
#include "models/model.h"
#include "models/optim.h"
#include "models/train.h"

namespace {

const int kDims[] = {784, 64, 10};
const int kSteps = 4, kBatch = 32;
const double kTol = 1e-5;

bool ok(tdm_status s, const char *what)
{
    if (s == TDM_STATUS_OK) return true;
    std::fprintf(stderr, "cxx: %s: %s\n", what, tdm_error_message());
    return false;
}

struct Free {
    void operator()(tdm_device *d) const { tdm_device_free(d); }
    void operator()(tdm_model *m) const { tdm_model_free(m); }
    void operator()(tdm_optim *o) const { tdm_optim_free(o); }
    void operator()(tdm_ddp *d) const { tdm_ddp_free(d); }
};
template <class T> using owned = std::unique_ptr<T, Free>;

// The global batches of every step: samples s*kBatch .. (s+1)*kBatch.
struct Batches {
    tdm_dataset data{};
    Batches() { tdm_data_synthetic(&data, (int64_t)kSteps * kBatch, 1, 28, 28, 10, 7, 0); }
    ~Batches() { tdm_data_free(&data); }
    void get(int step, int first, int count, float *x, int32_t *y) const
    {
        std::vector<int64_t> idx(count);
        for (int i = 0; i < count; i++) idx[i] = (int64_t)step * kBatch + first + i;
        tdm_data_gather(&data, idx.data(), count, x, y);
    }
};

// One device: kSteps SGD steps; the final parameters in params.
bool train_single(std::vector<float> &params, double *first_loss, double *last_loss)
{
    tdm_device *d = nullptr;
    tdm_model *m = nullptr;
    tdm_optim *o = nullptr;
    if (!ok(tdm_device_open(&d, "cpu", 0, 1), "tdm_device_open")) return false;
    owned<tdm_device> dev(d);
    if (!ok(tdm_mlp_init(&m, d, kDims, 3, 1), "tdm_mlp_init")) return false;
    owned<tdm_model> model(m);
    if (!ok(tdm_sgd_init(&o, m, 0.1f, 0.9f), "tdm_sgd_init")) return false;
    owned<tdm_optim> opt(o);
    tdm_single s{};
    s.model = m;
    s.opt = o;
    Batches b;
    std::vector<float> x(kBatch * 784);
    std::vector<int32_t> y(kBatch);
    for (int step = 0; step < kSteps; step++) {
        double loss = 0;
        b.get(step, 0, kBatch, x.data(), y.data());
        if (!ok(tdm_single_step(&s, x.data(), y.data(), kBatch, &loss), "tdm_single_step"))
            return false;
        if (step == 0) *first_loss = loss;
        *last_loss = loss;
    }
    tdm_single_free(&s);
    params.resize(tdm_model_param_elems(m));
    return ok(tdm_dev_copy_to_host(d, params.data(), tdm_model_params(m),
                                   params.size() * sizeof(float)),
              "tdm_dev_copy_to_host");
}

// A DDP rank: the same steps on its half of each global batch; rank 0
// compares its parameters with the single device's (passed in arg).
int ddp_rank(tdm_comm *comm, void *arg)
{
    const std::vector<float> &want = *static_cast<const std::vector<float> *>(arg);
    int rank = tdm_comm_rank(comm), world = tdm_comm_size(comm);
    tdm_device *d = nullptr;
    tdm_model *m = nullptr;
    tdm_ddp *r = nullptr;
    tdm_optim *o = nullptr;
    if (!ok(tdm_device_open(&d, "cpu", rank, 1), "tdm_device_open")) return 1;
    owned<tdm_device> dev(d);
    if (!ok(tdm_mlp_init(&m, d, kDims, 3, 1), "tdm_mlp_init")) return 1;
    owned<tdm_model> model(m);
    tdm_ddp_opts opts{};
    if (!ok(tdm_ddp_init(&r, m, comm, &opts), "tdm_ddp_init")) return 1;
    owned<tdm_ddp> ddp(r);
    if (!ok(tdm_sgd_init(&o, m, 0.1f, 0.9f), "tdm_sgd_init")) return 1;
    owned<tdm_optim> opt(o);
    Batches b;
    int mine = kBatch / world;
    std::vector<float> x(mine * 784);
    std::vector<int32_t> y(mine);
    for (int step = 0; step < kSteps; step++) {
        double loss = 0;
        b.get(step, rank * mine, mine, x.data(), y.data());
        if (!ok(tdm_ddp_zero_grad(r), "tdm_ddp_zero_grad") ||
            !ok(tdm_ddp_forward(r, x.data(), y.data(), mine, &loss), "tdm_ddp_forward") ||
            !ok(tdm_ddp_backward(r), "tdm_ddp_backward") || !ok(tdm_ddp_step(r, o), "tdm_ddp_step"))
            return 1;
    }
    std::vector<float> got(tdm_model_param_elems(m));
    if (!ok(tdm_dev_copy_to_host(d, got.data(), tdm_model_params(m), got.size() * sizeof(float)),
            "tdm_dev_copy_to_host"))
        return 1;
    double diff = got.size() == want.size() ? 0.0 : 1e30;
    for (size_t i = 0; i < got.size() && i < want.size(); i++)
        diff = std::max(diff, (double)std::fabs(got[i] - want[i]));
    // the same step up to the order of the sums (two half-batch gradients
    // added, not one batch): within float32 rounding of the parameters
    if (!(diff <= kTol)) {
        std::fprintf(stderr, "cxx: rank %d: DDP's parameters are %g from one device's "
                     "(more than %g)\n", rank, diff, kTol);
        return 1;
    }
    if (rank == 0)
        std::printf("cxx: ddp %d ranks, %d steps: parameters within %g of one device's ok\n", world,
                    kSteps, diff);
    return 0;
}

}  // namespace

int main()
{
    std::vector<float> params;
    double first = 0, last = 0;
    if (!train_single(params, &first, &last)) return 1;
    std::printf("cxx: one device, %d steps: loss %.4f -> %.4f %s\n", kSteps, first, last,
                last < first ? "ok" : "did not fall");
    if (!(last < first)) return 1;
    std::fflush(stdout);  // the ranks are forked
    if (!ok(tdm_dist_spawn(2, ddp_rank, &params, nullptr, nullptr), "tdm_dist_spawn")) return 1;
    return 0;
}
