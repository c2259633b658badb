/* core/memavail.h: how much memory this process can still take, before it
 * takes it: MemAvailable, lowered to the headroom of its memory cgroup and
 * every ancestor's (a cgroup's limit is enforced by the OOM killer, not
 * by a failing allocation, so a request past it must be refused up
 * front). Used by the shared-memory segment (shm/segment.c) and by a
 * training run's whole plan (models/mem_plan.h). Not a memory accountant:
 * one reading, at the moment it is asked. */
#ifndef TDM_CORE_MEMAVAIL_H
#define TDM_CORE_MEMAVAIL_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Tests (and anyone who wants a smaller budget) may lower the figure:
 * TANDEM_TEST_MEM_LIMIT=BYTES acts as a memory cgroup of that limit whose
 * usage is this process's anonymous and shared memory (the headroom is
 * the limit less that); it can only lower what the machine has, never
 * raise it. Read here and nowhere else. */
#define TDM_MEM_ENV_LIMIT "TANDEM_TEST_MEM_LIMIT"

/* Bytes this process can still take: MemAvailable from /proc/meminfo,
 * lowered to the headroom (limit - usage) of its memory cgroup and of each
 * ancestor (v2: memory.max - memory.current; v1: memory.limit_in_bytes -
 * memory.usage_in_bytes), and to TANDEM_TEST_MEM_LIMIT when set.
 * UINT64_MAX when none can be read. src (n bytes) names the bound that
 * applied, with its figures, for messages. */
uint64_t tdm_mem_available(char *src, size_t n);

#ifdef __cplusplus
}
#endif

#endif
