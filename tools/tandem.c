/* tools/tandem.c: the tandem command: dispatches to the subcommands, and
 * turns the status a subcommand ends with into the exit code
 * (tdm_tool_exit, tools/tools.h). Subcommands are linked weakly so that
 * the list printed by --help is exactly the set that was built into this
 * binary. */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "tools/tools.h"

#pragma weak tdm_tool_train_main
#pragma weak tdm_tool_info_main
#pragma weak tdm_tool_bench_main
#pragma weak tdm_tool_launch_main
#pragma weak tdm_tool_compare_main
#pragma weak tdm_tool_sample_main
#pragma weak tdm_tool_eval_main
#pragma weak tdm_tool_doctor_main
#pragma weak tdm_tool_selftest_main

int tdm_tool_exit(tdm_status st)
{
    if (st == TDM_STATUS_OK) return 0;
    return st == TDM_STATUS_USAGE ? 2 : 1;
}

tdm_status tdm_tool_usage(tdm_status st)
{
    return st == TDM_STATUS_OK ? st : TDM_STATUS_USAGE;
}

tdm_status tdm_tool_usage_error(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    return TDM_STATUS_USAGE;
}

typedef int (*tdm_tool_main_fn)(int, char **);

static const struct {
    const char *name;
    tdm_tool_main_fn fn;
    const char *help;
} tdm_tool_cmds[] = {
    {"train", tdm_tool_train_main, "train a model: one device, DP, DDP or FSDP/ZeRO (--mode)"},
    {"sample", tdm_tool_sample_main, "generate text with a GPT checkpoint"},
    {"eval", tdm_tool_eval_main, "a checkpoint's loss and accuracy (bits per byte) on data"},
    {"plan", tdm_tool_plan_main, "predicted peak memory per device, before a run"},
    {"compare", tdm_tool_compare_main, "one device, DP, DDP, FSDP, ZeRO-2, ZeRO-1 and "
                                       "PP side by side"},
    {"launch", tdm_tool_launch_main, "run N ranks of your own program (like torchrun)"},
    {"bench", tdm_tool_bench_main, "benchmarks: bench <collective> (nccl-tests columns), "
                                   "bench gemm, bench train, bench dp"},
    {"doctor", tdm_tool_doctor_main, "diagnose a failed job from its flight-recorder dumps"},
    {"selftest", tdm_tool_selftest_main, "check that multi-device training works here (CI, JUnit)"},
    {"info", tdm_tool_info_main, "build configuration and visible devices"},
};
#define TDM_TOOL_NCMDS (sizeof tdm_tool_cmds / sizeof tdm_tool_cmds[0])

static void tdm_tool_usage_print(FILE *f)
{
    fprintf(f, "usage: tandem <command> [options]   (tandem <command> --help for details)\n\n"
               "tandem trains neural networks on several devices of one machine, with\n"
               "DataParallel (threads), DistributedDataParallel (processes) and sharded data\n"
               "parallel (FSDP, ZeRO-2, ZeRO-1) side by side.\n"
               "Started by mpirun or srun, train --mode ddp, compare and bench <collective>\n"
               "run across machines (--backend shm|mpi|hier; docs/MULTINODE.md).\n\n"
               "commands:\n");
    for (size_t i = 0; i < TDM_TOOL_NCMDS; i++)
        if (tdm_tool_cmds[i].fn)
            fprintf(f, "  %-9s %s\n", tdm_tool_cmds[i].name, tdm_tool_cmds[i].help);
    fprintf(f, "\n  --version print tandem's version (tandem info: the whole build)\n");
    fprintf(f, "\nenvironment: TANDEM_DEBUG=WARN|INFO|TRACE, "
               "TANDEM_DEBUG_SUBSYS=SHM,DP,DDP,FSDP,...\n");
}

int main(int argc, char **argv)
{
    if (argc < 2 || !strcmp(argv[1], "--help") || !strcmp(argv[1], "-h") ||
        !strcmp(argv[1], "help")) {
        tdm_tool_usage_print(argc < 2 ? stderr : stdout);
        return tdm_tool_exit(argc < 2 ? TDM_STATUS_USAGE : TDM_STATUS_OK);
    }
    if (!strcmp(argv[1], "--version") || !strcmp(argv[1], "-V")) {
        printf("tandem %s\n", tdm_tool_version());
        return tdm_tool_exit(TDM_STATUS_OK);
    }
    for (size_t i = 0; i < TDM_TOOL_NCMDS; i++)
        if (tdm_tool_cmds[i].fn && !strcmp(argv[1], tdm_tool_cmds[i].name)) {
            char tool[32];
            snprintf(tool, sizeof tool, "tandem %s", argv[1]);
            tdm_status st = tdm_tool_check_env(tool);
            if (st != TDM_STATUS_OK) return tdm_tool_exit(st);
            return tdm_tool_cmds[i].fn(argc - 1, argv + 1);
        }
    fprintf(stderr, "tandem: unknown command '%s'\n", argv[1]);
    tdm_tool_usage_print(stderr);
    return tdm_tool_exit(TDM_STATUS_USAGE);
}
