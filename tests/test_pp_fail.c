/* tests/test_pp_fail.c: a pipeline fails fast and says who: a stage killed
 * mid-training is named by every other stage within DDP's bound (5 s,
 * tests/test_ddp_fail.c), nothing is left behind; a stage that stalls
 * makes its neighbours' send/recv deadlines fire naming the peer (its
 * rank, job rank and pid) and the transfer; bad configurations are
 * one-line errors on every stage (more stages than layers, M < 1, a split
 * out of range or not increasing), and a stage configured unlike the
 * others is named; and every transfer is labelled in the links' flight
 * recorders ("pp send act mb 0 stage 0->1"). */
#include <criterion/criterion.h>
#include <signal.h>
#include <unistd.h>

#include "core/timer.h"
#include "shm/spawn.h"
#include "tests/shm_test_util.h"
#include "tests/test_pp_util.h"
#include "tests/test_util.h"
#include "tests/timeout_util.h"

#include <dirent.h>

typedef struct fail_out {
    int status[TPP_MAX_RANKS];
    char err[TPP_MAX_RANKS][1024];
    double fail_ms[TPP_MAX_RANKS];
    double kill_ms;
} fail_out;

static fail_out *out_new(void)
{
    fail_out *o = mmap(NULL, sizeof *o, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    cr_assert_neq(o, MAP_FAILED);
    memset(o, 0, sizeof *o);
    return o;
}

typedef struct fail_arg {
    fail_out *out;
    int victim, at_step;
    int stall;             /* 1: the victim sleeps instead of dying */
    tdm_pp_opts opts;
    int bad_rank;          /* >= 0: this rank uses opts2 */
    tdm_pp_opts opts2;
} fail_arg;

#define STEPS 20
#define FB 32

static int fail_rank(tdm_comm *comm, void *argp)
{
    fail_arg *a = argp;
    int r = tdm_comm_rank(comm);
    tdm_device *dev = NULL;
    tdm_pp *p = NULL;
    tdm_model_spec spec;
    tpp_spec(TPP_MLP, &spec);
    float x[FB * 20];
    int32_t y[FB];
    tdm_status st = tdm_device_open(&dev, "cpu", r, 1);
    if (!st) st = tdm_pp_init(&p, comm, dev, &spec, r == a->bad_rank ? &a->opts2 : &a->opts);
    for (int s = 0; !st && s < STEPS; s++) {
        if (r == a->victim && s == a->at_step) {
            a->out->kill_ms = (double)tdm_time_ns() * 1e-6;
            if (a->stall) sleep(60);
            else raise(SIGKILL);
        }
        tpp_batch(&spec, 20, 1, 5, s, FB, x, y);
        st = tdm_pp_step(p, x, y, FB, NULL);
    }
    a->out->fail_ms[r] = (double)tdm_time_ns() * 1e-6;
    a->out->status[r] = st;
    snprintf(a->out->err[r], sizeof a->out->err[r], "%s", st ? tdm_error_message() : "ok");
    tdm_pp_free(p);
    tdm_device_free(dev);
    return st ? 3 : 0;
}

static tdm_pp_opts opts_of(tdm_pp_schedule_kind k, int M)
{
    return (tdm_pp_opts){.schedule = k, .micro_batches = M, .seed = 1, .optim = tpp_optim(TPP_MLP)};
}

TestSuite(pp_fail, .timeout = 120);

Test(pp_fail, killed_stage_is_named_by_every_other_stage)
{
    shm_t_adopt_orphans();
    int before = shm_t_segments_held();
    for (int k = 0; k < 2; k++) {
        fail_out *o = out_new();
        fail_arg a = {.out = o, .victim = 1, .at_step = 5, .opts = opts_of((tdm_pp_schedule_kind)k, 4),
                      .bad_rank = -1};
        tdm_shm_spawn_opts so = {.timeout_ms = tu_scaled_ms(30000)};
        tdm_status st = tdm_shm_spawn(4, fail_rank, &a, &so, NULL);
        cr_assert_eq(st, TDM_STATUS_PEER_FAILED, "%s", tdm_error_message());
        cr_assert(strstr(tdm_error_message(), "rank 1 (pid"), "%s", tdm_error_message());
        for (int r = 0; r < 4; r++) {
            if (r == 1) continue;
            cr_assert_neq(o->status[r], TDM_STATUS_OK, "stage %d did not fail", r);
            /* named: as the job's rank 1, or as rank 1 of a link */
            cr_assert(strstr(o->err[r], "rank 1 (pid") || strstr(o->err[r], "job rank 1, pid"),
                      "stage %d: %s", r, o->err[r]);
            cr_assert(strstr(o->err[r], "pp stage"), "stage %d: %s", r, o->err[r]);
            cr_assert_lt(o->fail_ms[r] - o->kill_ms, tu_scaled_ms(5000), "stage %d took %.0f ms",
                         r, o->fail_ms[r] - o->kill_ms);
        }
        munmap(o, sizeof *o);
    }
    cr_assert_eq(shm_t_segments_held(), before, "segments left behind");
}

/* The deadline that fires (stage 1 stalls at step 3) also bounds the
 * healthy transfers before it: 4 s, stretched under the sanitizers (as
 * tests/test_ddp_fail.c's stalled rank). */
#define STALL_DEADLINE_MS 4000

Test(pp_fail, stalled_stage_fires_its_neighbours_deadlines_naming_it)
{
    fail_out *o = out_new();
    fail_arg a = {.out = o, .victim = 1, .at_step = 3, .stall = 1,
                  .opts = opts_of(TDM_PP_1F1B, 4), .bad_rank = -1};
    tdm_shm_spawn_opts so = {.timeout_ms = tu_scaled_ms(40000),
                             .shm = {.timeout_ms = tu_scaled_ms(STALL_DEADLINE_MS)}};
    tdm_status st = tdm_shm_spawn(3, fail_rank, &a, &so, NULL);
    cr_assert_neq(st, TDM_STATUS_OK);

    /* stage 2 waits for an activation from stage 1, stage 0 for a
     * gradient: whichever deadline fired first is the job's reason, and
     * names stage 1 (rank 1 of the link, job rank 1), alive */
    cr_assert(strstr(tdm_error_message(), "waiting for rank 1 (job rank 1, pid") &&
                  strstr(tdm_error_message(), "alive"), "%s", tdm_error_message());
    int named = 0;
    for (int r = 0; r < 3; r += 2) {
        cr_assert_neq(o->status[r], TDM_STATUS_OK);
        cr_assert(strstr(o->err[r], "job rank 1"), "stage %d: %s", r, o->err[r]);
        cr_assert_lt(o->fail_ms[r] - o->kill_ms, tu_scaled_ms(STALL_DEADLINE_MS + 4500));
        /* the stage whose own deadline fired says which transfer */
        if (o->status[r] == TDM_STATUS_TIMEOUT)
            named += strstr(o->err[r], r == 0 ? "recv grad mb 0 from stage 1"
                                              : "recv act mb 0 from stage 1") != NULL;
    }
    cr_assert_geq(named, 1, "stage 0: %s / stage 2: %s", o->err[0], o->err[2]);
    munmap(o, sizeof *o);
}

/* --- configurations ---------------------------------------------------------- */

typedef struct cfg_arg {
    fail_out *out;
    tdm_pp_opts opts;
    const int *split;
    int odd_rank;          /* >= 0: this rank asks for M = 3 */
} cfg_arg;

static int cfg_rank(tdm_comm *comm, void *argp)
{
    cfg_arg *a = argp;
    int r = tdm_comm_rank(comm);
    tdm_device *dev = NULL;
    tdm_pp *p = NULL;
    tdm_model_spec spec;
    tpp_spec(TPP_MLP, &spec);
    tdm_pp_opts o = a->opts;
    o.split = a->split;
    if (r == a->odd_rank) o.micro_batches = 3;
    tdm_status st = tdm_device_open(&dev, "cpu", r, 1);
    if (!st) st = tdm_pp_init(&p, comm, dev, &spec, &o);
    a->out->status[r] = st;
    snprintf(a->out->err[r], sizeof a->out->err[r], "%s", st ? tdm_error_message() : "ok");
    tdm_pp_free(p);
    tdm_device_free(dev);
    return 0;
}

static void expect_cfg(int S, tdm_pp_opts o, const int *split, int odd, tdm_status want,
                       const char *msg)
{
    fail_out *out = out_new();
    cfg_arg a = {.out = out, .opts = o, .split = split, .odd_rank = odd};
    tdm_shm_spawn_opts so = {.timeout_ms = tu_scaled_ms(30000)};
    tdm_shm_spawn(S, cfg_rank, &a, &so, NULL);
    for (int r = 0; r < S; r++) {
        cr_assert_eq(out->status[r], want, "S=%d stage %d: %s", S, r, out->err[r]);
        cr_assert(strstr(out->err[r], msg), "stage %d: %s (expected '%s')", r, out->err[r], msg);
        cr_assert(!strchr(out->err[r], '\n'), "stage %d: %s", r, out->err[r]);
    }
    munmap(out, sizeof *out);
}

Test(pp_fail, bad_configurations_are_one_line_errors)
{
    tdm_pp_opts o = opts_of(TDM_PP_1F1B, 2);
    /* the MLP 20-24-16-12-5 has 4 layers */
    expect_cfg(5, o, NULL, -1, TDM_STATUS_INVALID_ARG, "more stages (5) than layers (4)");
    tdm_pp_opts z = o;
    z.micro_batches = 0;
    expect_cfg(2, z, NULL, -1, TDM_STATUS_INVALID_ARG, "0 micro-batches (expected at least 1)");
    expect_cfg(2, o, (const int[]){0, 4}, -1, TDM_STATUS_INVALID_ARG,
               "stage 1 starts at layer 4, out of range");
    expect_cfg(3, o, (const int[]){0, 2, 2}, -1, TDM_STATUS_INVALID_ARG,
               "the first layers must increase");
    expect_cfg(2, o, (const int[]){1, 3}, -1, TDM_STATUS_INVALID_ARG,
               "stage 0 must start at layer 0");
    /* a stage told another M is named by every stage */
    expect_cfg(3, o, NULL, 2, TDM_STATUS_MISMATCH,
               "stage 2 (rank 2) was configured with another micro-batches than stage 0 (3 vs 2)");
    /* and a good one works */
    expect_cfg(2, o, (const int[]){0, 3}, -1, TDM_STATUS_OK, "ok");
}

/* A stage handed no inputs refuses the step, and the stages waiting for
 * it stop with its reason instead of at their deadline (5 minutes). */
static int null_x_rank(tdm_comm *comm, void *argp)
{
    fail_out *o = argp;
    int r = tdm_comm_rank(comm);
    tdm_device *dev = NULL;
    tdm_pp *p = NULL;
    tdm_model_spec spec;
    tpp_spec(TPP_MLP, &spec);
    int32_t y[8] = {0};
    tdm_pp_opts opts = opts_of(TDM_PP_1F1B, 2);
    tdm_status st = tdm_device_open(&dev, "cpu", r, 1);
    if (!st) st = tdm_pp_init(&p, comm, dev, &spec, &opts);
    if (!st) st = tdm_pp_step(p, NULL, y, 8, NULL);
    o->status[r] = st;
    snprintf(o->err[r], sizeof o->err[r], "%s", st ? tdm_error_message() : "ok");
    tdm_pp_free(p);
    tdm_device_free(dev);
    return st ? 3 : 0;
}

Test(pp_fail, missing_inputs_stop_every_stage)
{
    fail_out *o = out_new();
    tdm_shm_spawn_opts so = {.timeout_ms = tu_scaled_ms(30000)};
    tdm_status st = tdm_shm_spawn(3, null_x_rank, o, &so, NULL);
    cr_assert_neq(st, TDM_STATUS_OK);
    cr_assert_eq(o->status[0], TDM_STATUS_INVALID_ARG, "%s", o->err[0]);
    cr_assert(strstr(o->err[0], "pp stage 0 of 3: step: the first stage needs the inputs"),
              "%s", o->err[0]);
    for (int r = 1; r < 3; r++)
        cr_assert(strstr(o->err[r], "the first stage needs the inputs"), "stage %d: %s", r,
                  o->err[r]);
    munmap(o, sizeof *o);
}

/* --- flight recorder ----------------------------------------------------------- */

static int fr_rank(tdm_comm *comm, void *argp)
{
    /* read when a communicator is made: the links' recorders dump there
     * when they are freed */
    setenv("TANDEM_FR_DUMP", (const char *)argp, 1);
    unsetenv("TANDEM_FR_DUMP_ON");
    int r = tdm_comm_rank(comm);
    tdm_device *dev = NULL;
    tdm_pp *p = NULL;
    tdm_model_spec spec;
    tpp_spec(TPP_MLP, &spec);
    float x[8 * 20];
    int32_t y[8];
    tdm_pp_opts o = opts_of(TDM_PP_GPIPE, 2);
    tpp_batch(&spec, 20, 1, 5, 0, 8, x, y);
    tdm_status st = tdm_device_open(&dev, "cpu", r, 1);
    if (!st) st = tdm_pp_init(&p, comm, dev, &spec, &o);
    if (!st) st = tdm_pp_step(p, x, y, 8, NULL);
    tdm_pp_free(p);
    tdm_device_free(dev);
    return st ? 1 : 0;
}

Test(pp_fail, every_transfer_is_labelled_in_the_flight_recorder)
{
    char dir[128];
    tu_mkdtemp(dir, sizeof dir, "tdm_pp_fr");
    tdm_shm_spawn_opts so = {.timeout_ms = tu_scaled_ms(30000)};
    cr_assert_eq(tdm_shm_spawn(2, fr_rank, dir, &so, NULL), TDM_STATUS_OK, "%s",
                 tdm_error_message());
    static char all[1 << 20];
    cr_assert_geq(tu_read_dir(dir, all, sizeof all), 0, "cannot read %s", dir);
    static const char *const want[] = {
        "pp send act mb 0 stage 0->1", "pp send act mb 1 stage 0->1",
        "pp recv act mb 0 stage 0->1", "pp recv act mb 1 stage 0->1",
        "pp send grad mb 0 stage 1->0", "pp send grad mb 1 stage 1->0",
        "pp recv grad mb 0 stage 1->0", "pp recv grad mb 1 stage 1->0",
    };
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++)
        cr_assert(strstr(all, want[i]), "'%s' is in no dump of %s", want[i], dir);
    tu_rmtree(dir);
}

/* tdm_pp_evaluate over a dataset of images: a model with several target
 * rows per sample (the GPT) or a dataset of another feature count is
 * refused on every stage, not read past its label buffer (valgrind saw a
 * read past the batch's labels, then labels of garbage). */
typedef struct eval_arg {
    fail_out *out;
    tpp_kind kind;
    int features;          /* the dataset's (w, with c = h = 1) */
} eval_arg;

static int eval_rank(tdm_comm *comm, void *argp)
{
    eval_arg *a = argp;
    int r = tdm_comm_rank(comm);
    tdm_device *dev = NULL;
    tdm_pp *p = NULL;
    tdm_model_spec spec;
    tpp_spec(a->kind, &spec);
    tdm_pp_opts o = opts_of(TDM_PP_1F1B, 2);
    o.optim = tpp_optim(a->kind);
    tdm_dataset d = {.n = 4, .c = 1, .h = 1, .w = a->features, .n_classes = 2};
    d.x = calloc((size_t)4 * a->features, sizeof(float));
    d.y = calloc(4, sizeof(int32_t));
    double loss = 0, acc = 0;
    tdm_status st = tdm_device_open(&dev, "cpu", r, 1);
    if (!st) st = tdm_pp_init(&p, comm, dev, &spec, &o);
    if (!st) st = tdm_pp_evaluate(p, &d, 4, &loss, &acc);
    a->out->status[r] = st;
    snprintf(a->out->err[r], sizeof a->out->err[r], "%s", st ? tdm_error_message() : "ok");
    tdm_pp_free(p);
    tdm_device_free(dev);
    free(d.x);
    free(d.y);
    return 0;
}

static void expect_eval(tpp_kind kind, int features, const char *msg)
{
    fail_out *out = out_new();
    eval_arg a = {.out = out, .kind = kind, .features = features};
    tdm_shm_spawn_opts so = {.timeout_ms = tu_scaled_ms(30000)};
    tdm_shm_spawn(2, eval_rank, &a, &so, NULL);
    for (int r = 0; r < 2; r++) {
        cr_assert_eq(out->status[r], TDM_STATUS_INVALID_ARG, "%s stage %d: %s",
                     tpp_kind_name(kind), r, out->err[r]);
        cr_assert(strstr(out->err[r], msg), "stage %d: %s (expected '%s')", r, out->err[r], msg);
    }
    munmap(out, sizeof *out);
}

Test(pp_fail, evaluating_a_dataset_the_model_cannot_take_is_refused)
{
    tdm_model_spec g;
    tpp_spec(TPP_GPT, &g);
    expect_eval(TPP_GPT, g.n_ctx, "a dataset of images");
    expect_eval(TPP_MLP, 7, "7 features per sample, the model takes 20");
}

/* A stage that cannot allocate its buffers for a larger batch stops the
 * others at once with its reason: every failure inside a step aborts the
 * pipeline (pp.h), not only those of the transfers, the forward and the
 * backward. Before, an allocation failure in the buffers, the schedule,
 * zero_grad, the tied gradient's buffer or a device copy returned on its
 * own stage only, and the others waited for it until their deadline and
 * then reported a timeout. Stage 1's address space is capped a few MiB
 * above what it uses after a first small step. */
#include <malloc.h>
#include <sys/resource.h>

static long long vm_bytes(void)
{
    long long pages = 0;
    FILE *f = fopen("/proc/self/statm", "r");
    if (f && fscanf(f, "%lld", &pages) != 1) pages = 0;
    if (f) fclose(f);
    return pages * sysconf(_SC_PAGESIZE);
}

static int oom_rank(tdm_comm *comm, void *argp)
{
    fail_out *o = argp;
    int r = tdm_comm_rank(comm);
    enum { BIG = 1 << 18 };
    /* a fixed threshold: blocks of 64 KiB and more are mapped each time
     * (glibc would raise it after a large free and serve them from space
     * its heaps hold already, out of the cap's reach) */
    mallopt(M_MMAP_THRESHOLD, 64 << 10);
    tdm_device *dev = NULL;
    tdm_pp *p = NULL;
    tdm_model_spec spec;
    tpp_spec(TPP_MLP, &spec);
    float *x = calloc((size_t)BIG * 20, sizeof *x);
    int32_t *y = calloc(BIG, sizeof *y);
    tdm_pp_opts opts = opts_of(TDM_PP_1F1B, 2);
    tdm_status st = x && y ? tdm_device_open(&dev, "cpu", r, 1) : TDM_STATUS_OUT_OF_MEMORY;
    if (!st) st = tdm_pp_init(&p, comm, dev, &spec, &opts);
    if (!st) st = tdm_pp_step(p, x, y, 8, NULL);
    if (!st && r == 1) {
        struct rlimit rl = {.rlim_cur = (rlim_t)(vm_bytes() + (4 << 20)),
                            .rlim_max = RLIM_INFINITY};
        if (setrlimit(RLIMIT_AS, &rl)) st = TDM_STATUS_SYSTEM;
    }
    uint64_t t0 = tdm_time_ns();
    long long vm0 = vm_bytes();
    if (!st) st = tdm_pp_step(p, x, y, BIG, NULL);
    if (getenv("TANDEM_TEST_VERBOSE"))
        fprintf(stderr, "stage %d: vm %lld -> %lld MiB\n", r, vm0 >> 20, vm_bytes() >> 20);
    o->fail_ms[r] = (double)(tdm_time_ns() - t0) * 1e-6;
    o->status[r] = st;
    snprintf(o->err[r], sizeof o->err[r], "%s", st ? tdm_error_message() : "ok");
    tdm_pp_free(p);
    tdm_device_free(dev);
    free(x);
    free(y);
    return st ? 3 : 0;
}

Test(pp_fail, a_stage_out_of_memory_stops_the_others_with_its_reason)
{
    fail_out *o = out_new();
    tdm_shm_spawn_opts so = {.timeout_ms = tu_scaled_ms(20000)};
    tdm_status st = tdm_shm_spawn(3, oom_rank, o, &so, NULL);
    cr_assert_neq(st, TDM_STATUS_OK, "the job went on: %s / %s / %s", o->err[0], o->err[1],
                  o->err[2]);
    cr_assert_eq(o->status[1], TDM_STATUS_OUT_OF_MEMORY, "stage 1: %s", o->err[1]);
    for (int r = 0; r < 3; r += 2) {
        cr_assert_neq(o->status[r], TDM_STATUS_OK, "stage %d went on", r);
        cr_assert(strstr(o->err[r], "pp stage 1 of 3"), "stage %d: %s", r, o->err[r]);
        cr_assert(!strstr(o->err[r], "timed out") && !strstr(o->err[r], "deadline"),
                  "stage %d waited for its deadline: %s", r, o->err[r]);
    }
    munmap(o, sizeof *o);
}
