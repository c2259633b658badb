/* tests/test_pp_ckpt.c: a pipeline's checkpoint is the whole model's: the
 * state gathered from 3 (MLP) or 2 (GPT, with its tied embedding) stages
 * and written with tdm_checkpoint_save_host loads into one device
 * (parameters and optimizer as one device's after the same steps: bit for
 * bit for the MLP, within the tied embedding's rounding for the GPT); a
 * pipeline resumed from that file goes on exactly as an uninterrupted
 * pipeline (bit for bit), and as one device. */
#include <criterion/criterion.h>

#include "models/checkpoint.h"
#include "shm/spawn.h"
#include "tests/shm_test_util.h"
#include "tests/test_pp_util.h"
#include "tests/test_util.h"
#include "tests/timeout_util.h"

#define CB 24
#define CM 4
#define HALF 4

typedef struct ck_shared {
    float params[TPP_MAX_ELEMS], state[2][TPP_MAX_ELEMS], buffers[1024];
    int64_t steps;
    int status[4], refused[4];
    char err[4][512];
} ck_shared;

typedef struct ck_arg {
    ck_shared *sh;
    tpp_kind kind;
    const char *path;
    int load;           /* 1: load path first */
    int steps;          /* steps to run (from the loaded step on) */
    int save;           /* 1: gather and save to path at the end */
    int refuse;         /* 1: a gather the root refuses (no buffer) before the last step */
} ck_arg;

static int ck_rank(tdm_comm *comm, void *argp)
{
    ck_arg *a = argp;
    int r = tdm_comm_rank(comm);
    tdm_device *dev = NULL;
    tdm_pp *p = NULL;
    tdm_model *whole = NULL;
    tdm_model_spec spec;
    tpp_spec(a->kind, &spec);
    int in = tpp_in_features(&spec), rows = tpp_out_rows(&spec), classes = tpp_classes(&spec);
    char *x = malloc((size_t)CB * in * 4);
    int32_t *y = malloc((size_t)CB * rows * sizeof *y);
    tdm_optim_opts oo = tpp_optim(a->kind);
    tdm_pp_opts o = {.schedule = TDM_PP_1F1B, .micro_batches = CM, .seed = TPP_SEED, .optim = oo};
    /* the whole model: its tables for the file (never trained) */
    tdm_status st = tdm_device_open(&dev, "cpu", r, 1);
    if (!st) st = tdm_model_init(&whole, dev, &spec, TPP_SEED);
    if (!st) st = tdm_pp_init(&p, comm, dev, &spec, &o);
    static float hp[TPP_MAX_ELEMS], hs[2][TPP_MAX_ELEMS], hb[1024];
    tdm_ckpt_host h = {.params = hp, .buffers = tdm_model_buffer_elems(whole) ? hb : NULL,
                       .optim = &oo, .state = {hs[0], hs[1]}};
    tdm_ckpt_info info = {0};
    int first = 0;
    if (!st && a->load) {
        st = tdm_checkpoint_load_host(a->path, whole, &h, &info);
        if (!st) st = tdm_pp_load_state(p, &h);
        first = (int)info.step;
    }
    for (int s = first; !st && s < first + a->steps; s++) {
        if (a->refuse && s == first + a->steps - 1) {
            a->sh->refused[r] = tdm_pp_gather_params(p, NULL, 0);
            if (a->sh->refused[r] == TDM_STATUS_OK) a->sh->refused[r] = -1;
        }
        tpp_batch(&spec, in, rows, classes, s, CB, x, y);
        st = tdm_pp_step(p, x, y, CB, NULL);
    }
    if (!st && a->save) {
        tdm_ckpt_host g = {.params = a->sh->params, .buffers = h.buffers ? a->sh->buffers : NULL,
                           .optim = &oo, .state = {a->sh->state[0], a->sh->state[1]}};
        st = tdm_pp_gather_state(p, r == 0 ? &g : NULL, 0);
        tdm_ckpt_info wi = {.step = first + a->steps, .seed = TPP_SEED};
        if (!st && r == 0) {
            a->sh->steps = g.steps;
            st = tdm_checkpoint_save_host(a->path, whole, &g, &wi);
        }
    } else if (!st) {
        st = tdm_pp_gather_params(p, r == 0 ? a->sh->params : NULL, 0);
    }
    a->sh->status[r] = st;
    snprintf(a->sh->err[r], sizeof a->sh->err[r], "%s", st ? tdm_error_message() : "ok");
    tdm_pp_free(p);
    tdm_model_free(whole);
    tdm_device_free(dev);
    free(x);
    free(y);
    return st ? 3 : 0;
}

static void run(ck_arg *a, int S)
{
    memset(a->sh, 0, sizeof *a->sh);
    tdm_shm_spawn_opts so = {.timeout_ms = tu_scaled_ms(60000)};
    tdm_status st = tdm_shm_spawn(S, ck_rank, a, &so, NULL);
    cr_assert_eq(st, TDM_STATUS_OK, "%s / %s / %s", tdm_error_message(), a->sh->err[0],
                 a->sh->err[1]);
}

static void check_ckpt(tpp_kind kind, int S, double tol)
{
    char dir[128], path[256];
    tu_mkdtemp(dir, sizeof dir, "tdm_pp_ckpt");
    snprintf(path, sizeof path, "%s/pp.safetensors", dir);
    ck_shared *sh = mmap(NULL, sizeof *sh, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS,
                         -1, 0);
    cr_assert_neq(sh, MAP_FAILED);
    double loss[2 * HALF];
    static float ref_half[TPP_MAX_ELEMS], ref_end[TPP_MAX_ELEMS], whole8[TPP_MAX_ELEMS];
    int64_t n = 0;
    cr_assert_eq(tpp_reference(kind, CM, CB, HALF, loss, NULL, ref_half, &n), TDM_STATUS_OK);
    cr_assert_eq(tpp_reference(kind, CM, CB, 2 * HALF, loss, NULL, ref_end, &n), TDM_STATUS_OK);

    /* 4 steps, the whole state saved from stage 0 */
    ck_arg a = {.sh = sh, .kind = kind, .path = path, .steps = HALF, .save = 1};
    run(&a, S);
    cr_assert_eq(sh->steps, HALF);
    /* one device loads it: one device's state after the same 4 steps */
    tdm_device *dev;
    tdm_model *m;
    tdm_optim *opt;
    tdm_model_spec spec;
    tpp_spec(kind, &spec);
    tdm_optim_opts oo = tpp_optim(kind);
    cr_assert_eq(tdm_device_open(&dev, "cpu", 0, 1), TDM_STATUS_OK);
    cr_assert_eq(tdm_model_init(&m, dev, &spec, 77), TDM_STATUS_OK);
    cr_assert_eq(tdm_optim_init(&opt, m, &oo), TDM_STATUS_OK);
    tdm_ckpt_info info;
    cr_assert_eq(tdm_checkpoint_load(path, m, opt, &info), TDM_STATUS_OK, "%s",
                 tdm_error_message());
    cr_assert_eq(info.step, HALF);
    cr_assert_eq(tdm_optim_steps(opt), HALF);
    double d = tpp_max_diff(tdm_model_params(m), ref_half, n);
    cr_assert(d <= tol, "%s: the checkpoint's parameters are %g from one device's", tpp_kind_name(kind), d);

    /* resumed from it for 4 more steps ... */
    ck_arg b = {.sh = sh, .kind = kind, .path = path, .load = 1, .steps = HALF};
    run(&b, S);
    memcpy(whole8, sh->params, (size_t)n * 4);
    /* ... as 8 steps without a break, bit for bit */
    ck_arg c = {.sh = sh, .kind = kind, .path = path, .steps = 2 * HALF};
    run(&c, S);
    cr_assert(!memcmp(whole8, sh->params, (size_t)n * 4), "%s: the resumed pipeline differs",
              tpp_kind_name(kind));
    d = tpp_max_diff(whole8, ref_end, n);
    cr_assert(d <= tol, "%s: resumed parameters %g from one device's", tpp_kind_name(kind), d);
    tdm_optim_free(opt);
    tdm_model_free(m);
    tdm_device_free(dev);
    munmap(sh, sizeof *sh);
    tu_rmtree(dir);
}

/* A gather the root refuses (it passed no buffer) is refused on every
 * stage before anything is sent: before, the other stages sent their
 * slices anyway, and the root's next gather received those stale
 * messages, so a checkpoint taken after a caught error held the last
 * step's weights of the other stages. */
Test(pp_ckpt, a_gather_the_root_refuses_sends_nothing, .timeout = 120)
{
    ck_shared *sh = mmap(NULL, sizeof *sh, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS,
                         -1, 0);
    cr_assert_neq(sh, MAP_FAILED);
    static float plain[TPP_MAX_ELEMS];
    ck_arg a = {.sh = sh, .kind = TPP_MLP, .steps = 2};
    run(&a, 3);
    memcpy(plain, sh->params, sizeof plain);
    ck_arg b = {.sh = sh, .kind = TPP_MLP, .steps = 2, .refuse = 1};
    run(&b, 3);
    for (int r = 0; r < 3; r++)
        cr_assert_eq(sh->refused[r], TDM_STATUS_INVALID_ARG,
                     "stage %d: the refused gather returned %d, not INVALID_ARG", r,
                     sh->refused[r]);
    cr_assert(!memcmp(plain, sh->params, sizeof plain),
              "the root's gathered parameters are stale after a refused gather");
    munmap(sh, sizeof *sh);
}

/* the GPT's bound: test_pp.c's (the tied embedding's rounding, after 8
 * AdamW steps) */
Test(pp_ckpt, mlp_three_stages_save_load_resume, .timeout = 120) { check_ckpt(TPP_MLP, 3, 0.0); }
Test(pp_ckpt, gpt_two_stages_save_load_resume, .timeout = 120) { check_ckpt(TPP_GPT, 2, 1e-4); }
