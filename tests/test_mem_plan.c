/* tests/test_mem_plan.c: a run that cannot fit in memory is refused
 * before it starts, with the figures, instead of being OOM-killed; and a
 * large text is mapped, not copied. The model's footprint computed from
 * its spec (no allocation) equals what a model allocates; the plan's
 * formula (models/mem_plan.h) is checked term by term; end to end,
 * `train --model mlp:784-4096-4096-4096-4096-10` (the model with one
 * more layer: without the CUDA libraries' 100 MiB it now fits) in every
 * mode and a gpt in a
 * 512 MiB memory cgroup (or, where this machine cannot make one, under
 * TANDEM_TEST_MEM_LIMIT, which the same check reads): before, every mode
 * was OOM-killed (exit 137, no message; under the variable it ran on), and
 * a gpt on a 2 GB sparse file took 2.47 GB (killed in the cgroup). */
#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/magic.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include "models/mem_plan.h"
#include "models/model.h"
#include "tests/cli_util.h"
#include "tests/test_util.h"

static char g_dir[64];

static void setup(void) { tu_mkdtemp(g_dir, sizeof g_dir, "memplan"); }
static void teardown(void) { tu_rmtree(g_dir); }

TestSuite(memplan, .init = setup, .fini = teardown, .timeout = 300);

/* ---- the footprint: computed equals allocated ---------------------------- */

Test(memplan, footprint_from_the_spec_equals_what_the_model_allocates)
{
    tdm_device *dev = tu_host();
    const char *specs[] = {"mlp:784-64-10", "mlp:20-30-40-5", "cnn", "gpt:1-16-2-16",
                           "gpt:2-32-4-24", "file:examples/models/resnet_small.tdm",
                           "file:examples/models/lenet5.tdm", "file:examples/models/mlp_dropout.tdm"};
    const int batches[] = {1, 7, 32};
    tdm_rng r = tu_rng(3);
    for (size_t i = 0; i < sizeof specs / sizeof specs[0]; i++) {
        tdm_model_spec s;
        TU_OK(tdm_model_spec_parse(&s, specs[i]));
        for (size_t b = 0; b < 3; b++) {
            int B = batches[b];
            tdm_model_footprint fp;
            TU_OK(tdm_model_spec_footprint(&s, dev, B, &fp));
            tdm_model *m = NULL;
            TU_OK(tdm_model_init(&m, dev, &s, 1));
            int feat = tdm_model_in_features(m), rows = tdm_model_out_rows(m);
            int gpt = tdm_model_input_dtype(m) == TDM_MODEL_INPUT_TOKENS;
            void *x = malloc((size_t)B * feat * 4);
            int32_t *y = malloc((size_t)B * rows * 4);
            for (int64_t k = 0; k < (int64_t)B * feat; k++) {
                if (gpt) ((int32_t *)x)[k] = (int32_t)(tdm_rng_u32(&r) % 256);
                else ((float *)x)[k] = tu_unif(&r, -1, 1);
            }
            for (int64_t k = 0; k < (int64_t)B * rows; k++)
                y[k] = (int32_t)(tdm_rng_u32(&r) % (uint32_t)tdm_model_n_classes(m));
            double loss;
            TU_OK(tdm_model_forward_backward(m, x, y, B, &loss));
            tdm_model_memory mm;
            tdm_model_get_memory(m, &mm);
            cr_assert_eq(fp.param_elems, tdm_model_param_elems(m), "%s", specs[i]);
            cr_assert_eq(fp.buffer_elems, tdm_model_buffer_elems(m), "%s", specs[i]);
            cr_assert_eq(fp.act_bytes, mm.activations, "%s batch %d: computed %zu, allocated %zu",
                         specs[i], B, fp.act_bytes, mm.activations);
            free(x);
            free(y);
            tdm_model_free(m);
        }
    }
    tdm_device_free(dev);
}

/* ---- a replica's figures: the device planner's ----------------------------- */

/* tdm_mem_plan_model: the footprint's figures in fp32 without
 * checkpointing (activations within 0.2% from batch 32 on: the planner
 * rounds each allocation as the allocator does, and counts the step's
 * scratch), and what checkpointing and bf16 make of them on the GPT. */
Test(memplan, a_replicas_figures_are_the_planners)
{
    tdm_device *dev = tu_host();
    const char *specs[] = {"mlp:784-64-10", "mlp", "cnn", "gpt:2-32-2-16"};
    for (size_t i = 0; i < sizeof specs / sizeof specs[0]; i++) {
        tdm_model_spec s;
        TU_OK(tdm_model_spec_parse(&s, specs[i]));
        for (int B = 32; B <= 256; B *= 8) {
            tdm_model_footprint fp, pl;
            TU_OK(tdm_model_spec_footprint(&s, dev, B, &fp));
            tdm_plan_opts o;
            tdm_plan_opts_default(&o, &s, B);
            TU_OK(tdm_mem_plan_model(&o, &pl));
            cr_assert_eq(pl.param_elems, fp.param_elems, "%s", specs[i]);
            cr_assert_eq(pl.buffer_elems, fp.buffer_elems, "%s", specs[i]);
            cr_assert_eq(pl.largest_param_elems, fp.largest_param_elems, "%s", specs[i]);
            double d = ((double)pl.act_bytes - (double)fp.act_bytes) / (double)fp.act_bytes;
            cr_assert(fabs(d) <= 0.002, "%s batch %d: planner %zu, footprint %zu", specs[i], B,
                      pl.act_bytes, fp.act_bytes);
        }
    }
    tdm_model_spec g;
    TU_OK(tdm_model_spec_parse(&g, "gpt:4-64-4-64"));
    tdm_plan_opts o;
    tdm_plan_opts_default(&o, &g, 16);
    tdm_model_footprint base, ck, bf;
    TU_OK(tdm_mem_plan_model(&o, &base));
    o.ckpt = 1;
    TU_OK(tdm_mem_plan_model(&o, &ck));
    o.ckpt = 0;
    o.precision = TDM_PRECISION_BF16;
    TU_OK(tdm_mem_plan_model(&o, &bf));
    cr_assert(ck.act_bytes < base.act_bytes / 2, "checkpointed %zu vs %zu", ck.act_bytes,
              base.act_bytes);
    cr_assert(bf.act_bytes < base.act_bytes, "bf16 %zu vs %zu", bf.act_bytes, base.act_bytes);
    tdm_device_free(dev);
}

/* ---- the formula ----------------------------------------------------------- */

Test(memplan, formula_term_by_term)
{
    tdm_mem_plan_in in = {.model = {.param_elems = 1000, .buffer_elems = 24,
                                    .largest_param_elems = 400, .act_bytes = 5000},
                          .optim_states = 2, .replicas = 4, .processes = 4, .forks = 4,
                          .on_host = 1,
                          .data_bytes = 777, .shared_bytes = 9000};
    const uint64_t P = 1024 * 4, G = 1000 * 4, O = 2 * 1000 * 4, U = 400 * 4;
    const uint64_t own = TDM_MEM_PLAN_FORK_BYTES;
    struct { tdm_mem_shard s; uint64_t p, g, o; } c[] = {
        {TDM_MEM_SHARD_NONE, P, G, O},
        {TDM_MEM_SHARD_OPTIMIZER, P, G, O / 4},
        {TDM_MEM_SHARD_GRAD_OP, P, G / 4, O / 4},
        {TDM_MEM_SHARD_FULL, P / 4 + 2 * U, G / 4, O / 4},
    };
    for (size_t i = 0; i < sizeof c / sizeof c[0]; i++) {
        in.shard = c[i].s;
        tdm_mem_plan p;
        tdm_mem_plan_compute(&in, &p);
        cr_assert_eq(p.params, c[i].p, "shard %zu", i);
        cr_assert_eq(p.grads, c[i].g, "shard %zu", i);
        cr_assert_eq(p.optim, c[i].o, "shard %zu", i);
        cr_assert_eq(p.total, 4 * (c[i].p + c[i].g + 5000) + 4 * c[i].o + 4 * own + 777 + 9000,
                     "shard %zu", i);
    }
    /* dp: the replicas are threads of one process, one optimizer */
    in.shard = TDM_MEM_SHARD_NONE;
    in.processes = 1;
    in.forks = 0;
    tdm_mem_plan p;
    tdm_mem_plan_compute(&in, &p);
    cr_assert_eq(p.total, 4 * (P + G + 5000) + O + 777 + 9000);
    /* GPUs: only data, the segment and the forked processes are host memory */
    in.on_host = 0;
    in.forks = 2;
    tdm_mem_plan_compute(&in, &p);
    cr_assert_eq(p.total, 2 * own + 777 + 9000);
}

/* ---- end to end, in a small memory cgroup ------------------------------- */

/* Our memory cgroup's directory (v2, else v1's memory hierarchy) where a
 * child cgroup can be made; "" when there is none. */
static void my_memory_cgroup(char *dir, size_t n, int *v2)
{
    dir[0] = 0;
    FILE *f = fopen("/proc/self/cgroup", "r");
    char line[1024];
    while (f && fgets(line, sizeof line, f)) {
        line[strcspn(line, "\n")] = 0;
        char *a = strchr(line, ':'), *b = a ? strchr(a + 1, ':') : NULL;
        if (!a || !b) continue;
        *b = 0;
        if (!strcmp(line, "0") && !a[1]) {
            snprintf(dir, n, "/sys/fs/cgroup%s", b + 1);
            if (access(dir, W_OK) == 0) { *v2 = 1; break; }
            dir[0] = 0;
        } else if (strstr(a + 1, "memory")) {
            snprintf(dir, n, "/sys/fs/cgroup/memory%s", b + 1);
            *v2 = 0;
            if (access(dir, W_OK) == 0) break;
            dir[0] = 0;
        }
    }
    if (f) fclose(f);
}

/* Where the runs go: a memory cgroup of `limit` bytes when one can be
 * made here (procs: its cgroup.procs), else TANDEM_TEST_MEM_LIMIT. */
typedef struct mem_box {
    char cg[1100], procs[1200];
    int cgroup;
} mem_box;

static void box_open(mem_box *b, uint64_t limit)
{
    char base[1024], path[1200];
    int v2 = 0;
    memset(b, 0, sizeof *b);
    my_memory_cgroup(base, sizeof base, &v2);
    snprintf(b->cg, sizeof b->cg, "%s/tdm-memplan-%d", base, (int)getpid());
    if (base[0] && mkdir(b->cg, 0755) == 0) {
        snprintf(path, sizeof path, "%s/%s", b->cg, v2 ? "memory.max" : "memory.limit_in_bytes");
        FILE *f = fopen(path, "w");
        int ok = f && fprintf(f, "%llu\n", (unsigned long long)limit) > 0;
        if (f) ok = fclose(f) == 0 && ok;
        if (ok) {
            snprintf(b->procs, sizeof b->procs, "%s/cgroup.procs", b->cg);
            b->cgroup = 1;
            fprintf(stderr, "memplan: runs in memory cgroup %s (%llu bytes)\n", b->cg,
                    (unsigned long long)limit);
            return;
        }
        rmdir(b->cg);
    }
    char v[32];
    snprintf(v, sizeof v, "%llu", (unsigned long long)limit);
    setenv("TANDEM_TEST_MEM_LIMIT", v, 1);
    fprintf(stderr, "memplan: no memory cgroup here; TANDEM_TEST_MEM_LIMIT=%s\n", v);
}

static void box_close(mem_box *b)
{
    if (b->cgroup) rmdir(b->cg);
    unsetenv("TANDEM_TEST_MEM_LIMIT");
}

/* Runs tandem in the box; *maxrss_kb: the run's peak resident size. */
static void box_run(const mem_box *b, cli_result *r, long *maxrss_kb, const char *const *args)
{
    int fds[2];
    cr_assert(pipe(fds) == 0);
    pid_t pid = fork();
    cr_assert(pid >= 0);
    if (pid == 0) {
        if (b->cgroup) {
            FILE *f = fopen(b->procs, "w");
            if (!f || fprintf(f, "%d\n", (int)getpid()) < 0 || fclose(f)) _exit(126);
        }
        const char *argv[40];
        int n = 0;
        argv[n++] = cli_bin();
        for (int i = 0; args[i] && n < 39; i++) argv[n++] = args[i];
        argv[n] = NULL;
        dup2(fds[1], 1);
        dup2(fds[1], 2);
        close(fds[0]);
        alarm(240);
        execv(argv[0], (char *const *)argv);
        _exit(127);
    }
    close(fds[1]);
    size_t len = 0;
    ssize_t k;
    while ((k = read(fds[0], r->out + len, sizeof r->out - 1 - len)) > 0) len += (size_t)k;
    r->out[len] = 0;
    close(fds[0]);
    int ws;
    struct rusage ru;
    cr_assert_eq(wait4(pid, &ws, 0, &ru), pid);
    r->code = WIFEXITED(ws) ? WEXITSTATUS(ws) : 128 + WTERMSIG(ws);
    if (maxrss_kb) *maxrss_kb = ru.ru_maxrss;
}

#define BOX_RUN(b, r, rss, ...) box_run((b), (r), (rss), (const char *const[]){__VA_ARGS__, NULL})

#define WIDE "--model", "mlp:784-4096-4096-4096-4096-10", "--data", "synthetic", "--synthetic-size", \
             "1000", "--epochs", "1", "--quiet", "--no-eval"

Test(memplan, runs_that_cannot_fit_are_refused_with_the_figures)
{
    mem_box b;
    box_open(&b, (uint64_t)512 << 20);
    static cli_result r;
    const char *modes[][4] = {{"single", "cpu", "--sharding", NULL},
                              {"dp", "cpu:2", NULL, NULL},
                              {"ddp", "cpu:2", NULL, NULL},
                              {"fsdp", "cpu:2", "--sharding", "optimizer"}};
    for (int i = 0; i < 4; i++) {
        if (modes[i][3])
            BOX_RUN(&b, &r, NULL, "train", WIDE, "--mode", modes[i][0], "--device", modes[i][1],
                    modes[i][2], modes[i][3]);
        else
            BOX_RUN(&b, &r, NULL, "train", WIDE, "--mode", modes[i][0], "--device", modes[i][1]);
        cr_assert_eq(r.code, 1, "%s: exit %d (137: OOM-killed):\n%s", modes[i][0], r.code, r.out);
        cr_assert(strstr(r.out, "tandem train: memory: this run needs at least ") &&
                      strstr(r.out, "MiB are available") && strstr(r.out, "parameters 204.") &&
                      strstr(r.out, "docs/SECURITY.md"),
                  "%s:\n%s", modes[i][0], r.out);
    }
    /* the model that fits still runs there */
    BOX_RUN(&b, &r, NULL, "train", "--model", "mlp:784-64-10", "--data", "synthetic",
            "--synthetic-size", "1000", "--epochs", "1", "--mode", "ddp", "--device", "cpu:2");
    cr_assert_eq(r.code, 0, "%s", r.out);
    box_close(&b);
}

/* A gpt on a 2 GB sparse file: mapped, not read into memory. Before, the
 * file was read whole and its last 10% copied (2.47 GB peak), killed in a
 * 512 MiB cgroup. The file must be on a disk: a tmpfs file is memory
 * already, and mapping its holes allocates them. */
Test(memplan, a_large_text_is_mapped_not_copied)
{
    char path[128];
    snprintf(path, sizeof path, "%s/sparse.txt", g_dir);
    struct statfs fs;
    cr_assert_eq(statfs(g_dir, &fs), 0);
    if ((unsigned long)fs.f_type == TMPFS_MAGIC)
        cr_skip_test("%s is a tmpfs: a sparse file there is not what is measured", g_dir);
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    cr_assert_geq(fd, 0);
    const char hello[] = "hello, sparse world\n";
    cr_assert_eq(write(fd, hello, sizeof hello - 1), (ssize_t)(sizeof hello - 1));
    cr_assert_eq(ftruncate(fd, (off_t)2000 << 20), 0);
    close(fd);
    mem_box b;
    box_open(&b, (uint64_t)512 << 20);
    static cli_result r;
    long rss_kb = 0;
    BOX_RUN(&b, &r, &rss_kb, "train", "--model", "gpt:1-16-2-16", "--data", path, "--epochs",
            "1", "--max-steps", "2", "--quiet");
    box_close(&b);
    fprintf(stderr, "memplan: gpt on a 2000 MiB sparse file: exit %d, peak RSS %.1f MiB\n",
            r.code, rss_kb / 1024.0);
    cr_assert_eq(r.code, 0, "exit %d (137: OOM-killed):\n%s", r.code, r.out);
    cr_assert(strstr(r.out, "2097152000 bytes"), "%s", r.out);
    /* a copy needs at least the file: 2000 MiB (the process's own
     * baseline, its libraries, is about 230 MiB here) */
    cr_assert_lt(rss_kb, 1000 * 1024, "peak RSS %.1f MiB for a mapped text", rss_kb / 1024.0);
}

/* Tensor parallelism's ranks each hold their slices (tdm_tp_footprint,
 * which tests/test_tp.c holds to what a rank allocates): the wide MLP on
 * 2 tp ranks and on dp=2 x tp=2 is refused with its per-rank figures
 * (half, a quarter of each split layer's parameters), and a model that
 * fits runs. Before, tp was planned as if every rank held the whole
 * model. */
Test(memplan, tensor_parallel_runs_are_planned_per_rank)
{
    mem_box b;
    box_open(&b, (uint64_t)512 << 20);
    static cli_result r;
    BOX_RUN(&b, &r, NULL, "train", WIDE, "--mode", "tp", "--device", "cpu:2");
    cr_assert_eq(r.code, 1, "exit %d (137: OOM-killed):\n%s", r.code, r.out);
    cr_assert(strstr(r.out, "tandem train: memory: this run needs at least ") &&
                  strstr(r.out, "2 replicas x (parameters 102.3"), "%s", r.out);
    BOX_RUN(&b, &r, NULL, "train", WIDE, "--mode", "tp", "--device", "cpu:4", "--mesh",
            "dp=2,tp=2");
    cr_assert_eq(r.code, 1, "exit %d (137: OOM-killed):\n%s", r.code, r.out);
    cr_assert(strstr(r.out, "4 replicas x (parameters 102.3"), "%s", r.out);
    BOX_RUN(&b, &r, NULL, "train", "--model", "mlp:784-64-64-10", "--data", "synthetic",
            "--synthetic-size", "1000", "--epochs", "1", "--mode", "tp", "--device", "cpu:2");
    cr_assert_eq(r.code, 0, "%s", r.out);
    box_close(&b);
}
