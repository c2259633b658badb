/* tools/doctor.h: `tandem doctor DIR`, the cross-rank diagnosis of the
 * flight recorder's dumps (core/flight.h), also called in-process by
 * `tandem launch` and `tandem train --mode ddp` after a failure to print
 * its one-line verdict. docs/DEBUGGING.md explains how to read it. */
#ifndef TDM_TOOLS_DOCTOR_H
#define TDM_TOOLS_DOCTOR_H

#include <stddef.h>
#include <stdio.h>

#include "core/status.h"

#include "shm/spawn.h"

/* Verdicts, which are also `tandem doctor`'s exit codes. */
typedef enum tdm_doctor_verdict {
    TDM_DOCTOR_OK = 0,        /* every rank's record is complete and they agree */
    TDM_DOCTOR_UNREADABLE = 1,/* no dump could be read */
    TDM_DOCTOR_USAGE = 2,
    TDM_DOCTOR_DESYNC = 3,    /* ranks called different collectives at the same seq */
    TDM_DOCTOR_DIED = 4,      /* a rank died (signal, non-zero exit) */
    TDM_DOCTOR_STALLED = 5,   /* a rank stopped or froze (no heartbeat), or a wait timed out */
    TDM_DOCTOR_FAILED = 6,    /* a rank failed otherwise (its own error, an abort) */
} tdm_doctor_verdict;

/* The launcher's summary, written next to the dumps (DIR/launch.json). */
#define TDM_DOCTOR_SUMMARY "launch.json"

/* How rank `rank` ended, in the launcher's summary's words ("was killed
 * by signal 9 (Killed)", in buf), NULL when it says nothing or the rank
 * exited 0; *induced: the launcher's teardown ended it. */
typedef const char *(*tdm_doctor_end_fn)(void *ctx, int rank, int *induced, char *buf,
                                         size_t n);
/* A pipeline job's verdict (tools/doctor_pp.c), from every dump in DIR
 * (each rank's communicators, the stages' links among them): the stage
 * the waiting stages waited on, what it never sent and how it ended -
 * "STALLED: stage 2 (rank 2) never sent grad mb 0 to stage 1 (rank 1):
 * ...". Returns 1 with *v and line set, 0 when no pipeline transfer was
 * left waiting. */
int tdm_doctor_pipeline(const char *dir, tdm_doctor_end_fn end_of, void *ctx,
                        tdm_doctor_verdict *v, char *line, size_t n);
/* An RPC job's verdict (tools/doctor_rpc.c), from the RPC endpoints'
 * dumps in DIR (backend "rpc"): a rank killed outright, with the last of
 * its calls another served, else the call left waiting first and why its
 * callee did not answer - "STALLED: rank 2 waited 5.0 s for the reply to
 * ps.push #7 from rank 0, which never served it: rank 0 was stopped or
 * frozen (...)". detail: a line per call not answered. Returns 1 with
 * *v, line and detail set; 0 when DIR holds no such call or death. */
int tdm_doctor_rpc(const char *dir, tdm_doctor_end_fn end_of, void *ctx, tdm_doctor_verdict *v, char *line,
                   size_t n, char *detail, size_t dn);
/* DIR/name parsed (NULL when unreadable or not JSON). */
struct tdm_json *tdm_doctor_load(const char *dir, const char *name);

/* Reads DIR's dumps (and summary), prints the diagnosis on out (NULL:
 * nothing printed) and copies the one-line verdict into line. */
tdm_doctor_verdict tdm_doctor_diagnose(const char *dir, FILE *out, char *line, size_t n);

/* Writes DIR/launch.json: the job id (the ranks' TANDEM_JOB_ID; NULL:
 * none), world, each rank's pid and waitpid status (< 0: still running),
 * and the root cause as the launcher worded it (cause may be NULL).
 * Returns 0 on success. */
int tdm_doctor_write_summary(const char *dir, const char *job, int world, const int *pid,
                             const int *wstatus, const int *induced, const char *cause);
/* The same, with stalled (may be NULL): 1 for a rank that was still
 * running, with no dump and no exit of its own, when every other rank had
 * ended or was waiting (stopped or frozen: a later SIGKILL of it was the
 * teardown's, not how it failed). */
int tdm_doctor_write_summary_stalled(const char *dir, const char *job, int world,
                                     const int *pid, const int *wstatus, const int *induced,
                                     const int *stalled, const char *cause);

/* A job whose ranks dump on failure, as tandem launch and tandem train
 * --mode ddp run them: begin before starting ranks, end after. */
typedef struct tdm_doctor_job {
    const char *tool;      /* "tandem launch", for messages */
    char dir[4096];
    int created;           /* 1: a temporary directory of ours */
    int on;                /* 0: no directory (the recorder's dumps are off) */
    int set_env, set_on;   /* 1: we exported TANDEM_FR_DUMP / TANDEM_FR_DUMP_ON */
    int early_done;        /* 1: tdm_doctor_job_settled printed `early` */
    char job[24];          /* this job's id, exported to the ranks as TANDEM_JOB_ID */
    char job_was[64];      /* TANDEM_JOB_ID before (restored at the end) */
    int had_job;
    char early[1024];
    int stalled[TDM_SHM_MAX_RANKS];   /* still running (stopped) when the job settled */
} tdm_doctor_job;

/* Draws the job's id (exported as TANDEM_JOB_ID: every dump and the
 * summary carry it, and the doctor reads only this job's), and points the
 * ranks' recorders at a directory (TANDEM_FR_DUMP, exported):
 * the user's TANDEM_FR_DUMP if set, else dir_hint (a --log-dir) if given,
 * else a new private directory under $TMPDIR (/tmp), and asks for dumps
 * on failure only (TANDEM_FR_DUMP_ON=failure) unless the user chose.
 * The user's TANDEM_FR_DUMP must pass --log-dir's rule (core/safefile.h:
 * tdm_dir_open_safe): else the message is printed ("<tool>: ...") and
 * TDM_STATUS_USAGE returned (the job must not start). */
tdm_status tdm_doctor_job_begin(tdm_doctor_job *j, const char *tool, const char *dir_hint);
/* While a failed job is torn down, once every rank still running is
 * stopped (tdm_shm_watch_only_stopped, a tdm_shm_settled_fn; job is the
 * tdm_doctor_job): every rank that could dump has, and a stopped one can
 * only be SIGKILLed after the grace period. Writes a summary as things
 * stand (the stopped ranks running), prints "<tool>: doctor: <verdict>"
 * at once and which ranks the teardown still has to kill, and keeps the
 * verdict, so that tdm_doctor_job_end does not print the same one again.
 * Once per job; nothing when the job has no dump directory. */
void tdm_doctor_job_settled(const tdm_shm_watch *w, void *job);
/* After the job: on failure writes the summary (pid, wstatus may be NULL;
 * induced may be NULL), prints "<tool>: doctor: <verdict>" and where the
 * dumps are, and returns the verdict; a directory of ours that no rank
 * dumped into is removed instead (the verdict then comes from the
 * summary alone), and one that is kept prunes the older ones
 * (tdm_doctor_dirs_prune). On success removes a directory of ours and
 * returns TDM_DOCTOR_OK. */
tdm_doctor_verdict tdm_doctor_job_end(tdm_doctor_job *j, int failed, int world, const int *pid,
                                      const int *wstatus, const int *induced, const char *cause);

/* The $TMPDIR/tandem-fr-* directories of failed jobs (tools/doctor_dirs.c).
 * At most this many are kept, the newest (a new failure prunes the rest)... */
#define TDM_DOCTOR_KEEP_DIRS 5
/* ...and none younger than this (seconds), which whoever ran the job may
 * still be reading. */
#define TDM_DOCTOR_KEEP_YOUNG_S 60
/* The ranks' dumps (fr_rank_<R>.json) in dir. */
int tdm_doctor_dir_dumps(const char *dir);
/* Removes dir and the files tandem wrote in it (dumps, the summary); a
 * directory holding anything else stays. 0 when it is gone. */
int tdm_doctor_dir_remove(const char *dir);
/* Removes the tandem-fr-* directories of this user in tmpdir beyond the
 * newest TDM_DOCTOR_KEEP_DIRS, older than TDM_DOCTOR_KEEP_YOUNG_S, that
 * hold only what tandem writes there. Returns how many went. */
int tdm_doctor_dirs_prune(const char *tmpdir);

int tdm_tool_doctor_main(int argc, char **argv);

#endif
