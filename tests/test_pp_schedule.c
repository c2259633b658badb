/* tests/test_pp_schedule.c: pipeline schedules as data (GPipe, 1F1B) and
 * splits (pp/pp.h), without processes: the action lists, their text, the
 * activations each stage holds, the check, the unit-time bubble
 * (S - 1) / (M + S - 1), schedule names; explicit splits and their
 * one-line errors, and the balanced default. */
#include <criterion/criterion.h>
#include <string.h>

#include "models/gpt.h"
#include "pp/pp.h"

static tdm_pp_schedule *build(tdm_pp_schedule_kind k, int S, int M)
{
    tdm_pp_schedule *s = NULL;
    cr_assert_eq(tdm_pp_schedule_build(&s, k, S, M), TDM_STATUS_OK, "%s", tdm_error_message());
    return s;
}

static void expect_text(tdm_pp_schedule_kind k, int S, int M, const char *const *want)
{
    tdm_pp_schedule *s = build(k, S, M);
    char buf[256];
    for (int st = 0; st < S; st++)
        cr_assert_str_eq(tdm_pp_schedule_format(s, st, buf, sizeof buf), want[st],
                         "%s S=%d M=%d stage %d", tdm_pp_schedule_name(k), S, M, st);
    tdm_pp_schedule_free(s);
}

Test(pp_schedule, known_orders)
{
    expect_text(TDM_PP_GPIPE, 2, 3, (const char *const[]){"F0 F1 F2 B0 B1 B2", "F0 F1 F2 B0 B1 B2"});
    expect_text(TDM_PP_1F1B, 2, 2, (const char *const[]){"F0 F1 B0 B1", "F0 B0 F1 B1"});
    /* Megatron's order for 4 stages, 6 micro-batches */
    expect_text(TDM_PP_1F1B, 4, 6,
                (const char *const[]){"F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5",
                                      "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 B4 B5",
                                      "F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 B5",
                                      "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5"});
    /* fewer micro-batches than stages: warm-up is cut short */
    expect_text(TDM_PP_1F1B, 3, 1, (const char *const[]){"F0 B0", "F0 B0", "F0 B0"});
    expect_text(TDM_PP_1F1B, 1, 3, (const char *const[]){"F0 B0 F1 B1 F2 B2"});
}

Test(pp_schedule, every_size_checks_holds_and_bubbles_as_theory)
{
    for (int k = 0; k < TDM_PP_SCHEDULE_COUNT_; k++)
        for (int S = 1; S <= 6; S++)
            for (int M = 1; M <= 10; M++) {
                tdm_pp_schedule *s = build((tdm_pp_schedule_kind)k, S, M);
                cr_assert_eq(tdm_pp_schedule_check(s), TDM_STATUS_OK, "%s", tdm_error_message());
                for (int st = 0; st < S; st++) {
                    int want = k == TDM_PP_GPIPE ? M : (S - st < M ? S - st : M);
                    cr_assert_eq(tdm_pp_schedule_in_flight(s, st), want, "%s S=%d M=%d stage %d",
                                 tdm_pp_schedule_name((tdm_pp_schedule_kind)k), S, M, st);
                }
                int span;
                double idle;
                cr_assert_eq(tdm_pp_schedule_simulate(s, &span, &idle), TDM_STATUS_OK);
                cr_assert_eq(span, 2 * (M + S - 1), "S=%d M=%d", S, M);
                cr_assert_float_eq(idle, (double)(S - 1) / (M + S - 1), 1e-12);
                tdm_pp_schedule_free(s);
            }
}

Test(pp_schedule, check_refuses_bad_orders_and_names)
{
    tdm_pp_schedule *s = build(TDM_PP_1F1B, 2, 3);
    tdm_pp_action t = s->actions[1][0];
    s->actions[1][0] = s->actions[1][1];   /* B0 before F0 */
    s->actions[1][1] = t;
    cr_assert_eq(tdm_pp_schedule_check(s), TDM_STATUS_INVALID_ARG);
    cr_assert(strstr(tdm_error_message(), "stage 1 runs B0"), "%s", tdm_error_message());
    tdm_pp_schedule_free(s);
    tdm_pp_schedule_kind k;
    cr_assert_eq(tdm_pp_schedule_parse("1F1B", &k), TDM_STATUS_OK);
    cr_assert_eq(k, TDM_PP_1F1B);
    cr_assert_eq(tdm_pp_schedule_parse("gpipe", &k), TDM_STATUS_OK);
    cr_assert_eq(k, TDM_PP_GPIPE);
    cr_assert_eq(tdm_pp_schedule_parse("interleaved", &k), TDM_STATUS_INVALID_ARG);
    cr_assert(strstr(tdm_error_message(), "expected gpipe or 1f1b"));
    cr_assert_eq(tdm_pp_schedule_build(&s, TDM_PP_GPIPE, 2, 0), TDM_STATUS_INVALID_ARG);
    cr_assert_eq(tdm_pp_schedule_build(&s, TDM_PP_GPIPE, 0, 2), TDM_STATUS_INVALID_ARG);
    /* each bound alone allowed 4096 x 2^20: 2^33 actions, counted in an int */
    cr_assert_eq(tdm_pp_schedule_build(&s, TDM_PP_1F1B, 4096, 1 << 20), TDM_STATUS_INVALID_ARG);
    cr_assert(strstr(tdm_error_message(), "4096 stages x 1048576 micro-batches"), "%s",
              tdm_error_message());
}

Test(pp_split, explicit_splits_and_one_line_errors)
{
    int f[8];   /* the longest case below names 5 stages */
    cr_assert_eq(tdm_pp_split_parse("0,2,3", 3, 4, f), TDM_STATUS_OK, "%s", tdm_error_message());
    cr_assert(f[0] == 0 && f[1] == 2 && f[2] == 3);
    static const struct { const char *text; int S, n; const char *msg; } bad[] = {
        {"0,2", 3, 4, "names 2 stage(s), but the pipeline has 3"},
        {"0,2,3,4", 3, 6, "names more than the pipeline's 3 stages"},
        {"1,2", 2, 4, "stage 0 must start at layer 0"},
        {"0,4", 2, 4, "stage 1 starts at layer 4, out of range (the model has 4 layers, 0..3)"},
        {"0,3,3", 3, 4, "stage 2 starts at layer 3, not after stage 1's first layer 3"},
        {"0,3,2", 3, 4, "not after stage 1's first layer 3"},
        {"0,a", 2, 4, "expected the first layer of each stage"},
        {"0,1,2,3,4", 5, 4, "more stages (5) than layers (4)"},
        {"0;1", 2, 4, "unexpected ';'"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        cr_assert_eq(tdm_pp_split_parse(bad[i].text, bad[i].S, bad[i].n, f),
                     TDM_STATUS_INVALID_ARG, "%s", bad[i].text);
        cr_assert(strstr(tdm_error_message(), bad[i].msg), "%s: %s", bad[i].text,
                  tdm_error_message());
        cr_assert(!strchr(tdm_error_message(), '\n'));
    }
    char buf[32];
    cr_assert_str_eq(tdm_pp_split_str((int[]){0, 3, 5}, 3, buf, sizeof buf), "0,3,5");
}

Test(pp_split, balanced_defaults)
{
    tdm_model_spec s;
    int f[8];
    /* an MLP with two heavy layers (8x512, 512x8: 4096 multiply-adds each,
     * the others 64, 64, 32): they go to different stages, the light ones
     * with them (max 64 + 4096) */
    tdm_model_spec_mlp(&s, (int[]){8, 8, 512, 8, 8, 4}, 6);
    cr_assert_eq(tdm_pp_split_balance(&s, 3, TDM_PP_BALANCE_FLOPS, f), TDM_STATUS_OK);
    cr_assert(f[0] == 0 && f[1] == 2 && f[2] == 3, "%d %d %d", f[0], f[1], f[2]);
    /* a GPT: the embeddings cost no gemm, the head does; 4 blocks on 2
     * stages: blocks split with the head's cost on the last */
    tdm_model_spec_gpt(&s, 4, 32, 2, 16);
    cr_assert_eq(tdm_pp_split_balance(&s, 2, TDM_PP_BALANCE_FLOPS, f), TDM_STATUS_OK);
    cr_assert(f[0] == 0 && (f[1] == 3 || f[1] == 4), "GPT split 0,%d", f[1]);
    /* by parameters the embeddings (256x32 + 16x32) weigh */
    cr_assert_eq(tdm_pp_split_balance(&s, 6, TDM_PP_BALANCE_PARAMS, f), TDM_STATUS_OK);
    for (int i = 0; i < 6; i++) cr_assert_eq(f[i], i);   /* one layer per stage */
    cr_assert_eq(tdm_pp_split_balance(&s, 7, TDM_PP_BALANCE_FLOPS, f), TDM_STATUS_INVALID_ARG);
    cr_assert(strstr(tdm_error_message(), "more stages (7) than layers (6)"), "%s",
              tdm_error_message());
    /* the CNN by flops: the convolutions weigh, not the linear layers */
    tdm_model_spec_cnn(&s);
    cr_assert_eq(tdm_pp_split_balance(&s, 2, TDM_PP_BALANCE_FLOPS, f), TDM_STATUS_OK);
    cr_assert(f[1] > 0 && f[1] <= 4, "CNN split 0,%d: the second stage should start by conv2",
              f[1]);
    cr_assert_eq(tdm_pp_split_balance(&s, 2, TDM_PP_BALANCE_PARAMS, f), TDM_STATUS_OK);
    /* by parameters fc1 (3136 x 128, most of them) and fc2 make the last
     * stage; the earliest such cut follows bn2 (pooling and flatten hold
     * nothing) */
    cr_assert_eq(f[1], 5, "CNN by parameters: 0,%d", f[1]);
}
