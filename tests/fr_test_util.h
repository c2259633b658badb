/* tests/fr_test_util.h: a job of labelled "DDP bucket" all_reduces run
 * in forked shm ranks with one injected fault, for the flight recorder's
 * tests (test_flight.c) and the doctor's (test_doctor.c). Header-only. */
#ifndef TDM_TESTS_FR_TEST_UTIL_H
#define TDM_TESTS_FR_TEST_UTIL_H

#include <criterion/criterion.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "core/comm.h"
#include "core/json.h"
#include "shm/spawn.h"
#include "tests/timeout_util.h"

typedef enum fr_t_fault {
    FR_T_NONE = 0,
    FR_T_SKIP,      /* the faulty rank skips bucket 1 */
    FR_T_GATHER,    /* it calls all_gather where the others all_reduce */
    FR_T_COUNT,     /* it reduces one element more */
    FR_T_STOP,      /* it stops (SIGSTOP) before bucket 1 */
    FR_T_KILL,      /* it dies (SIGKILL) before bucket 1 */
    FR_T_PAUSE,     /* no fault: it is stopped for FR_T_PAUSE_MS before bucket 1,
                       as a loaded machine may leave a healthy rank unscheduled */
    FR_T_EXTRA,     /* it calls an extra all_reduce (16 floats, 'extra') before
                       bucket 1: the `if rank == 0:` bug */
} fr_t_fault;

#define FR_T_PAUSE_MS 700
#define FR_T_SLOW_MS 1500

#define FR_T_BUCKETS 3
static const size_t fr_t_count[FR_T_BUCKETS] = {64, 48, 32};

typedef struct fr_t_job {
    int steps, fault_step, fault_rank;
    fr_t_fault fault;
    /* > 0: this healthy rank is stopped for FR_T_SLOW_MS where the fault
     * strikes (as a loaded machine may leave a survivor unscheduled just
     * when it should notice the failure and dump); 0: none */
    int slow_rank;
} fr_t_job;

/* Stops this process for ms, then a child it forked first resumes it. */
static inline void fr_t_pause(int ms)
{
    pid_t me = getpid(), c = fork();
    if (c == 0) {
        usleep((useconds_t)ms * 1000);
        kill(me, SIGCONT);
        _exit(0);
    }
    if (c > 0) {
        raise(SIGSTOP);
        waitpid(c, NULL, 0);
    }
}

/* Each step: bucket 0 asynchronously (as DDP overlaps it), buckets 1 and
 * 2 synchronously, then the step is counted. */
static inline int fr_t_rank(tdm_comm *comm, void *arg)
{
    const fr_t_job *j = arg;
    int me = tdm_comm_rank(comm), W = tdm_comm_size(comm);
    float buf[256] = {0};
    for (int s = 0; s < j->steps; s++) {
        int faulty = me == j->fault_rank && s == j->fault_step;
        for (int b = 0; b < FR_T_BUCKETS; b++) {
            size_t n = fr_t_count[b];
            if (j->slow_rank > 0 && me == j->slow_rank && s == j->fault_step && b == 1)
                fr_t_pause(FR_T_SLOW_MS);
            if (faulty && b == 1) {
                if (j->fault == FR_T_SKIP) continue;
                if (j->fault == FR_T_STOP) raise(SIGSTOP);
                if (j->fault == FR_T_KILL) raise(SIGKILL);
                if (j->fault == FR_T_PAUSE) fr_t_pause(FR_T_PAUSE_MS);
                if (j->fault == FR_T_COUNT) n++;
                if (j->fault == FR_T_EXTRA) {
                    tdm_comm_set_label(comm, "extra");
                    if (tdm_comm_all_reduce(comm, buf, buf, 16, TDM_DTYPE_FLOAT32, TDM_REDOP_SUM))
                        return 1;
                }
            }
            tdm_comm_set_label(comm, "ddp bucket %d", b);
            tdm_status st;
            if (faulty && b == 1 && j->fault == FR_T_GATHER) {
                st = tdm_comm_all_gather(comm, buf + (size_t)me * (n / (size_t)W), buf,
                                         n / (size_t)W, TDM_DTYPE_FLOAT32);
            } else if (b == 0) {
                tdm_comm_work *w = NULL;
                st = tdm_comm_all_reduce_async(comm, buf, buf, n, TDM_DTYPE_FLOAT32,
                                               TDM_REDOP_SUM, &w);
                if (!st) st = tdm_comm_work_wait(w, -1);
                tdm_comm_work_free(w);
            } else {
                st = tdm_comm_all_reduce(comm, buf, buf, n, TDM_DTYPE_FLOAT32, TDM_REDOP_SUM);
            }
            if (st) return 1;
        }
        tdm_comm_set_step(comm, s + 1);
    }
    return 0;
}

/* A fresh private directory for the dumps: TANDEM_FR_DUMP. */
static inline void fr_t_dump_dir(char *dir, size_t n)
{
    snprintf(dir, n, "/tmp/tdm_fr_test_XXXXXX");
    cr_assert_not_null(mkdtemp(dir));
    setenv("TANDEM_FR_DUMP", dir, 1);
}

static inline void fr_t_rm_dir(const char *dir)
{
    char cmd[512];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    cr_assert_eq(system(cmd), 0);
}

/* Runs the job in W ranks; returns the spawn's status. */
static inline tdm_status fr_t_run(int W, const fr_t_job *j)
{
    /* After the first failure the survivors must see it and dump before
     * the teardown stops them: a grace of 1 s cut off a survivor that a
     * loaded machine left unscheduled (.slow_rank), whose dump the doctor
     * then missed; it costs only where a rank is stopped for good. */
    tdm_shm_spawn_opts so = {.timeout_ms = 60000, .grace_ms = tu_scaled_ms(3000)};
    /* SIGSTOP named within seconds; a healthy rank left unscheduled for
     * FR_T_PAUSE_MS (a loaded machine) is not: 500 ms named it */
    so.shm.stall_ms = tu_scaled_ms(1500);
    so.shm.timeout_ms = 30000;
    return tdm_shm_spawn(W, fr_t_rank, (void *)j, &so, NULL);
}

/* Rank r's dump, parsed (NULL when absent). */
static inline tdm_json *fr_t_load(const char *dir, int r)
{
    char path[512];
    snprintf(path, sizeof path, "%s/fr_rank_%d.json", dir, r);
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    static char text[1 << 20];
    size_t n = fread(text, 1, sizeof text, f);
    fclose(f);
    tdm_json *doc = NULL;
    cr_assert_eq(tdm_json_parse(&doc, text, n), TDM_STATUS_OK, "%s: %s", path, text);
    return doc;
}

#endif
