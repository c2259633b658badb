/* tests/test_mpi_ddp.c: DDP in the ranks of an MPI job, over each
 * backend of the job (shm, mpi, hier), against one device on the same
 * global batches: every step's loss and the final parameters within DDP's
 * bounds, every rank ending with bitwise the same parameters, and shm vs
 * hier bitwise equal where they reduce in the same order. Also the CLI:
 * `mpirun -np 2 tandem train --mode ddp` prints what the forked run prints.
 * One mpirun per test (tests/mpi_test_util.h); the backends run one after
 * the other inside it. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ddp/ddp.h"
#include "mpi/job.h"
#include "tests/mpi_test_util.h"
#include "tests/test_ddp_util.h"
#include "mpi/mpi_weak.h"

#define W_STEPS 12
#define W_BATCH 23     /* uneven shares for 2..4 ranks */

/* FNV-1a of the bytes: a fingerprint of parameters for bitwise checks
 * between runs. */
static uint64_t w_fnv(const void *p, size_t n)
{
    const unsigned char *b = p;
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 1099511628211ull;
    return h;
}

/* One DDP run on comm: losses (rank 0's view, from the all-reduce) and
 * the final parameters. */
static int w_train(tdm_comm *comm, int cnn, const tdm_dataset *data, double *loss, float *params,
                   int64_t *n_elem)
{
    int rank = tdm_comm_rank(comm), world = tdm_comm_size(comm);
    tdm_status st = TDM_STATUS_OK;
    tdm_device *dev = NULL;
    tdm_model *m = NULL;
    tdm_optim *opt = NULL;
    tdm_ddp *ddp = NULL;
    tdm_model_spec spec;
    int64_t feat = tdm_data_features(data);
    int64_t *perm = malloc((size_t)data->n * sizeof *perm);
    float *x = malloc((size_t)W_BATCH * (size_t)feat * sizeof *x);
    int32_t *y = malloc((size_t)W_BATCH * sizeof *y);
    if (!perm || !x || !y) { st = TDM_STATUS_OUT_OF_MEMORY; goto fail; }
    tddp_spec(&spec, cnn);
    TDM_TRY(tdm_device_open(&dev, "cpu", rank, 1));
    TDM_TRY(tdm_model_init(&m, dev, &spec, 5));
    tdm_ddp_opts o = {.bucket_cap_bytes = 512, .timeout_ms = 60000};  /* several buckets */
    TDM_TRY(tdm_ddp_init(&ddp, m, comm, &o));
    TDM_TRY(tdm_sgd_init(&opt, m, 0.05f, 0.9f));
    tdm_train_epoch_order(perm, data->n, 1, 0);
    for (int s = 0; s < W_STEPS; s++) {
        const int64_t *g = perm + (int64_t)s * W_BATCH;
        int lo = (int)((int64_t)rank * W_BATCH / world), hi = (int)((int64_t)(rank + 1) * W_BATCH / world);
        tdm_data_gather(data, g + lo, hi - lo, x, y);
        double ls = 0;
        TDM_TRY(tdm_ddp_zero_grad(ddp));
        TDM_TRY(tdm_ddp_forward_scaled(ddp, x, y, hi - lo, 1.0f / W_BATCH, &ls));
        TDM_TRY(tdm_ddp_backward(ddp));
        TDM_TRY(tdm_ddp_step(ddp, opt));
        loss[s] = tdm_ddp_loss_sum(ddp) / W_BATCH;
    }
    *n_elem = tdm_model_param_elems(m);
    memcpy(params, tdm_model_params(m), (size_t)*n_elem * sizeof(float));
fail:
    if (st) fprintf(stderr, "rank %d: DDP over %s: %s\n", rank, tdm_comm_backend_name(comm),
                    tdm_error_message());
    free(perm);
    free(x);
    free(y);
    tdm_ddp_free(ddp);
    tdm_optim_free(opt);
    tdm_model_free(m);
    tdm_device_free(dev);
    return st ? 1 : 0;
}

/* argv: mlp|cnn, then backends. Prints per backend "ddp <b>: ok, params
 * <fnv>" on rank 0 when it is within DDP's bounds of one device and every
 * rank agrees bitwise. */
static int w_ddp(int argc, char **argv)
{
    if (argc < 2) return 99;
    int cnn = !strcmp(argv[0], "cnn");
    tdm_mpi_job *job = NULL;
    if (tdm_mpi_job_init(&job, NULL)) {
        fprintf(stderr, "job: %s\n", tdm_error_message());
        return 1;
    }
    const tdm_mpi_topo *t = tdm_mpi_job_topo(job);
    tdm_dataset data = {0};
    int bad = 0;
    if (tddp_data(&data, cnn, 1024)) return 1;
    static double loss[W_STEPS], ref_loss[W_STEPS];
    static float params[TDDP_MAX_ELEMS], got0[TDDP_MAX_ELEMS], ref_p[TDDP_MAX_ELEMS];
    int64_t n = 0, rn = 0;
    if (t->rank == 0) {
        tddp_cfg c = tddp_cfg_default();
        c.cnn = cnn;
        c.batch = W_BATCH;
        c.steps = W_STEPS;
        if (tddp_reference(&c, &data, ref_loss, NULL, ref_p, &rn)) {
            fprintf(stderr, "reference: %s\n", tdm_error_message());
            bad = 1;
        }
    }
    for (int i = 1; i < argc && !bad; i++) {
        tdm_mpi_backend b = !strcmp(argv[i], "shm") ? TDM_MPI_BACKEND_SHM
                            : !strcmp(argv[i], "hier") ? TDM_MPI_BACKEND_HIER
                                                       : TDM_MPI_BACKEND_MPI;
        tdm_shm_opts so = {.arena_bytes = 1 << 20, .timeout_ms = 60000};
        tdm_comm *comm = NULL;
        if (tdm_mpi_job_comm(job, b, &so, &comm)) {
            fprintf(stderr, "rank %d: %s: %s\n", t->rank, argv[i], tdm_error_message());
            return 1;
        }
        if (w_train(comm, cnn, &data, loss, params, &n)) return 1;
        /* every rank ends with rank 0's parameters, bit for bit */
        memcpy(got0, params, (size_t)n * sizeof(float));
        int32_t differ = 0, any = 0;
        if (tdm_comm_broadcast(comm, got0, got0, (size_t)n, TDM_DTYPE_FLOAT32, 0) ||
            (differ = memcmp(got0, params, (size_t)n * sizeof(float)) != 0,
             tdm_comm_all_reduce(comm, &differ, &any, 1, TDM_DTYPE_INT32, TDM_REDOP_MAX))) {
            fprintf(stderr, "rank %d: %s: %s\n", t->rank, argv[i], tdm_error_message());
            return 1;
        }
        tdm_comm_free(comm);
        if (t->rank != 0) continue;
        if (any) {
            fprintf(stderr, "%s: ranks ended with different parameters\n", argv[i]);
            bad = 1;
        }
        /* DDP's bounds (tests/test_ddp.c's over 12 steps) */
        for (int s = 0; s < W_STEPS; s++)
            if (fabs(loss[s] - ref_loss[s]) > 1e-5 + 1e-4 * fabs(ref_loss[s])) {
                fprintf(stderr, "%s: step %d loss %.8f vs one device %.8f\n", argv[i], s, loss[s],
                        ref_loss[s]);
                bad = 1;
            }
        int64_t at = 0;
        if (n != rn || tddp_excess(params, ref_p, n, 1e-4, 1e-3, &at) > 0) {
            fprintf(stderr, "%s: param[%lld] %g vs one device %g\n", argv[i], (long long)at,
                    params[at], ref_p[at]);
            bad = 1;
        }
        if (!bad)
            printf("ddp %s: ok over %d ranks on %d machines, params %016llx\n", argv[i], t->size,
                   t->n_machines, (unsigned long long)w_fnv(params, (size_t)n * sizeof(float)));
    }
    tdm_data_free(&data);
    tdm_mpi_job_free(job);
    return bad;
}

static const mpi_t_worker workers[] = {{"ddp", w_ddp}};
MPI_T_WORKERS(workers)

static cli_result res;

/* "params <hex>" of backend b in out; fails the test when missing. */
static void params_of(const char *out, const char *b, char *hex)
{
    char key[32];
    snprintf(key, sizeof key, "ddp %s: ok", b);
    const char *p = strstr(out, key);
    cr_assert_not_null(p, "no '%s' in:\n%s", key, out);
    p = strstr(p, "params ");
    cr_assert_not_null(p);
    snprintf(hex, 17, "%s", p + 7);
}

/* Runs the ddp worker; hex[i] gets backends[i]'s parameter fingerprint. */
static void ddp_job(int np, const char *model, const char *pretend, const char *const *backends,
                    char hex[][17])
{
    MPI_T_NEED();
    const char *args[8] = {model};
    int k = 1;
    for (int i = 0; backends[i] && k < 7; i++) args[k++] = backends[i];
    args[k] = NULL;
    char env0[64];
    snprintf(env0, sizeof env0, "%s=%s", TDM_MPI_ENV_PRETEND, pretend ? pretend : "");
    const char *env[] = {env0, NULL};
    mpi_t_job j = {.np = np, .worker = "ddp", .args = args, .env = env, .tcp = pretend != NULL,
                   .timeout_s = 150};
    mpi_t_run(&res, &j);
    expect(&res, 0, NULL);
    for (int i = 0; backends[i]; i++) params_of(res.out, backends[i], hex[i]);
}

static const char *const b_all[] = {"shm", "mpi", "hier", NULL};

/* One machine: every backend within DDP's bounds of one device, and hier
 * (shm's own all-reduce there) bit for bit shm. */
Test(mpi_ddp, mlp_over_every_backend_1_to_3_ranks, .timeout = 400)
{
    for (int np = 1; np <= 3; np++) {
        char hex[3][17];
        ddp_job(np, "mlp", NULL, b_all, hex);
        cr_assert_str_eq(hex[0], hex[2], "%d ranks: shm %s, hier %s", np, hex[0], hex[2]);
    }
}

/* Two pretend machines of one rank: hier's network all-reduce adds the
 * same two numbers as shm does, so the training is bitwise shm's. */
Test(mpi_ddp, hier_on_2x1_is_bitwise_shm, .timeout = 300)
{
    static const char *const shm[] = {"shm", NULL}, *const hier[] = {"hier", "mpi", NULL};
    char a[1][17], b[2][17];
    ddp_job(2, "mlp", NULL, shm, a);
    ddp_job(2, "mlp", "2", hier, b);
    cr_assert_str_eq(a[0], b[0], "shm %s, hier on 2 machines %s", a[0], b[0]);
}

/* 2 machines x 2 ranks over TCP: within DDP's bounds (not bitwise: the
 * machines' sums are added in another order than shm's rank order). */
Test(mpi_ddp, hier_on_2x2_within_bounds, .timeout = 300)
{
    static const char *const b[] = {"hier", "mpi", NULL};
    char hex[2][17];
    ddp_job(4, "mlp", "2", b, hex);
}

/* the epoch lines (losses, accuracy) of `tandem train`, without timings */
static void epochs_of(const char *out, char *buf, size_t len)
{
    char one[256], two[256];
    epoch_result(out, "epoch 1/2", one, sizeof one);
    epoch_result(out, "epoch 2/2", two, sizeof two);
    snprintf(buf, len, "%s / %s", one, two);
}

Test(mpi_ddp, train_under_mpirun_prints_what_the_forked_run_prints, .timeout = 200)
{
    MPI_T_NEED();
    const char *args[] = {"train", "--mode", "ddp", "--data", "synthetic", "--synthetic-size",
                          "1024", "--epochs", "2", "--model", "mlp:784-32-10", "--device",
                          "cpu:2", "--batch", "64", "--backend", "mpi", NULL};
    mpi_t_job j = {.np = 2, .exe = cli_bin(), .args = args, .timeout_s = 150};
    mpi_t_run(&res, &j);
    expect(&res, 0, "2 MPI ranks on cpu:2 (mpi, 2 ranks on 1 machine; gradients over mpi, timeout");
    char under_mpi[600], forked[600];
    epochs_of(res.out, under_mpi, sizeof under_mpi);
    /* two ranks: each element is a + b either way, so bit for bit */
    CLI(&res, "train", "--mode", "ddp", "--data", "synthetic", "--synthetic-size", "1024",
        "--epochs", "2", "--model", "mlp:784-32-10", "--device", "cpu:2", "--batch", "64");
    expect(&res, 0, "2 processes on cpu:2 (shm communicator");
    epochs_of(res.out, forked, sizeof forked);
    cr_assert_str_eq(under_mpi, forked);
}

Test(mpi_ddp, train_backend_flags, .timeout = 60)
{
    CLI(&res, "train", "--mode", "ddp", "--backend", "udp");
    expect(&res, 2, "--backend 'udp': expected auto, shm, mpi or hier");
    CLI(&res, "train", "--backend", "mpi");
    expect(&res, 2, "--backend applies to --mode ddp");
    if (tdm_comm_init_mpi) {
        CLI(&res, "train", "--mode", "ddp", "--backend", "mpi", "--data", "synthetic");
        expect(&res, 2, "mpirun -np N tandem train --mode ddp --backend mpi");
    } else {
        CLI(&res, "train", "--mode", "ddp", "--backend", "hier", "--data", "synthetic");
        expect(&res, 1, "this tandem was built without MPI");
    }
}

/* compare's DDP column from an MPI job: rank 0 gathers the other ranks'
 * records over the communicator, so a wrong rank must still fail it */
Test(mpi_ddp, compare_under_mpirun, .timeout = 300)
{
    MPI_T_NEED();
    const char *args[] = {"compare", "--data", "synthetic", "--model", "mlp:784-32-10",
                          "--batch", "32", "--steps", "6", "--backend", "mpi", NULL};
    mpi_t_job j = {.np = 3, .exe = cli_bin(), .args = args, .tcp = 1, .timeout_s = 150};
    mpi_t_run(&res, &j);
    expect(&res, 0, "DDP's ranks: the MPI job's (mpi, 3 ranks on 1 machine)");
    expect(&res, 0, "DDP(3)");
    expect(&res, 0, "DDP: every rank ended with bitwise the same parameters as rank 0");
    expect(&res, 0, "verdict: PASS");
    const char *bad[] = {"compare", "--data", "synthetic", "--model", "mlp:784-32-10",
                         "--batch", "32", "--steps", "6", "--backend", "mpi", "--perturb-rank",
                         "2", NULL};
    j.args = bad;
    mpi_t_run(&res, &j);
    cr_assert_eq(res.code, 3, "exit %d:\n%s", res.code, res.out);
    cr_assert(strstr(res.out, "DDP vs single") && strstr(res.out, "FAIL"), "%s", res.out);
    const char *sweep[] = {"compare", "--data", "synthetic", "--sweep", "1,2", NULL};
    j.args = sweep;
    mpi_t_run(&res, &j);
    cr_assert_eq(res.code, 2, "exit %d:\n%s", res.code, res.out);
}

/* compare's sharded modes from an MPI job, over each backend: the job's
 * ranks run FSDP, ZeRO-2 and ZeRO-1 after DDP, as forked ranks do without
 * mpirun, rank 0 gathers their records (the verdict compares them with
 * one device: a record missing a rank's loss would fail it), and with two
 * ranks (a + b either way) each equals DDP bit for bit */
Test(mpi_ddp, compare_sharded_modes_under_mpirun, .timeout = 400)
{
    MPI_T_NEED();
    static const char *const backends[] = {"shm", "mpi", "hier"};
    static const char *const modes[] = {"FSDP", "ZeRO-2", "ZeRO-1"};
    for (int b = 0; b < 3; b++) {
        const char *args[] = {"compare", "--data", "synthetic", "--model", "mlp:784-32-10",
                              "--batch", "32", "--steps", "6", "--modes", "ddp,fsdp,zero2,zero1",
                              "--backend", backends[b], NULL};
        mpi_t_job j = {.np = 2, .exe = cli_bin(), .args = args, .timeout_s = 150};
        mpi_t_run(&res, &j);
        char want[96];
        snprintf(want, sizeof want, "the MPI job's (%s, 2 ranks on 1 machine)", backends[b]);
        expect(&res, 0, want);
        cr_expect(!strstr(res.out, "skipped"), "--backend %s:\n%s", backends[b], res.out);
        for (int m = 0; m < 3; m++) {
            snprintf(want, sizeof want, "running %s...", modes[m]);
            expect(&res, 0, want);
            snprintf(want, sizeof want, "%s(2)", modes[m]);
            expect(&res, 0, want);
            snprintf(want, sizeof want, "%s vs DDP: bitwise the same parameters", modes[m]);
            expect(&res, 0, want);
        }
        cr_expect(!strstr(res.out, "ranks gathered different parameters"), "%s", res.out);
        expect(&res, 0, "verdict: PASS");
    }
    /* a perturbed rank of a sharded mode fails the verdict: rank 1's
     * records reach rank 0 */
    const char *bad[] = {"compare", "--data", "synthetic", "--model", "mlp:784-32-10",
                         "--batch", "32", "--steps", "6", "--modes", "zero1", "--backend", "mpi",
                         "--perturb-rank", "1", NULL};
    mpi_t_job j = {.np = 2, .exe = cli_bin(), .args = bad, .timeout_s = 150};
    mpi_t_run(&res, &j);
    cr_assert_eq(res.code, 3, "exit %d:\n%s", res.code, res.out);
    const char *line = strstr(res.out, "ZeRO-1 vs single");
    cr_assert_not_null(line, "%s", res.out);
    int len = (int)strcspn(line, "\n");
    cr_assert(strstr(line, "FAIL") && strstr(line, "FAIL") < line + len, "%.*s\n%s", len, line,
              res.out);
}

/* "train loss X" and "val loss Y nats" of a gpt run's epoch line */
static void gpt_losses(const char *out, char *buf, size_t len)
{
    const char *p = strstr(out, "epoch 1/1: train loss ");
    cr_assert_not_null(p, "no epoch line in:\n%s", out);
    const char *t = strchr(p + 22, ',');
    const char *v = strstr(p, "val loss ");
    cr_assert(t && v, "%s", out);
    const char *ve = strstr(v, " nats");
    cr_assert_not_null(ve);
    snprintf(buf, len, "%.*s | %.*s", (int)(t - p), p, (int)(ve - v), v);
}

Test(mpi_ddp, gpt_under_mpirun_trains_as_the_forked_run, .timeout = 200)
{
    MPI_T_NEED();
    char dir[] = "/tmp/tandem-test-gpt-XXXXXX", path[64];
    cr_assert_not_null(mkdtemp(dir));
    snprintf(path, sizeof path, "%s/text.txt", dir);
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f);
    for (int i = 0; i < 400; i++)
        fprintf(f, "line %d: the quick brown fox jumps over the lazy dog %d times.\n", i, i % 7);
    fclose(f);
    const char *args[] = {"train", "--model", "gpt:1-16-2-16", "--mode", "ddp", "--data", path,
                          "--epochs", "1", "--max-steps", "5", "--backend", "mpi", "--quiet",
                          NULL};
    mpi_t_job j = {.np = 2, .exe = cli_bin(), .args = args, .timeout_s = 150};
    mpi_t_run(&res, &j);
    expect(&res, 0, NULL);
    char under_mpi[256], forked[256];
    gpt_losses(res.out, under_mpi, sizeof under_mpi);
    CLI(&res, "train", "--model", "gpt:1-16-2-16", "--mode", "ddp", "--device", "cpu:2",
        "--data", path, "--epochs", "1", "--max-steps", "5", "--quiet");
    expect(&res, 0, NULL);
    gpt_losses(res.out, forked, sizeof forked);
    cr_assert_str_eq(under_mpi, forked);
    unlink(path);
    rmdir(dir);
}

/* The GPU path under mpirun, on the host: emulated GPUs (NCCL cannot use
 * host memory, so their gradients go over the job's host communicator -
 * here hier - with DDP's device staging on the way). The run must print
 * the forked run's epochs to the digit, and its header must not claim
 * shm when the job reduces over hier. */
Test(mpi_ddp, emulated_gpus_under_mpirun_train_as_the_forked_run, .timeout = 200)
{
    MPI_T_NEED();
    const char *env[] = {"TANDEM_CUDA_EMULATOR=2", NULL};
    const char *args[] = {"train", "--mode", "ddp", "--data", "synthetic", "--synthetic-size",
                          "1024", "--epochs", "2", "--model", "mlp:784-32-10", "--device",
                          "cuda", "--batch", "64", "--backend", "hier", NULL};
    mpi_t_job j = {.np = 2, .exe = cli_bin(), .args = args, .env = env, .timeout_s = 150};
    mpi_t_run(&res, &j);
    expect(&res, 0, "2 MPI ranks on cuda (hier, 2 ranks on 1 machine; gradients over hier");
    expect(&res, 0, "CUDA EMULATOR (TANDEM_CUDA_EMULATOR=2)");
    cr_assert_null(strstr(res.out, "reducing over shm"), "the header claims shm:\n%s", res.out);
    char under_mpi[600], forked[600];
    epochs_of(res.out, under_mpi, sizeof under_mpi);
    setenv("TANDEM_CUDA_EMULATOR", "2", 1);
    CLI(&res, "train", "--mode", "ddp", "--data", "synthetic", "--synthetic-size", "1024",
        "--epochs", "2", "--model", "mlp:784-32-10", "--device", "cuda", "--batch", "64");
    unsetenv("TANDEM_CUDA_EMULATOR");
    expect(&res, 0, "2 processes on cuda (shm communicator");
    epochs_of(res.out, forked, sizeof forked);
    cr_assert_str_eq(under_mpi, forked);
}
