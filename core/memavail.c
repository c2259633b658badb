/* core/memavail.c: MemAvailable and the memory cgroup's headroom (see
 * core/memavail.h). Linux only: /proc/meminfo, /proc/self/cgroup and the
 * cgroup file systems under /sys/fs/cgroup (v2 unified, v1 memory). */
#include "core/memavail.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

/* A number from a one-line file ("max": no limit), 0 when unreadable. */
static int tdm_mem_read_u64(const char *path, uint64_t *v)
{
    char buf[64];
    FILE *f = fopen(path, "re");
    if (!f) return 0;
    int ok = fgets(buf, sizeof buf, f) != NULL;
    fclose(f);
    if (!ok) return 0;
    if (!strncmp(buf, "max", 3)) { *v = UINT64_MAX; return 1; }
    char *end;
    errno = 0;
    *v = strtoull(buf, &end, 10);
    return !errno && end != buf;
}

/* This process's anonymous and shared memory (RssAnon + RssShmem of
 * /proc/self/status): what a cgroup would count as its usage, less the
 * page cache. */
static uint64_t tdm_mem_self_bytes(void)
{
    FILE *f = fopen("/proc/self/status", "re");
    char line[256];
    uint64_t sum = 0;
    while (f && fgets(line, sizeof line, f)) {
        unsigned long long kb;
        if (sscanf(line, "RssAnon: %llu kB", &kb) == 1 || sscanf(line, "RssShmem: %llu kB", &kb) == 1)
            sum += (uint64_t)kb * 1024;
    }
    if (f) fclose(f);
    return sum;
}

/* The value of key in a cgroup's memory.stat (0 when absent). */
static uint64_t tdm_mem_stat_value(const char *dir, const char *key)
{
    char path[1200], line[256];
    snprintf(path, sizeof path, "%s/memory.stat", dir);
    FILE *f = fopen(path, "re");
    uint64_t v = 0;
    size_t klen = strlen(key);
    while (f && fgets(line, sizeof line, f))
        if (!strncmp(line, key, klen) && line[klen] == ' ') {
            v = strtoull(line + klen + 1, NULL, 10);
            break;
        }
    if (f) fclose(f);
    return v;
}

/* Lowers *avail to the headroom (limit - usage) of cgroup directory dir
 * and of every ancestor up to the hierarchy's root (a parent's limit
 * holds for its children); src names the bound that applied. */
static void tdm_mem_cgroup_headroom(const char *root, const char *rel, const char *max_name,
                                    const char *cur_name, const char *inactive_name,
                                    uint64_t *avail, char *src, size_t n)
{
    char dir[1024], path[1200];
    snprintf(dir, sizeof dir, "%s%s", root, rel);
    for (;;) {
        uint64_t lim, cur;
        snprintf(path, sizeof path, "%s/%s", dir, max_name);
        int have_lim = tdm_mem_read_u64(path, &lim);
        snprintf(path, sizeof path, "%s/%s", dir, cur_name);
        /* v1 writes "no limit" as a page-rounded LONG_MAX */
        if (have_lim && lim < ((uint64_t)1 << 62) && tdm_mem_read_u64(path, &cur)) {
            /* the usage counts the page cache, whose inactive part the
             * kernel reclaims before it kills anyone (the working set, as
             * container runtimes count it) */
            uint64_t inactive = tdm_mem_stat_value(dir, inactive_name);
            cur = cur > inactive ? cur - inactive : 0;
            uint64_t room = cur < lim ? lim - cur : 0;
            if (room < *avail) {
                *avail = room;
                snprintf(src, n, "cgroup %s: %s %llu, %s %llu less %llu of inactive page "
                         "cache", dir, max_name, (unsigned long long)lim, cur_name,
                         (unsigned long long)(cur + inactive), (unsigned long long)inactive);
            }
        }
        char *slash = strrchr(dir, '/');
        if (strlen(dir) <= strlen(root) || !slash) break;
        *slash = '\0';
    }
}

/* Bytes of memory this process can still take: MemAvailable, lowered to
 * the headroom of its memory cgroup (v2: memory.max - memory.current; v1:
 * memory.limit_in_bytes - memory.usage_in_bytes) and its ancestors'.
 * UINT64_MAX when nothing can be read. src says which bound it is. */
uint64_t tdm_mem_available(char *src, size_t n)
{
    uint64_t avail = UINT64_MAX;
    snprintf(src, n, "no limit found");
    FILE *f = fopen("/proc/meminfo", "re");
    char line[512];
    while (f && fgets(line, sizeof line, f)) {
        unsigned long long kb;
        if (sscanf(line, "MemAvailable: %llu kB", &kb) == 1) {
            avail = (uint64_t)kb * 1024;
            snprintf(src, n, "MemAvailable in /proc/meminfo");
            break;
        }
    }
    if (f) fclose(f);
    f = fopen("/proc/self/cgroup", "re");
    while (f && fgets(line, sizeof line, f)) {
        line[strcspn(line, "\n")] = '\0';
        char *a = strchr(line, ':'), *b = a ? strchr(a + 1, ':') : NULL;
        if (!b) continue;
        *b++ = '\0';
        struct stat sb;
        char probe[1024];
        if (!strcmp(line, "0") && !a[1]) {          /* v2: "0::/path" */
            static const char *const roots[] = {"/sys/fs/cgroup", "/sys/fs/cgroup/unified"};
            for (int i = 0; i < 2; i++) {
                snprintf(probe, sizeof probe, "%s%s/memory.current", roots[i], b);
                if (stat(probe, &sb) == 0) {
                    tdm_mem_cgroup_headroom(roots[i], b, "memory.max", "memory.current",
                                            "inactive_file", &avail, src, n);
                    break;
                }
            }
        } else {                                      /* v1: "N:memory,...:/path" */
            int mem = 0;
            char *save = NULL;
            for (char *t = strtok_r(a + 1, ",", &save); t; t = strtok_r(NULL, ",", &save))
                mem |= !strcmp(t, "memory");
            if (!mem) continue;
            snprintf(probe, sizeof probe, "/sys/fs/cgroup/memory%s/memory.usage_in_bytes", b);
            /* inside a cgroup namespace the hierarchy's root is our own */
            const char *rel = stat(probe, &sb) == 0 ? b : "";
            tdm_mem_cgroup_headroom("/sys/fs/cgroup/memory", rel, "memory.limit_in_bytes",
                                    "memory.usage_in_bytes", "total_inactive_file", &avail, src,
                                    n);
        }
    }
    if (f) fclose(f);
    /* a budget below the machine's, for tests: a cgroup of that limit
     * whose usage is this process's own memory; lowers, never raises */
    const char *cap = getenv(TDM_MEM_ENV_LIMIT);
    if (cap && *cap) {
        char *end;
        errno = 0;
        unsigned long long v = strtoull(cap, &end, 10);
        uint64_t used = tdm_mem_self_bytes();
        uint64_t room = v > used ? v - used : 0;
        if (!errno && end != cap && !*end && room < avail) {
            avail = room;
            snprintf(src, n, "%s=%llu, this process using %llu", TDM_MEM_ENV_LIMIT, v,
                     (unsigned long long)used);
        }
    }
    return avail;
}
