/* core/log.h: debug logging switched by the TANDEM_DEBUG environment
 * variable, in the spirit of NCCL_DEBUG / NCCL_DEBUG_SUBSYS.
 *
 *   TANDEM_DEBUG=WARN|INFO|TRACE      level (default: WARN)
 *   TANDEM_DEBUG_SUBSYS=SHM,DDP,...   subsystems to show (default: ALL;
 *                                     a leading ^ excludes the list)
 *   TANDEM_DEBUG_FILE=path            write there instead of stderr
 *                                     (%p in the name becomes the pid)
 *
 * Lines look like "tandem 4121 [rank 2] SHM INFO: message". This is for
 * diagnostics only; user-facing output belongs to tools/. */
#ifndef TDM_CORE_LOG_H
#define TDM_CORE_LOG_H

#ifdef __cplusplus
extern "C" {
#endif

typedef enum tdm_log_level {
    TDM_LOG_LEVEL_NONE = 0,
    TDM_LOG_LEVEL_WARN,
    TDM_LOG_LEVEL_INFO,
    TDM_LOG_LEVEL_TRACE,
} tdm_log_level;

typedef enum tdm_log_subsys {
    TDM_LOG_CORE = 0,
    TDM_LOG_DEVICE,
    TDM_LOG_MODEL,
    TDM_LOG_DATA,
    TDM_LOG_DP,
    TDM_LOG_DDP,
    TDM_LOG_SHM,
    TDM_LOG_CUDA,
    TDM_LOG_TOOL,
    TDM_LOG_MPI,
    TDM_LOG_FSDP,
    TDM_LOG_SUBSYS_COUNT_
} tdm_log_subsys;

/* Cheap check used by the macros; reads the environment once. */
int tdm_log_enabled(tdm_log_level level, tdm_log_subsys subsys);
void tdm_log_write(tdm_log_level level, tdm_log_subsys subsys,
                   const char *fmt, ...) __attribute__((format(printf, 3, 4)));
/* Tag lines with a rank (-1: none). Set by the DDP process group. */
void tdm_log_set_rank(int rank);
/* Re-read the environment (tests, and after fork in launchers). */
void tdm_log_reset(void);

#define TDM_LOG_(lvl, sub, ...)                                         \
    do {                                                                \
        if (tdm_log_enabled((lvl), (sub)))                              \
            tdm_log_write((lvl), (sub), __VA_ARGS__);                   \
    } while (0)
#define TDM_WARN(sub, ...) TDM_LOG_(TDM_LOG_LEVEL_WARN, TDM_LOG_##sub, __VA_ARGS__)
#define TDM_INFO(sub, ...) TDM_LOG_(TDM_LOG_LEVEL_INFO, TDM_LOG_##sub, __VA_ARGS__)
#define TDM_TRACE(sub, ...) TDM_LOG_(TDM_LOG_LEVEL_TRACE, TDM_LOG_##sub, __VA_ARGS__)

#ifdef __cplusplus
}
#endif

#endif
